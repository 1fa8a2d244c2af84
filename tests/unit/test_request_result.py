# SPDX-License-Identifier: Apache-2.0
"""The typed `RequestResult` and its renderings: SGLang's `/generate` JSON (the layout of
SGLang's `meta_info`, written out here by hand) and OpenAI's completion/chat objects."""

from __future__ import annotations

import json

import pytest

from runtime.core.request import FinishReason, Req
from runtime.core.sampling_params import SamplingParams
from runtime.engine.results import request_result
from runtime.engine.sglang_output import render_generate
from runtime.server import openai_render as render


class CharDetokenizer:
    """Token t is the character chr(t)."""

    def __init__(self):
        self.text = ""

    def add(self, token: int) -> str:
        self.text += chr(token)
        return chr(token)

    def flush(self) -> str:
        return self.text


def finished_req(**params) -> Req:
    req = Req(
        "r1",
        [5, 6, 7],
        SamplingParams(max_new_tokens=3, **params),
        return_logprob=True,
        top_logprobs_num=2,
        logprob_start_len=1,
    )
    for token in (10, 11, 12):
        req.append_token(token, eos_ids=set())
    req.input_token_logprobs = [(None, 6), (-1.5, 7)]
    req.input_top_logprobs = [None, [(-1.5, 7), (-2.0, 4)]]
    req.output_token_logprobs = [(-0.1, 10), (-0.2, 11), (-0.3, 12)]
    req.output_top_logprobs = [[(-0.1, 10), (-2.0, 3)], [(-0.2, 11), (-2.5, 4)], [(-0.3, 12)]]
    req.spec_verify_ct, req.spec_accept_hist = 2, [0, 1, 1, 0]
    return req


def test_sglang_generate_shape_with_logprobs_and_spec_counters():
    out = render_generate(request_result(finished_req(), num_draft_tokens=4, with_text=False))
    json.dumps(out)
    meta = out["meta_info"]
    assert meta.pop("e2e_latency") >= 0
    assert out == {
        "text": None,
        "output_ids": [10, 11, 12],
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "length", "length": 3},
            "prompt_tokens": 3,
            "completion_tokens": 3,
            "cached_tokens": 0,
            "spec_verify_ct": 2,
            "spec_accept_length": 2.5,  # (1 + 1) + (2 + 1) tokens over 2 rounds
            "spec_accept_histogram": [0, 1, 1, 0],
            "spec_plain_decode_tokens": 0,
            "input_token_logprobs": [[None, 6, None], [-1.5, 7, None]],
            "output_token_logprobs": [[-0.1, 10, None], [-0.2, 11, None], [-0.3, 12, None]],
            "input_top_logprobs": [None, [[-1.5, 7, None], [-2.0, 4, None]]],
            "output_top_logprobs": [
                [[-0.1, 10, None], [-2.0, 3, None]],
                [[-0.2, 11, None], [-2.5, 4, None]],
                [[-0.3, 12, None]],
            ],
        },
    }


