# SPDX-License-Identifier: Apache-2.0
"""Timing both decode modes at every captured bucket before the traffic, as the measured
speculation policy's prior (`--speculative-disable-by-batch-size auto` with
`--capture-compile startup`, and the benchmarks' warm-ups).

Without a prior, a fresh server learns each bucket's costs under load: its first large
batches run verify rounds where plain steps would be faster, and the draft runs over every
prompt admitted meanwhile, a pass that is skipped where the batch decodes plainly. Once
the captured steps are compiled, a few steps of each mode at each bucket cost seconds:
made-up requests as many as the bucket holds, each mode forced in turn (`StepTimer`).
Their medians (`MeasuredSpeculation.calibrate`) decide until the traffic has timed both
modes; the choice waits only for the traffic's acceptance, which made-up prompts cannot
tell. The requests and what they counted leave no trace: the prefix cache is flushed and
the speculation counters are put back.
"""

from __future__ import annotations

import copy
import logging
import time

from runtime.speculative.speculation_policy import MeasuredSpeculation, StepTimer

logger = logging.getLogger(__name__)

PROMPT_LEN = 8


def calibration_prompts(count: int, vocab_size: int, first_id: int) -> list[list[int]]:
    """`count` distinct prompts of `PROMPT_LEN` ids from `first_id` on (past the usual
    special tokens), so no request reuses another's cache."""
    span = max(vocab_size - first_id, 1)
    return [
        [first_id + (97 * i + 31 * j + j * j) % span for j in range(PROMPT_LEN)]
        for i in range(count)
    ]


def calibrate_speculation(engine, buckets, steps: int = 6) -> dict[int, dict[str, float]]:
    """Time `steps` (or more) decode steps of each mode at each of the target's `buckets`,
    with as many greedy requests as the bucket holds (at most `max_running_requests`), and
    hand the timings to the engine's measured speculation policy. Returns each calibrated
    bucket's median round and plain step in ms ({} where the policy is not measured)."""
    speculation = engine.worker.speculation
    policy = None if speculation is None else speculation.policy
    if not isinstance(policy, MeasuredSpeculation):
        return {}
    start = time.perf_counter()
    width = engine.spec_config.num_steps + 1
    stats, timers = speculation.stats, []
    speculation.stats = copy.deepcopy(stats)
    try:
        for bucket in sorted(buckets):
            count = min(bucket, engine.config.max_running_requests)
            prompts = calibration_prompts(count, engine.model_config.vocab_size, 3)
            for speculate in (True, False):
                # the first pure decode step only marks the start of the next one's time
                tokens = (steps + 2) * (width if speculate else 1)
                params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
                timer = StepTimer(policy.bucket_of, speculate)
                speculation.policy = timer
                reqs = [r for p in prompts for r in engine.requests.make_requests(p, params)]
                engine.run_to_completion(reqs)
                timers.append(timer)
    finally:
        speculation.policy, speculation.stats = policy, stats
    measured: dict[int, dict[str, list[float]]] = {}
    for timer in timers:
        for bucket, seconds in timer.seconds.items():
            mode = "round" if timer.speculate else "plain"
            measured.setdefault(bucket, {}).setdefault(mode, []).extend(seconds)
    out = {}
    for bucket, modes in sorted(measured.items()):
        if len(modes) < 2:
            continue  # a bucket only a shrinking batch passed through in one mode
        policy.calibrate(bucket, modes["round"], modes["plain"])
        timed = policy.describe()[str(bucket)]
        out[bucket] = {
            "round_ms": timed["calibrated_round_ms"],
            "plain_ms": timed["calibrated_plain_ms"],
        }
    engine.flush_cache()
    timings = (f"{b}: round {t['round_ms']} ms, plain {t['plain_ms']} ms" for b, t in out.items())
    logger.info(
        "timed speculation per bucket in %.1f s: %s",
        time.perf_counter() - start,
        "; ".join(timings),
    )
    return out
