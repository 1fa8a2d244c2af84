# SPDX-License-Identifier: Apache-2.0
"""A request's snapshots reuse what the previous one froze of its logprob lists (issue 56:
a request scoring a long prompt copied every entry on every step): each snapshot still
equals a fresh copy of the lists, through appends, in-place extends, and a restarted
prefill that swaps in new lists."""

from __future__ import annotations

import random

from runtime.core.request import Req
from runtime.core.sampling_params import SamplingParams
from runtime.engine.results import request_result


def fresh_copy(req: Req) -> dict:
    """The lists as plain tuples, converted from scratch (what a snapshot must hold)."""

    def rows(values):
        return tuple(None if row is None else tuple(row) for row in values)

    return {
        "input_token_logprobs": tuple(req.input_token_logprobs),
        "output_token_logprobs": tuple(req.output_token_logprobs),
        "input_top_logprobs": rows(req.input_top_logprobs),
        "output_top_logprobs": rows(req.output_top_logprobs),
        "input_token_ids_logprobs": rows(req.input_token_ids_logprobs),
        "output_token_ids_logprobs": rows(req.output_token_ids_logprobs),
    }


def snapshot_lists(req: Req) -> dict:
    logprobs = request_result(req, None, with_text=False).logprobs
    return {name: getattr(logprobs, name) for name in fresh_copy(req)}


def top(rng: random.Random, k: int = 3) -> list:
    return [(-rng.random(), rng.randrange(100)) for _ in range(k)]


def test_snapshots_equal_a_fresh_copy_through_appends_and_restarts():
    rng = random.Random(0)
    req = Req(
        "r",
        list(range(40)),
        SamplingParams(max_new_tokens=50),
        return_logprob=True,
        top_logprobs_num=3,
        logprob_start_len=0,
        token_ids_logprob=[1, 2],
    )
    earlier = []
    for step in range(60):
        event = rng.random()
        if event < 0.15:  # a prefill chunk's prompt entries (the scheduler's `+=`)
            size = rng.randint(1, 8)
            req.input_token_logprobs += [(None if not req.input_token_logprobs else -1.0, 3)]
            req.input_token_logprobs += [(-rng.random(), 5) for _ in range(size - 1)]
            req.input_top_logprobs += [None] + [top(rng) for _ in range(size - 1)]
            req.input_token_ids_logprobs += [top(rng, 2) for _ in range(size)]
        elif event < 0.2:  # a restarted prefill: new lists
            req.input_token_logprobs, req.input_top_logprobs = [], []
            req.input_token_ids_logprobs = []
        elif event < 0.9:  # a decoded token
            req.output_token_logprobs.append((-rng.random(), rng.randrange(100)))
            req.output_top_logprobs.append(top(rng))
            req.output_token_ids_logprobs.append(top(rng, 2))
        snapshot = snapshot_lists(req)
        assert snapshot == fresh_copy(req), step
        earlier.append((snapshot, fresh_copy(req)))
    for old, expected in earlier:  # a snapshot never changes after it was taken
        assert old == expected
