# SPDX-License-Identifier: Apache-2.0
"""The request limits of issue 56 at their edges: logprob entries counted over a call's
choices and prompts (a request at the limit passes, one entry more is refused naming the
field), alternatives per token, stop strings and stop ids."""

from __future__ import annotations

import pytest

from runtime.core.errors import InvalidRequestError
from runtime.core.request import Req
from runtime.core.sampling_params import SamplingParams
from runtime.engine.request_limits import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    RequestLimits,
    logprob_entries,
)

LIMITS = RequestLimits(vocab_size=1000, context_length=4096, max_n=8, max_logprob_entries=10_000)


def req(prompt_len=100, new=50, top=0, start=-1, ids=None, logprob=True) -> Req:
    return Req(
        "r",
        list(range(prompt_len)),
        SamplingParams(max_new_tokens=new),
        return_logprob=logprob,
        top_logprobs_num=top,
        logprob_start_len=start,
        token_ids_logprob=ids,
    )


def test_entries_count_scored_positions_times_width():
    assert logprob_entries(req(logprob=False, top=5, start=0)) == 0
    assert logprob_entries(req(new=50)) == 50  # output tokens only, one entry each
    assert logprob_entries(req(new=50, top=4)) == 50 * 5
    assert logprob_entries(req(prompt_len=100, new=50, top=4, start=0)) == 150 * 5
    assert logprob_entries(req(prompt_len=100, new=50, top=4, start=30)) == 120 * 5
    assert logprob_entries(req(new=10, top=2, ids=[1, 2, 3])) == 10 * 6


def test_a_call_at_the_limit_passes_and_one_entry_more_is_refused():
    at_limit = [req(prompt_len=100, new=100, top=9, start=0)] * 5  # 5 x 200 x 10
    LIMITS.check_logprob_entries(at_limit)
    over = at_limit + [req(new=1, logprob=True)]
    with pytest.raises(InvalidRequestError) as err:
        LIMITS.check_logprob_entries(over)
    assert err.value.param == "top_logprobs_num" and "10001" in str(err.value)
    assert "--max-logprob-entries" in str(err.value)
    scoring_only = [req(prompt_len=4000, new=10, start=0)] * 3
    with pytest.raises(InvalidRequestError) as err:
        LIMITS.check_logprob_entries(scoring_only)
    assert err.value.param == "logprob_start_len"
    with pytest.raises(InvalidRequestError) as err:
        LIMITS.check_logprob_entries([req(new=4000)] * 3)
    assert err.value.param == "max_new_tokens"


def test_alternatives_per_token():
    LIMITS.check_top_logprobs(20)
    for bad in (21, -1, 4096, True, 2.0, "3"):
        with pytest.raises(InvalidRequestError) as err:
            LIMITS.check_top_logprobs(bad)
        assert err.value.param == "top_logprobs_num" and "--max-top-logprobs" in str(err.value)


def test_stop_strings_and_ids():
    LIMITS.check_stops(SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS))
    LIMITS.check_stops(SamplingParams(stop_token_ids=[5] * MAX_STOP_TOKEN_IDS))
    bad = [
        (SamplingParams(stop=["s"] * (MAX_STOP_STRINGS + 1)), "stop"),
        (SamplingParams(stop="x" * (MAX_STOP_STRING_CHARS + 1)), "stop"),
        (SamplingParams(stop=["ok", "\ud800"]), "stop"),
        (SamplingParams(stop_token_ids=[5] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
        (SamplingParams(stop_token_ids=[1000]), "stop_token_ids"),
    ]
    for params, param in bad:
        with pytest.raises(InvalidRequestError) as err:
            LIMITS.check_stops(params)
        assert err.value.param == param