def test_logprob_text_slots_and_token_ids_lists():
    """`return_text_in_logprobs` fills the third slot of every triple (top lists too) with
    the token's own text; `token_ids_logprob` adds SGLang's per-position id lists."""
    req = finished_req()
    req.return_text_in_logprobs = True
    req.token_ids_logprob = [3, 10]
    req.input_token_ids_logprobs = [None, [(-4.0, 3), (-5.0, 10)]]
    req.output_token_ids_logprobs = [[(-2.0, 3), (-0.1, 10)]] * 3
    meta = render_generate(
        request_result(req, None, with_text=False), lambda ids: [f"<{t}>" for t in ids]
    )["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 6, "<6>"], [-1.5, 7, "<7>"]]
    assert meta["output_top_logprobs"][2] == [[-0.3, 12, "<12>"]]
    assert meta["input_token_ids_logprobs"] == [None, [[-4.0, 3, "<3>"], [-5.0, 10, "<10>"]]]
    assert meta["output_token_ids_logprobs"][0] == [[-2.0, 3, "<3>"], [-0.1, 10, "<10>"]]
    req.return_text_in_logprobs = False  # not asked: the slot stays empty
    plain = render_generate(request_result(req, None, with_text=False), lambda ids: ["x"] * 9)
    assert plain["meta_info"]["input_token_logprobs"][1] == [-1.5, 7, None]


def test_plain_request_without_logprobs_has_only_the_base_keys():
    req = Req("r2", [1, 2], SamplingParams(max_new_tokens=1))
    req.append_token(9, eos_ids=set())
    result = request_result(req, num_draft_tokens=None, with_text=False)
    assert result.logprobs is None and result.spec is None and result.finished
    assert set(render_generate(result)["meta_info"]) == {
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "e2e_latency",
    }


def test_spec_histogram_before_any_round_is_zeros_of_the_verify_width():
    req = Req("r3", [1], SamplingParams())
    spec = request_result(req, num_draft_tokens=4, with_text=False).spec
    assert (spec.verify_rounds, spec.accept_length, spec.accept_histogram) == (0, None, (0,) * 4)
    meta = render_generate(request_result(req, num_draft_tokens=4, with_text=False))["meta_info"]
    assert "spec_accept_length" not in meta and meta["spec_verify_ct"] == 0


def test_running_snapshot_holds_back_a_possible_stop_string():
    req = Req("r4", [1], SamplingParams(stop="xyz"), detokenizer=CharDetokenizer())
    for ch in "abx":
        req.append_token(ord(ch), eos_ids=set())
    snapshot = request_result(req, None, with_text=True)
    assert (snapshot.text, snapshot.finished, snapshot.completion_tokens) == ("ab", False, 3)
    assert render_generate(snapshot)["meta_info"]["finish_reason"] is None
    for ch in "yz":
        req.append_token(ord(ch), eos_ids=set())
    final = request_result(req, None, with_text=True)
    assert final.text == "ab" and final.finish_reason == FinishReason("stop", matched="xyz")
    assert snapshot.output_ids == tuple(map(ord, "abx"))  # a snapshot does not change later


def test_abort_renders_its_message():
    req = Req("r5", [1], SamplingParams())
    req.abort("gone")
    result = request_result(req, None, with_text=False)
    assert result.aborted
    assert render_generate(result)["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "gone",
    }
    assert render.finish_reason(result) == ("abort", None)


@pytest.mark.parametrize(
    "reason,expected",
    [
        (FinishReason("stop", matched=7), ("stop", 7)),
        (FinishReason("stop", matched="END"), ("stop", "END")),
        (FinishReason("length", length=3), ("length", None)),
        (None, (None, None)),
    ],
)
def test_openai_finish_reason_and_matched_stop(reason, expected):
    req = Req("r6", [1], SamplingParams())
    req.finish_reason = reason
    assert render.finish_reason(request_result(req, None, with_text=False)) == expected


def test_openai_logprobs_from_the_typed_result():
    result = request_result(finished_req(), None, with_text=False)
    lp = render.completion_logprobs(result, tokenizer=None, start=1)
    assert lp == {
        "tokens": ["11", "12"],
        "token_logprobs": [-0.2, -0.3],
        "top_logprobs": [{"11": -0.2, "4": -2.5}, {"12": -0.3}],
        "text_offset": [0, 2],
    }
    chat = render.chat_logprobs(result, tokenizer=None)
    first = chat["content"][0]
    assert first == {
        "token": "10",
        "logprob": -0.1,
        "bytes": [49, 48],
        "top_logprobs": [
            {"token": "10", "logprob": -0.1, "bytes": [49, 48]},
            {"token": "3", "logprob": -2.0, "bytes": [51]},
        ],
    }


def test_openai_usage_counts_each_prompt_once_per_n_choices():
    a, b = Req("a", [1, 2, 3], SamplingParams()), Req("b", [1, 2, 3], SamplingParams())
    a.append_token(4, set())
    b.append_token(4, set())
    b.append_token(5, set())
    results = [request_result(r, None, with_text=False) for r in (a, b)]
    assert render.usage(results, n=2) == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    body = render.completion_response(results, 2, "m", None, ["P:"], logprobs=False)
    assert [c["text"] for c in body["choices"]] == ["P:", "P:"]  # no tokenizer: no text
    assert [c["index"] for c in body["choices"]] == [0, 1]
