# SPDX-License-Identifier: Apache-2.0
"""Compiling captured steps ahead of the traffic (`--capture-compile startup`, benchmarks).

Captured steps compile the first time a batch bucket needs them. A server that must not
meet a compile under load (a benchmark at request rate inf, a production start behind a
load balancer) compiles them all before it serves, as SGLang captures every CUDA-graph
batch size at start-up: one short warm-up request meets every kind of step the engine runs
(decode, or target verify and the draft's steps), then each kind compiles at every bucket.
With a measured speculation policy each bucket's decode modes are then timed
(`speculation_calibration`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from runtime.core.forward_mode import ForwardMode
from runtime.engine.speculation_calibration import calibrate_speculation
from runtime.execution.graph_runner import StepKey, no_new_compiles
from runtime.speculative.speculation_policy import FixedLimit

logger = logging.getLogger(__name__)


def captured_runners(engine) -> list:
    """The engine's model runners that replay captured steps (target, then the MTP draft)."""
    runners = [engine.runner]
    speculation = engine.worker.speculation
    if speculation is not None:
        runners.append(speculation.drafter.runner)
    return [r for r in runners if r.graph_runner is not None and r.graph_runner.capturable]


def captured_buckets(engine, max_batch: int | None = None) -> list[int]:
    """The captured batch buckets a run of at most `max_batch` concurrent requests can use
    (every bucket when None)."""
    buckets = {b for r in captured_runners(engine) for b in usable_buckets(r, max_batch)}
    return sorted(buckets)


def target_buckets(engine, max_batch: int | None = None) -> list[int]:
    """The target's captured buckets such a run can use; [] where its steps are not
    captured."""
    runner = engine.runner
    return usable_buckets(runner, max_batch) if runner in captured_runners(engine) else []


def usable_buckets(runner, max_batch: int | None) -> list[int]:
    graph_runner = runner.graph_runner
    largest = None if max_batch is None else graph_runner.bucket_for(max_batch)
    return [b for b in graph_runner.buckets if largest is None or b <= largest]


def warm_up(engine, num_tokens: int = 8, sampled: bool = True) -> None:
    """One short greedy request through the engine, so each kind of step it runs is seen.
    Where greedy NEXTN rounds run as one fused step (`CapturedRound`), a sampled request
    (`sampled`) meets the steps of the round run step by step, which every other request
    uses. Where speculation may be off (in large batches, or in any bucket its measured
    policy chooses), another greedy one decodes without speculating; it runs eagerly, so
    its plain decode step compiles only at the buckets a batch meets (`compile_buckets`),
    not at its own batch size. The prefix cache forgets them all, and a measured policy
    the warm-up's timings."""
    bos = engine.requests.bos_token_id
    width = engine.spec_config.num_draft_tokens if engine.spec_config else 1
    prompt = [bos if bos is not None else 0] + list(range(3, 3 + 2 * width))
    params = {"max_new_tokens": max(num_tokens, 3 * width), "temperature": 0}
    engine.run_to_completion(engine.requests.make_requests(prompt, params))
    speculation = engine.worker.speculation
    if speculation is None:
        engine.flush_cache()
        return
    fused = speculation.captured_round
    if sampled and fused.enabled():
        seeded = {**params, "temperature": 1.0, "sampling_seed": 0}
        engine.run_to_completion(engine.requests.make_requests(prompt, seeded))
    policy = speculation.policy
    if policy.plain_from() is not None:
        graph_runners = [r.graph_runner for r in captured_runners(engine)]
        try:
            speculation.policy = FixedLimit(1)
            with no_new_compiles(graph_runners):
                engine.run_to_completion(engine.requests.make_requests(prompt, params))
        finally:
            speculation.policy = policy
    policy.reset()  # the warm-up's steps timed its compiles, not the captured steps
    engine.flush_cache()


def reachable_steps(engine, runner) -> Callable[[StepKey], bool] | None:
    """Which of `runner`'s captured steps a batch can meet (None: all of them). With
    speculation off from `limit` requests on, verify rounds and the draft's steps run only
    in batches below `limit`, and the target's plain decode step only in batches of `limit`
    and more."""
    speculation = engine.worker.speculation
    policy = None if speculation is None else speculation.policy
    limit = None if policy is None or policy.measured else policy.plain_from()
    if limit is None:  # a measured policy may run either mode at any bucket
        return None
    graph_runner = runner.graph_runner
    plain_from = graph_runner.bucket_for(limit)  # None: no bucket holds such a batch
    largest = graph_runner.buckets[-1]
    speculative_upto = 0 if limit == 1 else graph_runner.bucket_for(limit - 1) or largest

    def reachable(key: StepKey) -> bool:
        if runner is engine.runner and key.mode is ForwardMode.DECODE:
            return plain_from is not None and key.bucket >= plain_from
        return key.bucket <= speculative_upto

    return reachable


def compile_buckets(engine, buckets, progress: bool = False) -> None:
    """Compile every step kind the engine has run at each of `buckets`, in this thread,
    logging (and with `progress`, showing a bar of) what each took."""
    steps = [(r, b) for r in captured_runners(engine) for b in buckets]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(steps), desc="compiling captured steps", unit="bucket")
    reachable = {id(r): reachable_steps(engine, r) for r in captured_runners(engine)}
    for runner, bucket in steps:
        start = time.perf_counter()
        runner.graph_runner.compile_buckets([bucket], reachable[id(runner)])
        if bar is not None:
            bar.set_postfix_str(f"bs {bucket}: {time.perf_counter() - start:.1f} s")
            bar.update()
    if bar is not None:
        bar.close()


def compile_at_startup(engine, progress: bool = False) -> None:
    """`--capture-compile startup`: every step kind at every bucket, before serving."""
    runners = captured_runners(engine)
    if not runners:
        return
    start = time.perf_counter()
    warm_up(engine)
    compile_buckets(engine, captured_buckets(engine), progress=progress)  # in this thread
    for runner in runners:
        runner.graph_runner.compiles_on_demand = False
    calibrate_speculation(engine, target_buckets(engine))
    steps = [s for r in runners for s in r.graph_runner.compiled_steps()]
    ready = [name for name, state, _ in steps if state == "ready"]
    failed = [name for name, state, _ in steps if state == "failed"]
    logger.info(
        "compiled or loaded %d captured steps at start-up in %.1f s%s",
        len(ready),
        time.perf_counter() - start,
        f"; not captured (run eagerly): {', '.join(failed)}" if failed else "",
    )
