# SPDX-License-Identifier: Apache-2.0
"""The OpenAI routes' `chat_template_kwargs` and `rid` (issue 56).

`chat_template_kwargs`: a name the server sets (an argument of `apply_chat_template`, a
special token, a template global) or one the template does not read is a 400 naming
`chat_template_kwargs.<key>`; a variable the template reads changes the prompt exactly as
the template rendered by jinja2 directly says; a template that fails is a 400 naming the
message (or the kwargs) that makes it fail, never a 500.

`rid`: the request's id on both routes, as on `/generate`: a live duplicate is a 409 while
the first request completes unchanged, `/abort_request` with it ends the request (every
choice when `n > 1`), a witness request is unaffected; a bad id is a 400 naming `rid`.
"""

from __future__ import annotations

import json
import threading
import time

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime import Engine
from runtime.engine.async_engine import AsyncEngine
from runtime.server.app import create_app
from runtime.server.chat_template import check_template_kwargs, template_variables
from runtime.server.openai_protocol import ChatCompletionRequest, chat_requests, with_openai_names
from runtime.server_args import ServerArgs
from tests.server.test_faults import API_KEY, _asgi

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# Reads `enable_thinking` and `budget`; refuses the `tool` role with raise_exception.
THINKING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns in this template') }}"
    "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking %}<think>{% else %}<nothink>{% endif %}"
    "{% if budget is defined %}{{ 'b' ~ (budget + 1) }}{% endif %}"
    "{% endif %}"
)


