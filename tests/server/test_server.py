# SPDX-License-Identifier: Apache-2.0
"""The HTTP server end to end, through the official `openai` client and SGLang's JSON."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from tests.server.conftest import serve

PROMPT = "def fib(n): return n"


def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=server.api_key or "none", max_retries=0
    )


def greedy_text(server, prompt=PROMPT, max_tokens=24) -> str:
    out = client(server).completions.create(
        model="tiny-v4",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith(b"data: "):
            payload = line[6:].decode()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# -- OpenAI client -------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["spec_server", "plain_server"])
def test_openai_completion_and_chat(request, which):
    server = request.getfixturevalue(which)
    c = client(server)
    out = c.completions.create(
        model="tiny-v4",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length" and len(out.choices[0].text) > 0
    assert out.usage.completion_tokens == 10 and out.usage.prompt_tokens == len(PROMPT)
    chat = c.chat.completions.create(
        model="tiny-v4",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len("<|user|>hi\n<|assistant|>")
    models = c.models.list()
    assert [m.id for m in models.data] == ["tiny-v4"]


def test_streaming_chat_equals_non_streaming(spec_server):
    c = client(spec_server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count"}]
    whole = c.chat.completions.create(
        model="tiny-v4",
        messages=messages,
        max_tokens=30,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    stream = c.chat.completions.create(
        model="tiny-v4",
        messages=messages,
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == whole.choices[0].message.content
    assert reasons[-1] == "length" and usage.completion_tokens == 30


def test_n_choices_and_seed_reproducibility(spec_server):
    c = client(spec_server)
    kw = dict(
        model="tiny-v4",
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    first = c.completions.create(seed=1234, n=3, **kw)
    again = c.completions.create(seed=1234, n=3, **kw)
    other = c.completions.create(seed=99, n=3, **kw)
    texts = [ch.text for ch in first.choices]
    assert len(texts) == 3 and [ch.index for ch in first.choices] == [0, 1, 2]
    assert texts == [ch.text for ch in again.choices]
    assert texts != [ch.text for ch in other.choices]
    assert len(set(texts)) > 1  # choices of one seeded request still differ
    chat = c.chat.completions.create(
        model="tiny-v4",
        messages=[{"role": "user", "content": "x"}],
        n=2,
        max_tokens=5,
        temperature=1.0,
    )
    assert len(chat.choices) == 2


@pytest.mark.parametrize("which", ["spec_server", "plain_server"])
def test_stop_strings_never_leak(request, which):
    """Stops picked from the greedy text: 2- and 3-character ones span tokens (and, with
    NEXTN, can fall inside one accepted run). Streaming must not leak a stop's prefix."""
    server = request.getfixturevalue(which)
    free = greedy_text(server, max_tokens=40)
    c = client(server)
    for length, at in ((2, 7), (3, 15), (1, 4)):
        stop = free[at : at + length]
        expected = free[: free.index(stop)]
        out = c.completions.create(
            model="tiny-v4",
            prompt=PROMPT,
            max_tokens=40,
            temperature=0,
            stop=[stop],
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
        pieces = [
            ch.choices[0].text
            for ch in c.completions.create(
                model="tiny-v4",
                prompt=PROMPT,
                max_tokens=40,
                temperature=0,
                stop=[stop],
                stream=True,
                extra_body={"ignore_eos": True},
            )
            if ch.choices
        ]
        assert "".join(pieces) == expected
        assert all(stop not in "".join(pieces[: k + 1]) for k in range(len(pieces)))


def test_logprobs(spec_server):
    c = client(spec_server)
    out = c.completions.create(
        model="tiny-v4",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 6 and len(lp.token_logprobs) == 6 and len(lp.top_logprobs) == 6
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) == 3
        assert value == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the top token
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 3,
        "top_logprobs_num": 2,
    }
    meta = spec_server.post("/generate", json=body).json()["meta_info"]
    assert meta["prompt_tokens"] == 3 + len(meta["input_token_logprobs"])
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 4
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


# -- SGLang native -------------------------------------------------------------------------


def test_generate_single_batch_and_stream(spec_server):
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    single = spec_server.post("/generate", json={"text": PROMPT, "sampling_params": params}).json()
    meta = single["meta_info"]
    for key in (
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "e2e_latency",
        "spec_verify_ct",
        "spec_accept_length",
    ):
        assert key in meta
    assert meta["completion_tokens"] == 16 and meta["finish_reason"] == {
        "type": "length",
        "length": 16,
    }
    batch = spec_server.post(
        "/generate", json={"text": [PROMPT, "ab"], "sampling_params": params}
    ).json()
    assert isinstance(batch, list) and batch[0]["text"] == single["text"]
    ids = spec_server.post(
        "/generate", json={"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": params}
    ).json()
    assert [len(r["output_ids"]) for r in ids] == [16, 16]
    with spec_server.post(
        "/generate", json={"text": PROMPT, "sampling_params": params, "stream": True}, stream=True
    ) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[-1]["text"] == single["text"]
    tokens = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert tokens == sorted(tokens) and tokens[-1] == 16
    assert all(chunks[i]["text"].startswith(chunks[i - 1]["text"]) for i in range(1, len(chunks)))


