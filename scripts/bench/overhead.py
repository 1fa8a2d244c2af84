# SPDX-License-Identifier: Apache-2.0
"""Engine overhead at batch 1: the share of decode wall time spent outside the model forwards
(scheduling, sampling, bookkeeping, detokenizing), then a cProfile of the decode loop."""

from __future__ import annotations

import cProfile
import io
import pstats
import time

from scripts.bench.datasets import batch_prompts
from scripts.bench.report import block_header
from scripts.bench.variants import Variant, greedy_params

FUSED_ROUND = "fused NEXTN round"


class ForwardTimer:
    """Wraps a runner's `forward`, `draft_round` (a whole captured draft round) and
    `build_context` (instance attributes shadow the class methods, so the workers call the
    wrappers) and sums their wall time. `methods`: the forward methods to time (a fused
    NEXTN round's is `run`, `CapturedRound`)."""

    def __init__(self, runner, methods: tuple[str, ...] = ("forward", "draft_round")):
        self.runner, self.forward_s, self.context_s = runner, 0.0, 0.0
        self.methods = methods
        build = getattr(runner, "build_context", None)  # optional: only splits the report

        def timed(fn):
            def call(*args):
                start = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    self.forward_s += time.perf_counter() - start

            return call

        def timed_build(inp):
            start = time.perf_counter()
            try:
                return build(inp)
            finally:
                self.context_s += time.perf_counter() - start

        for name in methods:
            method = getattr(runner, name, None)
            if method is not None:
                setattr(runner, name, timed(method))
        if build is not None:
            runner.build_context = timed_build

    def reset(self) -> None:
        self.forward_s = self.context_s = 0.0

    def remove(self) -> None:
        for name in (*self.methods, "build_context"):
            self.runner.__dict__.pop(name, None)  # the class methods show through again


class CompiledCodeTimer:
    """Sums the wall time inside inductor's compiled code (`CompiledFxGraph.__call__`, the
    generated kernels of a captured step on CPU) while installed, so that a captured call's
    time splits into the compiled code and the dynamo / AOT autograd wrappers around it.
    A torch internal: when it is missing (another release, CUDA graphs) nothing is timed."""

    def __init__(self):
        self.seconds, self.calls, self._cls, self._orig = 0.0, 0, None, None
        try:
            from torch._inductor.output_code import CompiledFxGraph
        except ImportError:
            return
        self._cls, self._orig = CompiledFxGraph, CompiledFxGraph.__call__
        orig = self._orig

        def call(graph, inputs):
            start = time.perf_counter()
            try:
                return orig(graph, inputs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        CompiledFxGraph.__call__ = call

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def remove(self) -> None:
        if self._cls is not None:
            self._cls.__call__ = self._orig


def profile_overhead(engine, variant: Variant, args) -> dict:
    """Batch 1: decode wall time vs time inside the target (and draft) forwards, then a
    cProfile of a second decode loop (separate, so profiling cost does not skew the share)."""
    input_len, output_len = args.input_len[0], max(args.output_len)
    prompts = batch_prompts(
        args.seed + 2, 1, input_len, engine.model_config.vocab_size, args.file_prompts
    )
    timers = {"target": ForwardTimer(engine.runner)}
    if variant.spec:
        timers["draft"] = ForwardTimer(engine.worker.drafter.runner)
        fused = engine.worker.captured_round
        if fused.enabled():  # greedy rounds run both models in one graph
            timers[FUSED_ROUND] = ForwardTimer(fused, ("run",))
    compiled = CompiledCodeTimer()
    try:
        reqs = [engine.make_request(prompts[0], greedy_params(output_len))]
        engine.add_request(reqs[0])
        engine.step()  # prefill, not part of the decode share
        for t in timers.values():
            t.reset()
        compiled.reset()
        start = time.perf_counter()
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        wall = time.perf_counter() - start
    finally:
        for t in timers.values():
            t.remove()
        compiled.remove()
    inside = sum(t.forward_s for t in timers.values())
    context = sum(t.context_s for t in timers.values())
    report = {
        "run_name": args.run_name,
        "variant": variant.label,
        "kind": "overhead",
        "batch_size": 1,
        "input_len": input_len,
        "output_len": output_len,
        "decode_wall_s": wall,
        "decode_steps": steps,
        "forward_share": {k: t.forward_s / wall for k, t in timers.items()},
        "context_build_share": context / wall,
        "engine_overhead_share": (wall - inside) / wall,
        "compiled_code_share": compiled.seconds / wall,
        "compiled_calls_per_step": compiled.calls / max(steps, 1),
    }
    print("\n" + block_header(f"Engine overhead [{variant.label}]"))
    print(
        f"batch 1, input len {input_len}, output len {output_len}: decode wall time "
        f"{wall * 1000:.1f} ms over {steps} steps ({wall / steps * 1000:.2f} ms/step)"
    )
    for name, share in report["forward_share"].items():
        what = "(target and draft in one graph)" if name == FUSED_ROUND else "runner forward"
        print(f"{name} {what}: {share * 100:.1f}% of decode wall time")
    print(f"  (ForwardContext.build inside those forwards: {context / wall * 100:.1f}%)")
    if compiled.calls:
        print(
            f"  (inductor's compiled code: {report['compiled_code_share'] * 100:.1f}% over "
            f"{report['compiled_calls_per_step']:.1f} calls per step, "
            f"{compiled.seconds / compiled.calls * 1000:.2f} ms per call; the rest of a "
            "captured call is the metadata, dynamo's and AOT autograd's wrappers)"
        )
    print(
        f"engine overhead: {report['engine_overhead_share'] * 100:.1f}% of decode wall time "
        "(scheduling, sampling, bookkeeping, detokenizing)"
    )
    print_decode_profile(engine, prompts[0], output_len, args.profile_top)
    return report


def print_decode_profile(engine, prompt: list[int], output_len: int, top: int) -> None:
    """cProfile of one batch-1 decode loop, top entries by cumulative time."""
    req = engine.make_request(prompt, greedy_params(output_len))
    engine.add_request(req)
    engine.step()
    profiler = cProfile.Profile()
    profiler.enable()
    while engine.has_work():
        engine.step()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
    print(f"cProfile of the decode loop (top {top} by cumulative time):")
    text = out.getvalue().strip().splitlines()
    start = next((i for i, line in enumerate(text) if "ncalls" in line), 0)
    print("\n".join(text[start:]))