def _oracle_text(messages: list[dict], **kwargs) -> str:
    """THINKING_TEMPLATE rendered by jinja2 itself (transformers' settings)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(THINKING_TEMPLATE)
    return template.render(
        messages=messages, add_generation_prompt=True, raise_exception=raise_exception, **kwargs
    )


@pytest.fixture(scope="module")
def thinking_app(served_checkpoint):
    """The app over an engine whose tokenizer carries THINKING_TEMPLATE."""
    engine = Engine(model_path=str(served_checkpoint), dtype="float32", page_size=4)
    engine.tokenizer.chat_template = THINKING_TEMPLATE
    runner = AsyncEngine(engine)
    app = create_app(runner, ServerArgs(model_path=str(served_checkpoint), api_key=API_KEY))
    yield app, engine
    runner.shutdown()


def _chat_prompt(engine, **fields) -> list[int]:
    body = ChatCompletionRequest.model_validate({"messages": USER, "max_tokens": 1, **fields})
    (req,) = with_openai_names(chat_requests, body, engine)
    return req.prompt_ids


# ---------------------------------------------------------------------------------------
# chat_template_kwargs


def test_the_template_variables_are_its_undeclared_names():
    names = template_variables(THINKING_TEMPLATE)  # the environment's globals are not
    assert names == {"messages", "add_generation_prompt", "enable_thinking", "budget"}


@pytest.mark.parametrize(
    "key",
    [
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "chat_template",
        "documents",
        "messages",
        "return_dict",
        "tokenizer_kwargs",
        "bos_token",
        "raise_exception",
    ],
)
def test_a_reserved_kwarg_is_a_400_naming_it(spec_server, key):
    response = spec_server.post(
        CHAT, json={"messages": USER, "max_tokens": 1, "chat_template_kwargs": {key: True}}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == f"chat_template_kwargs.{key}"
    assert f"chat_template_kwargs.{key}" in error["message"] and "server" in error["message"]


def test_a_kwarg_the_template_does_not_read_is_a_400(spec_server):
    response = spec_server.post(
        CHAT,
        json={"messages": USER, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": 1}},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs.enable_thinking"
    assert "not a variable" in error["message"]
    empty = spec_server.post(
        CHAT, json={"messages": USER, "max_tokens": 1, "chat_template_kwargs": {}}
    )
    assert empty.status_code == 200, empty.text


def test_a_declared_kwarg_changes_the_prompt_as_the_template_says(thinking_app):
    _, engine = thinking_app
    tokenizer = engine.tokenizer
    for kwargs in ({"enable_thinking": True}, {"enable_thinking": False}, {"budget": 41}):
        expected = tokenizer.encode(_oracle_text(USER, **kwargs), add_special_tokens=False)
        assert _chat_prompt(engine, chat_template_kwargs=kwargs) == expected
    thinking = _chat_prompt(engine, chat_template_kwargs={"enable_thinking": True})
    plain = _chat_prompt(engine)
    assert thinking != plain
    assert plain == tokenizer.encode(_oracle_text(USER), add_special_tokens=False)


def test_kwarg_values_are_bounded(thinking_app):
    _, engine = thinking_app
    template = THINKING_TEMPLATE
    deep: list = []
    for _ in range(20):
        deep = [deep]
    for value, word in ((deep, "nested"), ("x" * 5000, "characters")):
        with pytest.raises(ValueError, match=word) as caught:
            check_template_kwargs({"budget": value}, engine.tokenizer, template)
        assert caught.value.param == "chat_template_kwargs.budget"
    many = {f"k{i}": 1 for i in range(40)}
    with pytest.raises(ValueError, match="at most") as caught:
        check_template_kwargs(many, engine.tokenizer, template)
    assert caught.value.param == "chat_template_kwargs"


def test_a_template_that_fails_is_a_400_naming_the_cause(thinking_app):
    app, _ = thinking_app
    refused = [*USER, {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "r"}]
    cases = [
        ({"messages": refused}, "messages[2]", "no tool turns in this template"),
        (
            {"messages": USER, "chat_template_kwargs": {"budget": "x"}},
            "chat_template_kwargs",
            "TypeError",
        ),
    ]
    for fields, param, word in cases:
        body = json.dumps({**fields, "max_tokens": 1}).encode()
        status, out = _asgi(app, "POST", CHAT, body)
        assert status == 400, out
        assert out["error"]["param"] == param and word in out["error"]["message"], out
    status, out = _asgi(app, "POST", CHAT, json.dumps({"messages": USER, "max_tokens": 2}).encode())
    assert status == 200 and out["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------------------------
# rid

LONG = {"temperature": 0, "max_tokens": 900, "ignore_eos": True}
MEDIUM = {"temperature": 0, "max_tokens": 120, "ignore_eos": True}
PROMPT = "def fib(n): return n"


def _in_background(fn):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", fn()))
    thread.start()
    return thread, result


def _wait_running(server, count: int = 1) -> None:
    deadline = time.time() + 30
    while server.info()["internal_states"][0]["num_running_reqs"] < count:
        assert time.time() < deadline, "the request never started"
        time.sleep(0.02)


@pytest.mark.parametrize(
    "path,body,status,word",
    [
        (C, {"prompt": "x", "rid": 5}, 400, "'rid'"),
        (CHAT, {"messages": USER, "rid": 5}, 400, "'rid'"),
        (CHAT, {"messages": USER, "rid": ""}, 400, "'rid'"),
        (C, {"prompt": "x", "rid": "r" * 257}, 400, "characters"),
        (CHAT, {"messages": USER, "rid": ["a", "b"]}, 400, "one entry per prompt"),
        (C, {"prompt": ["x", "y"], "rid": "a"}, 400, "one id per prompt"),
        (C, {"prompt": ["x", "y"], "rid": ["a", 3]}, 400, "'rid'"),
        (C, {"prompt": ["x", "y"], "rid": ["same", "same"]}, 409, "live request"),
        (C, {"prompt": "x", "rid": "twin", "n": 2, "max_tokens": 2}, 200, None),
        (CHAT, {"messages": USER, "rid": ["solo"], "max_tokens": 2}, 200, None),
    ],
)
def test_bad_rids(spec_server, path, body, status, word):
    response = spec_server.post(path, json=body)
    assert response.status_code == status, response.text
    if word is not None:
        error = response.json()["error"]
        assert word in error["message"] and error["param"] == "rid", error


def test_the_response_id_is_the_clients_rid(spec_server):
    """SGLang answers with the request's id as the OpenAI `id`; without a `rid`, a fresh one."""
    cases = [
        (C, {"prompt": "x", "rid": "mine-c", "max_tokens": 2}, "mine-c"),
        (C, {"prompt": ["x", "y"], "rid": ["b0", "b1"], "max_tokens": 2}, "b0"),
        (CHAT, {"messages": USER, "rid": "mine-chat", "max_tokens": 2}, "mine-chat"),
    ]
    for path, body, expected in cases:
        response = spec_server.post(path, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["id"] == expected
        stream = spec_server.post(path, json={**body, "stream": True})
        ids = {
            json.loads(line[len("data: ") :])["id"]
            for line in stream.text.splitlines()
            if line.startswith("data: {")
        }
        assert ids == {expected}, ids
    plain = [spec_server.post(C, json={"prompt": "x", "max_tokens": 2}).json()["id"] for _ in "ab"]
    assert plain[0] != plain[1] and all(i.startswith("cmpl-") for i in plain)


def test_a_live_openai_rid_gets_409_on_both_routes(spec_server):
    alone = spec_server.post(C, json={"prompt": PROMPT, **MEDIUM}).json()
    spec_server.wait_idle()
    thread, first = _in_background(
        lambda: spec_server.post(C, json={"prompt": PROMPT, "rid": "oa-dup", **MEDIUM})
    )
    _wait_running(spec_server)
    clashes = [
        spec_server.post(C, json={"prompt": "other", "rid": "oa-dup", "max_tokens": 2}),
        spec_server.post(CHAT, json={"messages": USER, "rid": "oa-dup", "max_tokens": 2}),
        spec_server.post(
            CHAT, json={"messages": USER, "rid": "oa-dup", "max_tokens": 2, "stream": True}
        ),
    ]
    thread.join(120)
    for clash in clashes:
        assert clash.status_code == 409, clash.text
        assert clash.json()["error"]["param"] == "rid"
    out = first["r"].json()
    assert out["choices"][0]["text"] == alone["choices"][0]["text"]
    assert out["choices"][0]["finish_reason"] == "length"
    again = spec_server.post(CHAT, json={"messages": USER, "rid": "oa-dup", "max_tokens": 2})
    assert again.status_code == 200  # free once its request is done


def _abort(server, rid: str):
    deadline = time.time() + 30
    while time.time() < deadline:
        aborted = server.post("/abort_request", json={"rid": rid})
        if aborted.status_code == 200:
            return aborted.json()
        time.sleep(0.05)
    raise AssertionError(f"nothing live had the id {rid}")


def test_abort_by_openai_rid_leaves_a_witness_unaffected(spec_server):
    witness_body = {"prompt": PROMPT, **MEDIUM}
    alone = spec_server.post(C, json=witness_body).json()["choices"][0]["text"]
    spec_server.wait_idle()
    chat_thread, chat = _in_background(
        lambda: spec_server.post(CHAT, json={"messages": USER, "rid": "oa-chat", **LONG})
    )
    fan_thread, fan = _in_background(
        lambda: spec_server.post(C, json={"prompt": PROMPT, "rid": "oa-fan", "n": 2, **LONG})
    )
    witness_thread, witness = _in_background(lambda: spec_server.post(C, json=witness_body))
    _wait_running(spec_server, 3)
    assert _abort(spec_server, "oa-chat") == {"aborted": ["oa-chat"]}
    assert _abort(spec_server, "oa-fan") == {"aborted": ["oa-fan-0", "oa-fan-1"]}
    for thread in (chat_thread, fan_thread, witness_thread):
        thread.join(120)
    chat_choice = chat["r"].json()["choices"][0]
    assert chat_choice["finish_reason"] == "abort"
    fan_choices = fan["r"].json()["choices"]
    assert [c["finish_reason"] for c in fan_choices] == ["abort", "abort"]
    witness_choice = witness["r"].json()["choices"][0]
    assert witness_choice["text"] == alone and witness_choice["finish_reason"] == "length"
    assert spec_server.post("/abort_request", json={"rid": "oa-chat"}).status_code == 404
    spec_server.wait_idle()