def test_admin_routes(spec_server, plain_server):
    assert spec_server.get("/health").status_code == 200
    assert spec_server.get("/health_generate").status_code == 200
    info = spec_server.info()
    assert info["speculative_algorithm"] == "NEXTN" and info["speculative_num_draft_tokens"] == 4
    assert info["internal_states"][0]["avg_spec_accept_length"] >= 1.0
    assert plain_server.info()["internal_states"][0]["avg_spec_accept_length"] is None
    model = spec_server.get("/get_model_info").json()
    assert model["is_generation"] and model["architectures"] == ["DeepseekV4ForCausalLM"]
    assert spec_server.post("/flush_cache").status_code == 200
    assert spec_server.get("/flush_cache").status_code == 200
    metrics = spec_server.get("/metrics").text
    for name in (
        "sglang:num_requests_total",
        "sglang:generation_tokens_total",
        "sglang:time_to_first_token",
        "sglang:inter_token_latency_seconds",
        "sglang:e2e_request_latency_seconds",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:spec_accept_length",
    ):
        assert name in metrics


@pytest.mark.parametrize("which", ["spec_server", "plain_server"])
def test_prefix_cache_over_http(request, which):
    """A second turn that resends the first is served from the prefix cache: SGLang's
    `meta_info.cached_tokens`, OpenAI's `usage.prompt_tokens_details.cached_tokens`, the hit
    rate and evictions in /get_server_info and /metrics; /flush_cache empties it."""
    server = request.getfixturevalue(which)
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    first = server.post(
        "/generate", json={"text": "def add(a, b):", "sampling_params": params}
    ).json()
    ids = first["meta_info"]["prompt_tokens"] + first["meta_info"]["completion_tokens"]
    assert first["meta_info"]["cached_tokens"] == 0
    second = server.post(
        "/generate",
        json={"text": "def add(a, b):" + first["text"] + " return", "sampling_params": params},
    ).json()
    assert second["meta_info"]["cached_tokens"] == ids - 1  # all but turn 1's last token

    c = client(server)
    question = [{"role": "user", "content": "name a prime"}]
    one = c.chat.completions.create(
        model="tiny-v4",
        messages=question,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    follow_up = question + [
        {"role": "assistant", "content": one.choices[0].message.content},
        {"role": "user", "content": "another"},
    ]
    two = c.chat.completions.create(
        model="tiny-v4",
        messages=follow_up,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert one.usage.prompt_tokens < cached < two.usage.prompt_tokens

    state = server.info()["internal_states"][0]
    assert 0 < state["cache_hit_rate"] < 1 and state["cache_tokens"] > 0
    assert state["cache_evicted_tokens"] >= 0 and state["cache_snapshots"] > 0
    metrics = server.get("/metrics").text
    rate = [row for row in metrics.splitlines() if row.startswith("sglang:cache_hit_rate{")]
    assert rate and float(rate[0].split()[-1]) > 0
    assert (
        "sglang:cached_tokens_total" in metrics and "sglang:cache_evicted_tokens_total" in metrics
    )
    server.wait_idle()
    assert server.post("/flush_cache").status_code == 200
    state = server.info()["internal_states"][0]
    assert (
        state["cache_tokens"] == 0
        and state["available_tokens"] == server.info()["max_total_tokens"]
    )


def test_abort_request_route(spec_server):
    rid = "to-abort-1"
    result = {}

    def run():
        result["r"] = spec_server.post(
            "/generate",
            json={
                "text": PROMPT,
                "rid": rid,
                "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
            },
        ).json()

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.5)
    assert spec_server.post("/abort_request", json={"rid": rid}).status_code == 200
    thread.join(timeout=30)
    assert result["r"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert result["r"]["meta_info"]["completion_tokens"] < 900
    spec_server.wait_idle()


def test_client_disconnect_aborts_the_request(spec_server):
    before = spec_server.info()["internal_states"][0]["available_tokens"]
    response = spec_server.post(
        "/generate",
        json={
            "text": PROMPT,
            "stream": True,
            "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
        },
        stream=True,
    )
    next(response.iter_lines())
    response.close()
    state = spec_server.wait_idle(timeout=20)
    assert state["available_tokens"] == before
    metrics = spec_server.get("/metrics").text
    aborted = [
        line
        for line in metrics.splitlines()
        if line.startswith("sglang:num_aborted_requests_total")
    ]
    assert float(aborted[0].split()[-1]) >= 1


# -- load ------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["spec_server", "plain_server"])
def test_64_concurrent_mixed_requests(request, which):
    server = request.getfixturevalue(which)
    start = server.info()["internal_states"][0]
    rng = random.Random(0)

    def one(i):
        params = {"max_new_tokens": rng.randint(1, 40), "ignore_eos": i % 3 != 0}
        if i % 2:
            params.update(
                temperature=rng.choice([0.5, 1.0]),
                top_p=rng.choice([0.8, 1.0]),
                top_k=rng.choice([-1, 5]),
            )
        else:
            params["temperature"] = 0
        prompt = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 60)))
        response = server.post("/generate", json={"text": prompt, "sampling_params": params})
        assert response.status_code == 200, response.text
        meta = response.json()["meta_info"]
        assert meta["completion_tokens"] <= params["max_new_tokens"]
        return meta

    with ThreadPoolExecutor(64) as pool:
        metas = list(pool.map(one, range(64)))
    assert len(metas) == 64 and all(m["finish_reason"]["type"] in ("stop", "length") for m in metas)
    server.wait_idle()
    assert server.post("/flush_cache").status_code == 200  # the prefix cache's pages come back
    end = server.info()["internal_states"][0]
    assert end["available_tokens"] == server.info()["max_total_tokens"]
    assert start["available_tokens"] + start["cache_tokens"] == end["available_tokens"]
    assert end["available_request_slots"] == server.info()["max_running_requests"]


