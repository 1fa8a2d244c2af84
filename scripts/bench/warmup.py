# SPDX-License-Identifier: Apache-2.0
"""Keeping compiles out of the timings: captured steps compile the first time a batch bucket
needs them, so a benchmark runs a short warm-up (which meets every kind of step) and then
compiles those kinds at every bucket its measured run can meet."""

from __future__ import annotations

from runtime.engine.capture_warmup import (
    captured_buckets,
    captured_runners,
    compile_buckets,
    target_buckets,
    warm_up,
)
from runtime.engine.speculation_calibration import calibrate_speculation

__all__ = [
    "captured_buckets",
    "captured_runners",
    "compile_captured_buckets",
    "compiled_since",
    "report_compiles",
    "step_states",
]


def compile_captured_buckets(engine, max_batch: int) -> None:
    """Compile every step kind the engine has run at each bucket a run of at most `max_batch`
    concurrent requests can use (a NEXTN batch shrinks through smaller buckets as its
    requests finish; chunked prompts may never decode all at once in a warm-up), then print
    what each captured step took to compile, and with a measured speculation policy what
    each bucket's round and plain step took (its calibration). The engine's own warm-up
    request runs first, so every kind is seen even where the benchmark's warm-up misses one
    (plain decode steps of a NEXTN engine that stops speculating in large batches). The
    benchmarks decode greedily: the steps of sampled NEXTN rounds are left out."""
    warm_up(engine, sampled=False)
    compile_buckets(engine, captured_buckets(engine, max_batch))
    report_compiles(engine)
    for bucket, times in calibrate_speculation(engine, target_buckets(engine, max_batch)).items():
        print(
            f"speculation at bucket {bucket}: round {times['round_ms']} ms, "
            f"plain step {times['plain_ms']} ms"
        )


def report_compiles(engine) -> None:
    """Wait for compiles in flight, then print what each captured step took."""
    for runner in captured_runners(engine):
        runner.graph_runner.wait_until_idle()
        for step, state, seconds in runner.graph_runner.compiled_steps():
            if state == "pending":  # seen in the warm-up, but no batch of the run meets it
                continue
            print(f"captured step {step}: {state}, compiled in {seconds:.1f} s")


def step_states(engine) -> dict[tuple[int, str], str]:
    """Every captured step seen so far, by (runner, step), and its state (pending,
    compiling, ready, failed)."""
    return {
        (i, step): state
        for i, runner in enumerate(captured_runners(engine))
        for step, state, _ in runner.graph_runner.compiled_steps()
    }


def compiled_since(engine, before: dict[tuple[int, str], str]) -> list[str]:
    """The captured steps that became ready, failed or started compiling since `before`
    (`step_states`): a timed run that lists any met a compile, or a step the warm-up missed."""
    return sorted(
        f"{key[1]} ({state})"
        for key, state in step_states(engine).items()
        if state != "pending" and before.get(key) != state
    )
