# SPDX-License-Identifier: Apache-2.0
"""One request can never hurt another, over HTTP (issue 14 A and B): a matrix of bad
input over every route answers 4xx naming the field and leaves the server healthy with
every slot back; bodies over the limit get 413; a live rid gets 409 and the first request
is unaffected; clients that hang up are aborted (streaming or not, with an API key);
aborting an unknown rid says so, the client id of an `n > 1` request aborts its choices;
`max_tokens: 0` is counted; SIGTERM waits a bounded grace period, then aborts what is
left and exits; a 500 is JSON in the route's shape."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import pytest
import requests

from runtime import Engine
from runtime.engine.async_engine import AsyncEngine
from runtime.server.app import create_app
from runtime.server_args import ServerArgs
from tests.server.conftest import serve

PROMPT = "def fib(n): return n"
SHORT = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 900, "ignore_eos": True}

G, C, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (path, body, status, a word the message must hold, the field it names or None)
BAD_INPUT = [
    # seeds outside 64 bits, with and without the n offsets
    (C, {"prompt": "x", "seed": 2**64}, 400, "seed", "seed"),
    (C, {"prompt": "x", "seed": -(2**63) - 1}, 400, "seed", "seed"),
    (CHAT, {"messages": USER, "n": 2, "seed": 2**63 - 1}, 400, "seed + n - 1", "seed"),
    (G, {"text": "x", "sampling_params": {"sampling_seed": 2**64}}, 400, "64-bit", "sampling_seed"),
    (G, {"text": "x", "sampling_params": {"sampling_seed": 2**63 - 2, "n": 3}}, 400, "n - 1", None),
    # token ids outside the vocabulary anywhere
    (
        G,
        {"text": "x", "sampling_params": {"min_new_tokens": 4, "stop_token_ids": [999999]}},
        400,
        "stop_token_ids",
        "stop_token_ids",
    ),
    (C, {"prompt": "x", "stop_token_ids": [97]}, 400, "stop_token_ids", "stop_token_ids"),
    (CHAT, {"messages": USER, "stop_token_ids": [-1]}, 400, "stop_token_ids", None),
    (G, {"input_ids": [5, 6, 97]}, 400, "token ids", "input_ids"),
    (G, {"input_ids": [[5, 6], [7, -3]]}, 400, "token ids", "input_ids"),
    (G, {"input_ids": [5, True]}, 400, "token ids", "input_ids"),
    (C, {"prompt": [5, 6, 1000]}, 400, "token ids", "prompt"),
    (C, {"prompt": [[5], [6, 1000]]}, 400, "token ids", "prompt"),
    (
        G,
        {"text": "x", "return_logprob": True, "token_ids_logprob": [5, 99999]},
        400,
        "token_ids_logprob",
        "token_ids_logprob",
    ),
    (
        G,
        {"text": "x", "sampling_params": {"logit_bias": {"99999": 1.0}}},
        400,
        "logit_bias",
        "logit_bias",
    ),
    (C, {"prompt": "x", "logit_bias": {"99999": 5}}, 400, "logit_bias", "logit_bias"),
    # text that is not valid Unicode (lone surrogates) or not UTF-8
    (G, '{"text": "ab\\ud800c"}', 400, "lone surrogate", "text"),
    (C, '{"prompt": ["ok", "\\udfff"]}', 400, "lone surrogate", "prompt[1]"),
    (
        CHAT,
        '{"messages": [{"role": "user", "content": "\\ud83d"}]}',
        400,
        "surrogate",
        "messages[0].content",
    ),
    (G, '{"text": "x", "sampling_params": {"stop": ["\\ud800"]}}', 400, "surrogate", None),
    (G, b'{"text": "caf\xe9"}', 400, "not valid UTF-8", None),
    (C, b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8", None),
    (G, '{"text": "x", "sampling_params": {"temperature": NaN}}', 400, "NaN", None),
    (G, "[" * 100000 + "]" * 100000, 400, "nested", None),
    # n: 0, and n above --max-n
    (G, {"text": "x", "sampling_params": {"n": 0}}, 400, "n must be >= 1", "n"),
    (C, {"prompt": "x", "n": 0}, 400, "n must be >= 1", "n"),
    (CHAT, {"messages": USER, "n": 129}, 400, "--max-n", "n"),
    (G, {"text": "x", "sampling_params": {"n": 1000}}, 400, "--max-n", "n"),
    # chat roles and content
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role", "messages.0.role"),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "role", None),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "not supported",
        None,
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        400,
        "must be a string",
        None,
    ),
    # rid of the wrong type or count
    (G, {"text": "x", "rid": 5}, 400, "'rid'", "rid"),
    (G, {"text": "x", "rid": ""}, 400, "'rid'", "rid"),
    (G, {"text": "x", "rid": ["a", "b"]}, 400, "one entry per prompt", "rid"),
    (G, {"text": ["x", "y"], "rid": "a"}, 400, "one id per prompt", "rid"),
    (G, {"text": ["x", "y"], "rid": ["a", 3]}, 400, "'rid'", "rid"),
    (G, {"text": ["x", "y"], "rid": ["same", "same"]}, 409, "live request", "rid"),
    (
        G,
        {"text": "x", "rid": "twin", "sampling_params": {**SHORT, "n": 2}},
        None,
        None,
        None,
    ),  # valid (a control): twin-0 and twin-1
    # other fields
    (G, {"text": "x", "sampling_params": {"max_new_tokens": "many"}}, 400, "integer", None),
    (
        G,
        {"text": "x", "sampling_params": {"ignore_eos": "yes"}},
        400,
        "true or false",
        "ignore_eos",
    ),
    (G, '{"text": "x", "sampling_params": {"temperature": 1e999}}', 400, "finite", None),
    (
        G,
        {"text": "x", "return_logprob": True, "top_logprobs_num": -2},
        400,
        "top_logprobs_num",
        "top_logprobs_num",
    ),
    (
        G,
        {"text": "x", "return_logprob": True, "logprob_start_len": 99},
        400,
        "logprob_start_len",
        "logprob_start_len",
    ),
    (G, {"text": "x" * 10_000}, 400, "characters", "text"),
    (G, {"input_ids": [5] * 2000}, 400, "context length", "input_ids"),
    (G, "{not json", 400, "not valid JSON", None),
    (G, '"just a string"', 400, "JSON object", None),
    (C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", None),
    (C, {"prompt": "x", "logprobs": -1}, 400, "logprobs", "logprobs"),
    (C, {"prompt": 5}, 400, "prompt", None),
    (CHAT, {"messages": USER, "top_logprobs": 3}, 400, "top_logprobs", None),
    # what one request may cost (issue 56): alternatives per token, logprob entries per
    # response, stop strings and stop ids
    (G, {"text": "x", "top_logprobs_num": 4096}, 400, "--max-top-logprobs", "top_logprobs_num"),
    (C, {"prompt": "x", "logprobs": 6}, 400, "OpenAI", "logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "OpenAI", "top_logprobs"),
    (
        G,
        {
            "text": "x",
            "return_logprob": True,
            "top_logprobs_num": 20,
            "sampling_params": {"max_new_tokens": 900, "n": 30},
        },
        400,
        "--max-logprob-entries",
        "top_logprobs_num",
    ),
    (
        G,
        {"text": ["x"] * 30, "top_logprobs_num": 20, "sampling_params": {"max_new_tokens": 900}},
        400,
        "--max-logprob-entries",
        "top_logprobs_num",
    ),
    (
        C,
        {"prompt": "x", "logprobs": 5, "max_tokens": 1000, "n": 100},
        400,
        "--max-logprob-entries",
        "logprobs",
    ),
    (
        CHAT,
        {"messages": USER, "logprobs": True, "top_logprobs": 20, "max_tokens": 900, "n": 30},
        400,
        "--max-logprob-entries",
        "top_logprobs",
    ),
    (
        G,
        {"text": "x", "sampling_params": {"stop": [f"s{i}" for i in range(200)]}},
        400,
        "at most 64",
        "stop",
    ),
    (G, {"text": "x", "sampling_params": {"stop": "z" * 10_000}}, 400, "at most 256", "stop"),
    (C, {"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, 400, "at most 64", "stop"),
    (CHAT, {"messages": USER, "stop": ["y" * 257]}, 400, "at most 256", "stop"),
    (
        G,
        {"text": "x", "sampling_params": {"stop_token_ids": [5] * 257}},
        400,
        "at most 256",
        "stop_token_ids",
    ),
    ("/abort_request", {"rid": 5}, 400, "rid", "rid"),
    ("/abort_request", {"rid": "nobody-has-this"}, 404, "nothing was aborted", "rid"),
    ("/abort_request", "[1, 2]", 400, "rid", None),
    ("/no_such_route", {}, 404, "Not Found", None),
    ("/v1/no_such_route", {}, 404, "Not Found", None),
]


def _post(server, path, body):
    if isinstance(body, (str, bytes)):
        return server.post(path, data=body, headers={"content-type": "application/json"})
    return server.post(path, json=body)


def _healthy(server) -> None:
    out = server.post(G, json={"text": "ok", "sampling_params": SHORT})
    assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 4


@pytest.mark.parametrize("path,body,status,word,param", BAD_INPUT)
def test_bad_input_matrix(spec_server, path, body, status, word, param):
    response = _post(spec_server, path, body)
    if status is None:  # a valid control
        assert response.status_code == 200, response.text
        return
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert word in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    if path.startswith("/v1/"):
        assert error["type"] and error["code"] == status
    _healthy(spec_server)


def test_the_server_is_whole_after_the_matrix(spec_server):
    """Every slot back, nothing running: no bad request leaked anything."""
    for path, body, *_ in BAD_INPUT:
        _post(spec_server, path, body)
    spec_server.wait_idle()
    assert spec_server.post("/flush_cache").status_code == 200  # the prefix cache's pages
    info = spec_server.info()
    state = info["internal_states"][0]
    assert state["available_tokens"] == info["max_total_tokens"]
    assert state["available_request_slots"] == info["max_running_requests"]
    assert spec_server.get("/health").status_code == 200
    assert spec_server.get("/health_generate").status_code == 200


def test_wrong_methods_on_every_route(spec_server):
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"):
        response = spec_server.get(path)
        assert response.status_code == 405 and "error" in response.json()
    for path in ("/health", "/get_server_info", "/get_model_info", "/v1/models", "/metrics"):
        response = spec_server.post(path, json={})
        assert response.status_code == 405 and "error" in response.json()


def test_bodies_over_the_limit_get_413(served_checkpoint):
    server = serve(served_checkpoint, "--max-body-size", "100000")
    try:
        big = {"text": "a" * 200_000}
        response = server.post(G, json=big)
        assert (
            response.status_code == 413 and "--max-body-size" in response.json()["error"]["message"]
        )
        chunked = server.post(
            G, data=iter([json.dumps(big).encode()[i : i + 8192] for i in range(0, 200_020, 8192)])
        )
        assert chunked.status_code == 413
        v1 = server.post(C, json={"prompt": "a" * 200_000})
        assert v1.status_code == 413 and v1.json()["error"]["code"] == 413
        _healthy(server)
    finally:
        server.stop()


def _in_background(fn):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", fn()))
    thread.start()
    return thread, result


def test_a_live_rid_gets_409_and_the_first_request_is_unaffected(spec_server):
    params = {**SHORT, "max_new_tokens": 200}
    alone = spec_server.post(G, json={"text": PROMPT, "sampling_params": params}).json()
    spec_server.wait_idle()
    thread, first = _in_background(
        lambda: spec_server.post(
            G, json={"text": PROMPT, "rid": "dup-1", "sampling_params": params}
        )
    )
    deadline = time.time() + 20
    while spec_server.info()["internal_states"][0]["num_running_reqs"] == 0:
        assert time.time() < deadline
        time.sleep(0.02)
    clash = spec_server.post(G, json={"text": "other", "rid": "dup-1", "sampling_params": SHORT})
    stream = spec_server.post(
        G, json={"text": "other", "rid": "dup-1", "stream": True, "sampling_params": SHORT}
    )
    thread.join(60)
    assert clash.status_code == 409 and clash.json()["error"]["param"] == "rid"
    assert stream.status_code == 409
    assert first["r"].status_code == 200
    assert first["r"].json()["output_ids"] == alone["output_ids"]
    again = spec_server.post(G, json={"text": "other", "rid": "dup-1", "sampling_params": SHORT})
    assert again.status_code == 200  # the id is free once its request is done


def test_abort_by_the_client_id_of_an_n_request(spec_server):
    body = {"text": PROMPT, "rid": "fan", "sampling_params": {**LONG, "n": 3}}
    thread, result = _in_background(lambda: spec_server.post(G, json=body))
    deadline = time.time() + 20
    aborted = None
    while time.time() < deadline:
        aborted = spec_server.post("/abort_request", json={"rid": "fan"})
        if aborted.status_code == 200:
            break
        time.sleep(0.05)
    thread.join(60)
    assert aborted.json() == {"aborted": ["fan-0", "fan-1", "fan-2"]}
    outs = result["r"].json()
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort"] * 3
    assert spec_server.post("/abort_request", json={"rid": "fan"}).status_code == 404
    spec_server.wait_idle()


def _counter(server, name: str) -> float:
    lines = server.get("/metrics").text.splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith(name))


def _generated_tokens(server) -> float:
    return _counter(server, "sglang:generation_tokens_total")


def test_non_streaming_clients_that_hang_up_are_aborted(plain_server):
    """Behind the API key (the middleware that hid disconnects): 6 clients ask for 900
    tokens each and give up after a second; each of their requests ends aborted, short of
    its tokens (counted by the server's metrics, so the check does not depend on how many
    tokens the server generates in that second)."""
    before = _generated_tokens(plain_server)
    aborted = _counter(plain_server, "sglang:num_aborted_requests_total")

    def impatient():
        try:
            requests.post(
                plain_server.url + G,
                headers=plain_server.headers,
                json={"text": PROMPT, "sampling_params": LONG},
                timeout=1.0,
            )
        except requests.Timeout:
            pass

    threads = [threading.Thread(target=impatient) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    plain_server.wait_idle(timeout=20)
    assert _counter(plain_server, "sglang:num_aborted_requests_total") - aborted == 6
    assert _generated_tokens(plain_server) - before < 6 * 900


def test_requests_with_max_tokens_0_are_counted(plain_server):
    def finished() -> float:
        lines = plain_server.get("/metrics").text.splitlines()
        return sum(float(x.split()[-1]) for x in lines if x.startswith("sglang:num_requests_total"))

    before = finished()
    out = plain_server.post(C, json={"prompt": "x", "max_tokens": 0, "model": "tiny-v4"})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 0
    assert finished() == before + 1


def test_bearer_scheme_is_case_insensitive(plain_server):
    url = plain_server.url + "/v1/models"
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert requests.get(url, headers={"Authorization": f"{scheme} sekret"}).status_code == 200
    for header in ("Bearer sekret2", "Basic sekret", "sekret", "Bearer"):
        response = requests.get(url, headers={"Authorization": header})
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"


def test_sigterm_waits_the_grace_period_then_aborts_and_exits(served_checkpoint):
    server = serve(served_checkpoint, "--graceful-shutdown-timeout", "1")
    threads = [
        _in_background(lambda: server.post(G, json={"text": PROMPT, "sampling_params": LONG}))
        for _ in range(2)
    ]
    # SIGTERM once both are decoding (the stats are published after a step, so a request
    # counted as running has finished its prefill step), not after a fixed sleep, which a
    # busy machine outlasts before the first token
    deadline = time.time() + 60
    while server.info()["internal_states"][0]["num_running_reqs"] < 2:
        assert time.time() < deadline, "the two requests never ran"
        time.sleep(0.05)
    start = time.time()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(timeout=30)
    took = time.time() - start
    server.log.close()
    for thread, result in threads:
        thread.join(30)
        meta = result["r"].json()["meta_info"]
        assert (
            meta["finish_reason"]["type"] == "abort"
            and "shutting down" in meta["finish_reason"]["message"]
        )
        assert 0 < meta["completion_tokens"] < 900
    assert took < 1 + 5 + 5  # grace + the drain uvicorn allows + start-up slack


# -- in process: a 500 in each route's own shape ----------------------------------------------


def _asgi(app, method: str, path: str, body: bytes = b"", disconnect_after: float | None = None):
    """(status, parsed body) of one request driven straight through the ASGI app."""

    async def drive():
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        sent = []
        gone_at = None if disconnect_after is None else time.monotonic() + disconnect_after

        async def receive():
            if messages:
                return messages.pop(0)
            if gone_at is not None and time.monotonic() >= gone_at:
                return {"type": "http.disconnect"}
            await asyncio.sleep(3600 if gone_at is None else gone_at - time.monotonic())
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"content-type", b"application/json"),
                (b"authorization", b"bearer " + API_KEY.encode()),
            ],
            "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 80),
        }
        try:
            await app(scope, receive, send)
        except RuntimeError:
            pass  # Starlette re-raises a handled 500 for the server to log
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return status, json.loads(payload)

    return asyncio.run(drive())


API_KEY = "in-process-key"


@pytest.fixture
def in_process_app(served_checkpoint):
    """The app behind an API key: the key check is where disconnects used to get lost."""
    engine = Engine(model_path=str(served_checkpoint), dtype="float32", page_size=4)
    runner = AsyncEngine(engine)
    app = create_app(runner, ServerArgs(model_path=str(served_checkpoint), api_key=API_KEY))
    yield app, engine, runner
    runner.shutdown()


def test_an_internal_error_is_a_500_in_the_routes_shape(in_process_app, monkeypatch):
    app, engine, _ = in_process_app

    def explode(*args, **kwargs):
        raise RuntimeError("unexpected")

    monkeypatch.setattr(engine.requests, "make_requests", explode)
    status, body = _asgi(app, "POST", G, json.dumps({"text": "x"}).encode())
    assert status == 500 and body["error"]["code"] == 500
    assert "RuntimeError: unexpected" in body["error"]["message"]
    status, body = _asgi(app, "POST", C, json.dumps({"prompt": "x"}).encode())
    assert status == 500 and body["object"] == "error"
    assert body["error"]["type"] == "server_error" and "unexpected" in body["error"]["message"]


def test_a_client_gone_after_its_body_aborts_a_non_streaming_request(in_process_app):
    """The disconnect reaches the handler through the request gate."""
    app, _, runner = in_process_app
    body = json.dumps({"text": PROMPT, "sampling_params": LONG}).encode()
    status, out = _asgi(app, "POST", G, body, disconnect_after=0.3)
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < 900
    assert runner.stats.is_idle
