# SPDX-License-Identifier: Apache-2.0
"""Compiling captured steps ahead of the traffic (`--capture-compile startup`, benchmarks).

Captured steps compile the first time a batch bucket needs them. A server that must not
meet a compile under load (a benchmark at request rate inf, a production start behind a
load balancer) compiles them all before it serves, as SGLang captures every CUDA-graph
batch size at start-up: one short warm-up request meets every kind of step the engine runs
(decode, or target verify and the draft's steps), then each kind compiles at every bucket.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


def captured_runners(engine) -> list:
    """The engine's model runners that replay captured steps (target, then the MTP draft)."""
    runners = [engine.runner]
    drafter = getattr(engine.worker, "drafter", None)
    if drafter is not None:
        runners.append(drafter.runner)
    return [
        r
        for r in runners
        if getattr(r, "graph_runner", None) is not None and r.graph_runner.capturable
    ]


def captured_buckets(engine, max_batch: int | None = None) -> list[int]:
    """The captured batch buckets a run of at most `max_batch` concurrent requests can use
    (every bucket when None)."""
    buckets: set[int] = set()
    for runner in captured_runners(engine):
        graph_runner = runner.graph_runner
        largest = None if max_batch is None else graph_runner.bucket_for(max_batch)
        buckets.update(b for b in graph_runner.buckets if largest is None or b <= largest)
    return sorted(buckets)


def warm_up(engine, num_tokens: int = 8) -> None:
    """One short greedy request through the engine, so each kind of step it runs is seen;
    the prefix cache forgets it afterwards."""
    bos = engine.bos_token_id
    width = engine.spec_config.num_draft_tokens if engine.spec_config else 1
    prompt = [bos if bos is not None else 0] + list(range(3, 3 + 2 * width))
    max_new = max(num_tokens, 3 * width)
    engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": max_new, "temperature": 0})
    engine.flush_cache()


def compile_buckets(engine, buckets, progress: bool = False) -> None:
    """Compile every step kind the engine has run at each of `buckets`, in this thread,
    logging (and with `progress`, showing a bar of) what each took."""
    steps = [(r, b) for r in captured_runners(engine) for b in buckets]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(steps), desc="compiling captured steps", unit="bucket")
    for runner, bucket in steps:
        start = time.perf_counter()
        runner.graph_runner.compile_buckets([bucket])
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
    steps = [s for r in runners for s in r.graph_runner.compiled_steps()]
    failed = [name for name, state, _ in steps if state != "ready"]
    logger.info(
        "compiled %d captured steps at start-up in %.1f s%s",
        len(steps) - len(failed),
        time.perf_counter() - start,
        f"; not captured (run eagerly): {', '.join(failed)}" if failed else "",
    )