def test_small_cache_retracts_and_keeps_greedy_output(served_checkpoint, spec_server):
    prompts = [PROMPT * (1 + i % 3) + str(i) for i in range(12)]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    expected = [
        r["text"]
        for r in spec_server.post(
            "/generate", json={"text": prompts, "sampling_params": params}
        ).json()
    ]
    small = serve(
        served_checkpoint,
        "--max-total-tokens",
        "256",
        "--page-size",
        "4",
        "--chunked-prefill-size",
        "32",
    )
    try:
        with ThreadPoolExecutor(12) as pool:
            got = list(
                pool.map(
                    lambda p: small.post(
                        "/generate", json={"text": p, "sampling_params": params}
                    ).json(),
                    prompts,
                )
            )
        assert [g["text"] for g in got] == expected
        state = small.wait_idle()
        assert state["num_retractions"] > 0
        assert small.post("/flush_cache").status_code == 200
        state = small.info()["internal_states"][0]
        assert state["available_tokens"] == small.info()["max_total_tokens"]
    finally:
        small.stop()


# -- bad input -------------------------------------------------------------------------------

BAD = [
    ("/generate", "{not json", 400, "not valid JSON"),
    (
        "/generate",
        {"text": PROMPT, "sampling_params": {"temperature": "hot"}},
        400,
        "temperature must be a number",
    ),
    ("/generate", {"text": PROMPT, "sampling_params": {"top_p": 1.5}}, 400, "top_p must be in"),
    (
        "/generate",
        {"text": PROMPT, "sampling_params": {"max_new_tokens": -3}},
        400,
        "max_new_tokens must be >= 0",
    ),
    ("/generate", {"text": ""}, 400, "empty prompt"),
    ("/generate", {"input_ids": [1] * 1100}, 400, "context length is 1024"),
    ("/generate", {"text": PROMPT, "stream": "yes"}, 400, "'stream' must be bool"),
    (
        "/generate",
        {"text": PROMPT, "sampling_params": {"bogus": 1}},
        400,
        "unknown sampling parameter",
    ),
    ("/v1/completions", "{oops", 400, "JSON"),
    (
        "/v1/completions",
        {"model": "tiny-v4", "prompt": "x", "max_tokens": "many"},
        400,
        "max_tokens",
    ),
    (
        "/v1/completions",
        {"model": "tiny-v4", "prompt": "x", "temperature": -1},
        400,
        "temperature must be >= 0",
    ),
    ("/v1/completions", {"model": "tiny-v4", "prompt": ""}, 400, "empty prompt"),
    (
        "/v1/completions",
        {"model": "tiny-v4", "prompt": "x", "max_tokens": 5000},
        400,
        "exceeds the context length",
    ),
    ("/v1/chat/completions", {"model": "tiny-v4", "messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": "tiny-v4", "messages": [{"content": "no role"}]},
        400,
        "role",
    ),
]


@pytest.mark.parametrize("path,body,status,message", BAD)
def test_bad_input_gets_a_clear_400_and_the_server_keeps_serving(
    spec_server, path, body, status, message
):
    kwargs = {"data": body} if isinstance(body, str) else {"json": body}
    response = spec_server.post(path, headers={"content-type": "application/json"}, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"]
    if path.startswith("/v1/"):
        assert error["type"] == "invalid_request_error" and error["code"] == status
    assert (
        spec_server.post(
            "/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 2}}
        ).status_code
        == 200
    )


def test_api_key(plain_server):
    url = plain_server.url
    assert requests.get(url + "/v1/models").status_code == 401
    wrong = requests.post(
        url + "/v1/completions",
        headers={"Authorization": "Bearer nope"},
        json={"model": "tiny-v4", "prompt": "x"},
    )
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert requests.post(url + "/generate", json={"text": "x"}).status_code == 401
    assert requests.get(url + "/health").status_code == 200
    assert plain_server.get("/v1/models").status_code == 200
