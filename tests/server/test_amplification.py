# SPDX-License-Identifier: Apache-2.0
"""No request may cost the server more than its share (issue 56): the amplification
shapes (thousands of alternatives per token, every prompt token scored, hundreds of stop
strings) are refused with a 400 naming the field while a witness request's output stays
what it was alone; what the limits allow still works (and streams the same as it answers);
large bodies are encoded off the event loop, byte for byte Starlette's, and dropped when
the client has gone."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from fastapi.responses import JSONResponse

from runtime.server import rendering
from tests.server.test_server import sse_events

G, C, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
LONG_PROMPT = "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 14  # ~840 chars

# (route, body, the field its 400 names)
ATTACKS = [
    (
        G,
        {
            "text": LONG_PROMPT,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 4096,
        },
        "top_logprobs_num",
    ),
    (C, {"prompt": LONG_PROMPT, "logprobs": 6, "echo": True, "max_tokens": 1}, "logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (G, {"text": "x", "sampling_params": {"stop": [f"stop{i}" for i in range(200_000)]}}, "stop"),
    (G, {"text": "x", "sampling_params": {"stop": "z" * 2_000_000}}, "stop"),
    (C, {"prompt": "x", "stop": ["q"] * 300}, "stop"),
    (G, {"text": "x", "sampling_params": {"stop_token_ids": [5] * 10_000}}, "stop_token_ids"),
]


def _witness(server) -> dict:
    body = {
        "text": LONG_PROMPT[:200],
        "sampling_params": GREEDY,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
    }
    response = server.post(G, json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    meta = {k: v for k, v in out["meta_info"].items() if "logprobs" in k or k == "finish_reason"}
    return {"text": out["text"], "output_ids": out["output_ids"], **meta}


def test_attacks_get_400_and_a_witness_is_unchanged(spec_server):
    alone = _witness(spec_server)
    answers: list = [None] * len(ATTACKS)

    def attack(k: int) -> None:
        path, body, _ = ATTACKS[k]
        answers[k] = spec_server.post(path, json=body)

    threads = [threading.Thread(target=attack, args=(k,)) for k in range(len(ATTACKS))]
    for thread in threads:
        thread.start()
    during = _witness(spec_server)
    for thread in threads:
        thread.join(300)
    for (path, _, field), answer in zip(ATTACKS, answers):
        assert answer.status_code == 400, (path, answer.text[:300])
        error = answer.json()["error"]
        assert error["param"] == field and field.split("_")[0] in error["message"], error
    assert during == alone
    assert spec_server.get("/health").status_code == 200
    spec_server.wait_idle()


def test_what_the_limits_allow_is_served_whole(spec_server):
    """Every prompt token scored with the most alternatives the server allows (20)."""
    body = {
        "text": LONG_PROMPT,
        "sampling_params": {**GREEDY, "max_new_tokens": 4},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 20,
        "return_text_in_logprobs": True,
    }
    out = spec_server.post(G, json=body)
    assert out.status_code == 200, out.text
    meta = out.json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert all(len(top) == 20 for top in meta["input_top_logprobs"][1:])
    assert all(len(top) == 20 for top in meta["output_top_logprobs"])
    chat = spec_server.post(
        CHAT, json={"messages": USER, "logprobs": True, "top_logprobs": 20, "max_tokens": 3}
    )
    assert chat.status_code == 200, chat.text
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 20 for c in content)


def test_a_streamed_logprob_request_ends_as_it_answers(spec_server):
    """Streams skip snapshots a slow reader missed: the last event still equals the
    non-streaming answer (each event holds everything before it)."""
    body = {
        "text": LONG_PROMPT[:300],
        "sampling_params": GREEDY,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 5,
    }
    whole = spec_server.post(G, json=body).json()
    with spec_server.post(G, json={**body, "stream": True}, stream=True) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    last = events[-2]
    for out in (whole, last):
        out["meta_info"].pop("e2e_latency")
        out["meta_info"].pop("id")
    assert last == whole


def test_64_stop_strings_stop_where_the_first_one_is(spec_server):
    free = spec_server.generate(LONG_PROMPT[:100], GREEDY)["text"]
    stop = free[8:11]
    stops = [f"\u2603{i}" for i in range(63)] + [stop]  # never generated, and the real one
    out = spec_server.generate(LONG_PROMPT[:100], {**GREEDY, "stop": stops})
    assert out["text"] == free[: free.find(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


# -- encoding off the event loop ----------------------------------------------------------


class _Client:
    """The two things `json_response` asks of a request."""

    def __init__(self, gone_after: int | None = None):
        self.checks, self.gone_after = 0, gone_after
        self.url = type("URL", (), {"path": G})()

    async def is_disconnected(self) -> bool:
        self.checks += 1
        return self.gone_after is not None and self.checks > self.gone_after


PAYLOAD = {
    "text": 'caf\u00e9 \u4e2d\u6587 \U0001f600 "quoted" \\ \n',
    "meta_info": {
        "output_top_logprobs": [[[-0.125 * k, k, f"tok{k}\u00e9"] for k in range(20)]] * 400,
        "e2e_latency": 0.1,
        "finish_reason": {"type": "stop", "matched": None},
        "values": (1, 2.5, True, None),
    },
}


def test_json_response_sends_starlettes_bytes(monkeypatch):
    monkeypatch.setattr(rendering, "PIECE_CHARS", 4096)  # many pieces
    client = _Client()
    response = asyncio.run(rendering.json_response(client, lambda: PAYLOAD))
    assert response.status_code == 200 and response.media_type == "application/json"
    assert response.body == JSONResponse(PAYLOAD).body
    assert client.checks > 10  # the client was looked for between pieces


def test_json_response_drops_the_body_when_the_client_left(monkeypatch):
    monkeypatch.setattr(rendering, "PIECE_CHARS", 4096)
    client = _Client(gone_after=2)
    pulled = []

    def build():
        return PAYLOAD

    real = rendering._next_piece

    def counting(pieces):
        pulled.append(1)
        return real(pieces)

    monkeypatch.setattr(rendering, "_next_piece", counting)
    response = asyncio.run(rendering.json_response(client, build))
    assert response.status_code == rendering.CLIENT_GONE and response.body == b""
    assert len(pulled) == 3  # nothing encoded after the check that found it gone
    whole = len(JSONResponse(PAYLOAD).body)
    assert whole > 10 * 4096


@pytest.mark.parametrize("payload", [{}, [], {"a": []}, "x"])
def test_json_response_small_bodies(payload):
    response = asyncio.run(rendering.json_response(_Client(), lambda: payload))
    assert response.body == JSONResponse(payload).body
    assert json.loads(response.body) == payload
