# SPDX-License-Identifier: Apache-2.0
"""The FastAPI app: SGLang-native, OpenAI-compatible and admin routes over an `AsyncEngine`.

Bad input is a 400 that says what to fix (OpenAI error objects on `/v1`), a missing or
wrong API key a 401. A client that goes away aborts its requests. Nothing a request
sends can stop the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from runtime.core.errors import InvalidRequestError
from runtime.core.request import Req
from runtime.engine.async_engine import AsyncEngine
from runtime.server import openai_api
from runtime.server.native_api import parse_generate, response_shape
from runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


def sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _error(request: Request, message: str, status: int) -> JSONResponse:
    if request.url.path.startswith("/v1/"):
        kind = "authentication_error" if status == 401 else "invalid_request_error"
        return JSONResponse(openai_api.error_body(message, status, kind), status_code=status)
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


async def _watch_disconnect(request: Request, reqs: list[Req], engine: AsyncEngine) -> None:
    while True:
        await asyncio.sleep(0.2)
        if await request.is_disconnected():
            for req in reqs:
                engine.abort(req.rid)
            return


async def _collect(request: Request, engine: AsyncEngine, reqs: list[Req]) -> list[dict]:
    """Final results of `reqs`; a client that disconnects meanwhile aborts them."""
    watcher = asyncio.create_task(_watch_disconnect(request, reqs, engine))
    try:
        return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))
    finally:
        watcher.cancel()


async def _merged(engine: AsyncEngine, reqs: list[Req]) -> AsyncIterator[tuple[int, dict]]:
    """(index, snapshot) of several requests as they arrive; closing it aborts the rest."""
    updates: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, req: Req) -> None:
        async for snapshot in engine.stream(req):
            await updates.put((index, snapshot))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
    remaining = len(reqs)
    try:
        while remaining:
            index, snapshot = await updates.get()
            remaining -= snapshot["finished"]
            yield index, snapshot
    finally:
        for task in tasks:
            task.cancel()


def create_app(engine: AsyncEngine, args: ServerArgs, metrics=None) -> FastAPI:
    app = FastAPI(title="nextn-runtime")
    core = engine.engine
    model_name = args.served_model_name or core.model_path
    served = {model_name, core.model_path}

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if args.api_key and request.url.path not in ("/health",):
            if request.headers.get("authorization") != f"Bearer {args.api_key}":
                return _error(
                    request, "missing or wrong API key: send 'Authorization: Bearer <key>'", 401
                )
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in exc.errors()
        )
        return _error(request, f"invalid request: {errors}", 400)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, exc: InvalidRequestError):
        return _error(request, str(exc), 400)

    @app.exception_handler(json.JSONDecodeError)
    async def bad_json(request: Request, exc: json.JSONDecodeError):
        return _error(request, f"the body is not valid JSON: {exc.msg} at position {exc.pos}", 400)

    async def json_body(request: Request):
        raw = await request.body()
        return json.loads(raw) if raw else {}

    # -- health and admin ------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/health_generate")
    async def health_generate():
        if not engine.alive:
            return Response(status_code=503)
        bos = getattr(core.model_config.hf_config, "bos_token_id", None) or 0
        req = core.make_request(
            [bos], {"max_new_tokens": 1, "temperature": 0}, rid=f"health-{uuid.uuid4().hex}"
        )
        try:
            result = await asyncio.wait_for(engine.generate(req), timeout=60)
        except asyncio.TimeoutError:
            engine.abort(req.rid)
            return Response(status_code=503)
        ok = result["meta_info"]["finish_reason"]["type"] != "abort"
        return Response(status_code=200 if ok else 503)

    @app.api_route("/get_server_info", methods=["GET"])
    @app.api_route("/server_info", methods=["GET"])
    async def server_info():
        return {**args.to_json(), **core.server_info(), "version": "0.1.0"}

    @app.get("/get_model_info")
    async def model_info():
        return {
            "model_path": core.model_path,
            "tokenizer_path": args.tokenizer_path or core.model_path,
            "is_generation": True,
            "served_model_name": model_name,
            "architectures": list(core.model_config.architectures),
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        # there is no prefix cache to drop; refuse while work is in flight, like SGLang
        if core.scheduler.running or core.scheduler.waiting:
            return PlainTextResponse("Cache not flushed: requests are running", status_code=400)
        return PlainTextResponse("Cache flushed.", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await json_body(request)
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            raise InvalidRequestError("send {'rid': '<request id>'}")
        engine.abort(rid)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            return PlainTextResponse("metrics are off: start the server with --enable-metrics", 404)
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- SGLang native ---------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request):
        call = parse_generate(await json_body(request), core)
        reqs = [r for group in call.groups for r in group]
        if call.stream:
            return StreamingResponse(
                _native_stream(call.batched or len(reqs) > 1, reqs), media_type="text/event-stream"
            )
        results = await _collect(request, engine, reqs)
        grouped, i = [], 0
        for group in call.groups:
            grouped.append(results[i : i + len(group)])
            i += len(group)
        return response_shape(call, grouped)

    async def _native_stream(indexed: bool, reqs: list[Req]):
        async for index, snapshot in _merged(engine, reqs):
            snapshot.pop("finished")
            if indexed:
                snapshot["index"] = index
            yield sse(snapshot)
        yield sse("[DONE]")

    # -- OpenAI ------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "nextn-runtime",
                    "root": core.model_path,
                    "max_model_len": core.context_length,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: openai_api.CompletionRequest, request: Request):
        openai_api.check_model(body.model, served)
        reqs = openai_api.completion_requests(body, core)
        echo = [
            core.tokenizer.decode(r.prompt_ids) if core.tokenizer else "" for r in reqs[:: body.n]
        ]
        if body.stream:
            return StreamingResponse(_completion_stream(body, reqs), media_type="text/event-stream")
        results = await _collect(request, engine, reqs)
        return openai_api.completion_response(body, results, model_name, core, echo)

    async def _completion_stream(body, reqs: list[Req]):
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        sent_text, sent_tokens, finals = [""] * len(reqs), [0] * len(reqs), {}
        async for i, snap in _merged(engine, reqs):
            text = snap["text"] or ""
            reason, matched = openai_api.finish_reason(snap) if snap["finished"] else (None, None)
            logprobs = (
                openai_api.completion_logprobs(snap, core, sent_tokens[i])
                if body.logprobs is not None
                else None
            )
            delta, sent_text[i] = text[len(sent_text[i]) :], text
            sent_tokens[i] = snap["meta_info"]["completion_tokens"]
            if snap["finished"]:
                finals[i] = snap
            if delta or reason:
                yield sse(
                    {
                        "id": cid,
                        "object": "text_completion",
                        "created": created,
                        "model": model_name,
                        "choices": [
                            {
                                "index": i,
                                "text": delta,
                                "logprobs": logprobs,
                                "finish_reason": reason,
                                "matched_stop": matched,
                            }
                        ],
                    }
                )
        if body.stream_options and body.stream_options.include_usage:
            results = [finals[i] for i in range(len(reqs))]
            yield sse(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": model_name,
                    "choices": [],
                    "usage": openai_api.usage(
                        results, openai_api.prompt_tokens_of(results, body.n)
                    ),
                }
            )
        yield sse("[DONE]")

    @app.post("/v1/chat/completions")
    async def chat(body: openai_api.ChatCompletionRequest, request: Request):
        openai_api.check_model(body.model, served)
        reqs = openai_api.chat_requests(body, core)
        if body.stream:
            return StreamingResponse(_chat_stream(body, reqs), media_type="text/event-stream")
        results = await _collect(request, engine, reqs)
        return openai_api.chat_response(body, results, model_name, core)

    async def _chat_stream(body, reqs: list[Req]):
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index, delta, reason=None, logprobs=None):
            return sse(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model_name,
                    "choices": [
                        {
                            "index": index,
                            "delta": delta,
                            "logprobs": logprobs,
                            "finish_reason": reason,
                        }
                    ],
                }
            )

        for i in range(len(reqs)):
            yield chunk(i, {"role": "assistant", "content": ""})
        sent_text, sent_tokens, finals = [""] * len(reqs), [0] * len(reqs), {}
        async for i, snap in _merged(engine, reqs):
            text = snap["text"] or ""
            reason = openai_api.finish_reason(snap)[0] if snap["finished"] else None
            logprobs = (
                openai_api.chat_logprobs(snap, core, sent_tokens[i]) if body.logprobs else None
            )
            delta, sent_text[i] = text[len(sent_text[i]) :], text
            sent_tokens[i] = snap["meta_info"]["completion_tokens"]
            if snap["finished"]:
                finals[i] = snap
            if delta or reason:
                yield chunk(i, {"content": delta} if delta else {}, reason, logprobs)
        if body.stream_options and body.stream_options.include_usage:
            results = [finals[i] for i in range(len(reqs))]
            yield sse(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model_name,
                    "choices": [],
                    "usage": openai_api.usage(
                        results, openai_api.prompt_tokens_of(results, body.n)
                    ),
                }
            )
        yield sse("[DONE]")

    return app
