# SPDX-License-Identifier: Apache-2.0
"""What captured steps cost: operators per step, and compile time per bucket cold and warm.

    python -m scripts.capture_stats --batch-size 1 16                  # operators per step
    python -m scripts.capture_stats --batch-size 1 16 --compile-times   # + compile seconds
    python -m scripts.capture_stats --batch-size 1 --by-block           # + where they come from

Operators are counted by `torch._dynamo.explain` on the step exactly as the graph runner
runs it (the batch padded into its bucket): the target's decode and verify steps and the
MTP draft's extend over verified rows and chained step. `--by-block` adds, per step, its
operators grouped by the project function that called them (the innermost `runtime/` frame
of each node's stack). `--compile-times` builds an engine with capture per batch size in a
fresh process, first on an empty compile cache (a first start) and then on the cache that
run left (a second start), and prints the seconds each captured step took to compile.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

from runtime.configs.engine_config import EngineConfig
from scripts.bench import flags

STEPS = 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = flags.new_parser("scripts.capture_stats", __doc__)
    p.add_argument("--model-path", default=None, help="checkpoint (default: the embedded model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 16])
    p.add_argument("--speculative-num-steps", type=int, default=STEPS)
    p.add_argument("--compile-times", action="store_true", help="also measure compile seconds")
    p.add_argument("--nextn", action="store_true", help="compile times of the NEXTN steps too")
    p.add_argument(
        "--by-block", action="store_true", help="operators per calling function of each step"
    )
    p.add_argument("--compile-one", type=int, help=argparse.SUPPRESS)  # child process mode
    return p.parse_args(argv)


def engine(args, batch_size: int, **overrides):
    from runtime import Engine

    config = EngineConfig(
        model_path=args.model_path,
        dtype=args.dtype,
        max_running_requests=max(batch_size, 2),
        cuda_graph_bs=[batch_size],
        capture_compile="inline",
    )
    return Engine(config, **overrides)


def recorded_inputs(e) -> dict:
    """The inputs of every runner forward of `e`, by (model, mode, rows per request)."""
    seen = {}
    runners = [("target", e.runner)]
    if getattr(e.worker, "drafter", None) is not None:
        runners.append(("draft", e.worker.drafter.runner))
    for model, runner in runners:
        forward = runner.forward

        def record(inp, forward=forward, model=model, runner=runner):
            rows = inp.extend_lens[0] if inp.extend_lens else 0
            key = (model, inp.forward_mode.name.lower(), rows, inp.spec_step_idx > 0)
            seen.setdefault(key, (runner, inp))
            return forward(inp)

        runner.forward = record
    return seen


def operator_counts(args) -> None:
    """Operators per captured step: one prefill, a decode step (plain) and a NEXTN round."""
    for bs in args.batch_size:
        prompts = [[5 + i] * 40 for i in range(bs)]
        nextn = {
            "speculative_algorithm": "NEXTN",
            "speculative_num_steps": args.speculative_num_steps,
        }
        for spec in ({}, nextn):
            # one step prefills every prompt (no chunking), so the next is a full batch
            e = engine(args, bs, disable_cuda_graph=True, chunked_prefill_size=-1, **spec)
            seen = recorded_inputs(e)
            for ids in prompts:
                e.add_request(e.make_request(ids, {"max_new_tokens": 8, "ignore_eos": True}))
            e.step()  # prefill
            e.step()  # a decode step or a NEXTN round
            for (model, mode, rows, chained), (runner, inp) in sorted(seen.items()):
                what = f"{model} {mode}{' (chained)' if chained else ''} {rows} row(s)/request"
                counted = count(runner, inp)
                if counted is not None:
                    ops, graph = counted
                    print(f"bs {bs}: {what}: {ops} operators, one graph")
                    if args.by_block:
                        for block, n in by_block(graph).most_common():
                            print(f"    {n:5d}  {block}")


def count(runner, inp) -> tuple[int, torch.fx.GraphModule] | None:
    from runtime.configs.capture import CaptureConfig
    from runtime.execution.graph_runner import GraphRunner

    graph_runner = GraphRunner(runner, CaptureConfig(batch_sizes=(len(inp.extend_lens),)), 64)
    key = graph_runner.step_key(inp)
    if key is None:  # a prefill (eager)
        return None
    graph_runner.configure_regions()  # as its compile would trace it
    with torch.inference_mode():
        ctx, ids, hidden = graph_runner.padded_batch(inp, key)

        def step(ctx, ids, hidden):
            out = runner.call_model(ctx, ids, hidden, key.spec_step_idx)
            return out.next_token_logits, out.hidden_states

        explanation = torch._dynamo.explain(step)(ctx, ids, hidden)
    breaks = (explanation.graph_count, explanation.graph_break_count)
    assert breaks == (1, 0), explanation.break_reasons
    return explanation.op_count, explanation.graphs[0]


def by_block(graph: torch.fx.GraphModule) -> collections.Counter:
    """The graph's operators (`call_function` nodes, as `op_count` counts them) by the
    innermost project function in each node's stack (`file:function` under runtime/)."""
    blocks = collections.Counter()
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        frames = re.findall(
            r'File "[^"]*/runtime/([^"]+)", line \d+, in (\w+)', node.meta.get("stack_trace") or ""
        )
        blocks[":".join(frames[-1]) if frames else "(outside runtime/)"] += 1
    return blocks


def compile_one(args) -> None:
    """Child process: compile the captured steps one batch of `--compile-one` requests
    needs, print them as JSON."""
    bs = args.compile_one
    e = engine(
        args,
        bs,
        speculative_num_steps=args.speculative_num_steps if args.nextn else None,
        speculative_algorithm="NEXTN" if args.nextn else None,
    )
    prompts = [[5 + i] * 40 for i in range(bs)]
    e.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "ignore_eos": True})
    runners = [e.runner] + ([e.worker.drafter.runner] if args.nextn else [])
    steps = [s for r in runners for s in r.graph_runner.compiled_steps()]
    print(json.dumps(steps))


def compile_times(args) -> None:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NEXTN_CACHE_DIR": cache}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        env.pop("NEXTN_DISABLE_CUDA_GRAPH", None)
        for bs in args.batch_size:
            for start in ("first start (empty cache)", "second start (warm cache)"):
                cmd = [sys.executable, "-m", "scripts.capture_stats", "--compile-one", str(bs)]
                cmd += [
                    "--dtype",
                    args.dtype,
                    "--speculative-num-steps",
                    str(args.speculative_num_steps),
                ]
                cmd += ["--model-path", args.model_path] if args.model_path else []
                cmd += ["--nextn"] if args.nextn else []
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                for step, state, seconds in json.loads(out.stdout.strip().splitlines()[-1]):
                    print(f"{start}: {step}: {state} in {seconds:.1f} s")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.compile_one:
        compile_one(args)
        return
    operator_counts(args)
    if args.compile_times:
        compile_times(args)


if __name__ == "__main__":
    main()
