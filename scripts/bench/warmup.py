# SPDX-License-Identifier: Apache-2.0
"""Keeping compiles out of the timings: captured steps compile the first time a batch bucket
needs them, so a benchmark runs a short warm-up (which meets every kind of step) and then
compiles those kinds at every bucket its measured run can meet."""

from __future__ import annotations


def captured_runners(engine) -> list:
    """The engine's model runners that replay captured steps (target, then the MTP draft)."""
    runners = [engine.runner]
    drafter = getattr(engine.worker, "drafter", None)
    if drafter is not None:
        runners.append(drafter.runner)
    return [r for r in runners if getattr(r, "graph_runner", None) is not None]


def captured_buckets(engine, max_batch: int) -> list[int]:
    """The captured batch buckets a run of at most `max_batch` concurrent requests can use."""
    buckets: set[int] = set()
    for runner in captured_runners(engine):
        graph_runner = runner.graph_runner
        if not graph_runner.capturable:
            continue
        largest = graph_runner.bucket_for(max_batch)
        buckets.update(b for b in graph_runner.buckets if largest is None or b <= largest)
    return sorted(buckets)


def compile_captured_buckets(engine, max_batch: int) -> None:
    """Compile every step kind the engine has run at each bucket a run of at most `max_batch`
    concurrent requests can use (a NEXTN batch shrinks through smaller buckets as its
    requests finish; chunked prompts may never decode all at once in a warm-up), then print
    what each captured step took to compile."""
    buckets = captured_buckets(engine, max_batch)
    for runner in captured_runners(engine):
        runner.graph_runner.compile_buckets(buckets)
    report_compiles(engine)


def report_compiles(engine) -> None:
    """Wait for compiles in flight, then print what each captured step took."""
    for runner in captured_runners(engine):
        runner.graph_runner.wait_until_idle()
        for step, state, seconds in runner.graph_runner.compiled_steps():
            print(f"captured step {step}: {state}, compiled in {seconds:.1f} s")
