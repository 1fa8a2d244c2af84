# SPDX-License-Identifier: Apache-2.0
"""OpenAI-compatible routes: `/v1/models` (and `/v1/models/{id}`), `/v1/completions`,
`/v1/chat/completions`. Request building (tokenizing, compiling a grammar) runs off the
event loop.

Request bodies and the engine requests they become are in `openai_protocol`, the response
objects in `openai_render`; both streaming routes share one generator, `openai_stream`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from runtime.core.result import RequestResult
from runtime.engine.request_factory import RequestFactory
from runtime.server import openai_render as render
from runtime.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_requests,
    completion_requests,
    echo_texts,
    log_model_name,
    with_openai_names,
)
from runtime.server.rendering import json_response
from runtime.server.request_body import model_body
from runtime.server.state import ServerState, State
from runtime.server.streaming import collect, guarded_sse, merged, sse

router = APIRouter(prefix="/v1")


@dataclass(frozen=True)
class StreamFormat:
    """What differs between the completion and the chat stream."""

    object: str  # "text_completion" | "chat.completion.chunk"
    id_prefix: str  # "cmpl" | "chatcmpl"
    choice: Callable  # (index, new text, finish reason, matched stop, logprobs) -> dict
    # (snapshot, first new token, first chunk of the choice) -> logprobs
    logprobs: Callable[[RequestResult, int, bool], dict] | None
    opening: Callable[[int], dict] | None = None  # first chunk's choice per index
    echo: list[str] | None = None  # completion `echo`: text before choice i's first chunk


async def openai_stream(
    state: ServerState,
    snapshots: AsyncIterator[tuple[int, RequestResult]],
    count: int,
    n: int,
    fmt: StreamFormat,
    include_usage: bool,
    rid=None,
) -> AsyncIterator[str]:
    """Server-sent chunks of `count` requests (choice i is request i, `snapshots` from
    `merged`): each carries the text and logprobs new since that choice's previous chunk;
    then usage (if asked) and [DONE]. Every chunk's `id` is `render.response_id`'s."""
    cid, created = render.response_id(rid, fmt.id_prefix), int(time.time())

    def chunk(choices: list[dict], **extra) -> str:
        head = {"id": cid, "object": fmt.object, "created": created, "model": state.model_name}
        return sse({**head, "choices": choices, **extra})

    if fmt.opening is not None:
        for i in range(count):
            yield chunk([fmt.opening(i)])
    sent_text, sent_tokens, finals = [""] * count, [0] * count, {}
    opened = [False] * count
    async for i, snapshot in snapshots:
        text = snapshot.text or ""
        reason, matched = render.finish_reason(snapshot)
        delta = text[len(sent_text[i]) :]
        if not (delta or reason):
            continue  # nothing new to say (text held back for a possible stop string)
        first = not opened[i]
        logprobs = None
        if fmt.logprobs is not None:  # the prompt's too with echo: off the event loop
            logprobs = await run_in_threadpool(fmt.logprobs, snapshot, sent_tokens[i], first)
        if first and fmt.echo is not None:
            delta = fmt.echo[i] + delta
        opened[i], sent_text[i], sent_tokens[i] = True, text, snapshot.completion_tokens
        if snapshot.finished:
            finals[i] = snapshot
        choice = fmt.choice(i, delta, reason, matched, logprobs)
        yield chunk([choice]) if logprobs is None else await run_in_threadpool(chunk, [choice])
    if include_usage:
        yield chunk([], usage=render.usage([finals[i] for i in range(count)], n))
    yield sse("[DONE]")


def _streaming(request: Request, generator: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        guarded_sse(generator, request.url.path), media_type="text/event-stream"
    )


def _prepare_completion(body: CompletionRequest, engine: RequestFactory):
    """Requests and echo texts of a completion call: it tokenizes and detokenizes, so it
    runs in a worker thread."""
    reqs = with_openai_names(completion_requests, body, engine)
    # one response carries every prompt's choices
    with_openai_names(engine.limits.check_logprob_entries, reqs, logprob_start_len="echo")
    echo = None
    if body.echo:
        echo = echo_texts(body, [r.prompt_ids for r in reqs[:: body.n]], engine)
    return reqs, echo


def model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "nextn-runtime",
        "root": state.model_name,
        "max_model_len": state.engine.info.context_length,
    }


@router.get("/models")
async def models(state: State):
    return {"object": "list", "data": [model_card(state)]}


@router.get("/models/{model:path}")
async def retrieve_model(model: str, state: State):
    """`client.models.retrieve(id)`: the served model; other ids are 404 (SGLang's answer)."""
    if model != state.model_name:
        body = render.error_body(f"The model '{model}' does not exist", 404, param="model")
        body["error"]["code"] = "model_not_found"
        return JSONResponse(body, status_code=404)
    return model_card(state)


@router.post("/completions")
async def completions(request: Request, state: State):
    body = await model_body(request, CompletionRequest)
    log_model_name(body.model, state.model_name)
    reqs, echo = await run_in_threadpool(_prepare_completion, body, state.requests)
    state.engine.submit(reqs)
    tokenizer = state.requests.tokenizer
    wants_logprobs = body.logprobs is not None
    if body.stream:
        fmt = StreamFormat(
            "text_completion",
            "cmpl",
            render.completion_choice,
            (
                lambda r, start, first: render.completion_logprobs(
                    r, tokenizer, start, with_prompt=first and body.echo
                )
            )
            if wants_logprobs
            else None,
            echo=None if echo is None else [echo[i // body.n] for i in range(len(reqs))],
        )
        snapshots = merged(request, state.engine, reqs)
        return _streaming(
            request,
            openai_stream(state, snapshots, len(reqs), body.n, fmt, body.include_usage, body.rid),
        )
    results = await collect(request, state.engine, reqs)
    return await json_response(
        request,
        render.completion_response,
        results,
        body.n,
        state.model_name,
        tokenizer,
        echo,
        wants_logprobs,
        body.rid,
    )


@router.post("/chat/completions")
async def chat(request: Request, state: State):
    body = await model_body(request, ChatCompletionRequest)
    log_model_name(body.model, state.model_name)
    reqs = await run_in_threadpool(
        with_openai_names,
        chat_requests,
        body,
        state.requests,
        input_ids="messages",
        text="messages",
        top_logprobs_num="top_logprobs",
    )
    state.engine.submit(reqs)
    tokenizer = state.requests.tokenizer
    if body.stream:
        fmt = StreamFormat(
            "chat.completion.chunk",
            "chatcmpl",
            render.chat_delta_choice,
            (lambda r, start, first: render.chat_logprobs(r, tokenizer, start))
            if body.logprobs
            else None,
            opening=render.chat_opening_choice,
        )
        snapshots = merged(request, state.engine, reqs)
        return _streaming(
            request,
            openai_stream(state, snapshots, len(reqs), body.n, fmt, body.include_usage, body.rid),
        )
    results = await collect(request, state.engine, reqs)
    return await json_response(
        request,
        render.chat_response,
        results,
        body.n,
        state.model_name,
        tokenizer,
        body.logprobs,
        body.rid,
    )
