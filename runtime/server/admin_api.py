# SPDX-License-Identifier: Apache-2.0
"""Admin routes, SGLang's names and answers: `/health`, `/health_generate`,
`/server_info` (alias `/get_server_info`), `/model_info` (alias `/get_model_info`),
`/flush_cache`,
`/abort_request` and Prometheus `/metrics`. Load figures come from the engine's published
`EngineStats` snapshot; nothing here touches the scheduler."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from runtime.core.errors import InvalidRequestError
from runtime.core.version import package_version
from runtime.server.errors import error_response
from runtime.server.request_body import json_body
from runtime.server.state import State

router = APIRouter()

HEALTH_GENERATE_TIMEOUT_S = 60.0  # one greedy token must come back within this


@router.get("/health")
async def health(state: State):
    return Response(status_code=200 if state.engine.alive else 503)


@router.get("/health_generate")
async def health_generate(state: State):
    """Healthy when one token can be generated end to end (SGLang's deeper health check)."""
    if not state.engine.alive:
        return Response(status_code=503)
    req = state.requests.make_request(
        [state.requests.bos_token_id],
        {"max_new_tokens": 1, "temperature": 0},
        rid=f"health-{uuid.uuid4().hex}",
    )
    try:
        result = await asyncio.wait_for(
            state.engine.generate(req), timeout=HEALTH_GENERATE_TIMEOUT_S
        )
    except asyncio.TimeoutError:
        state.engine.abort(req.rid)
        return Response(status_code=503)
    return Response(status_code=503 if result.aborted else 200)


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(state: State):
    info = {**state.args.to_json(), **state.engine.info.to_json()}
    for key in ("model_path", "tokenizer_path"):  # names, not filesystem paths
        info[key] = state.public_path(info.get(key))
    return {
        **info,
        "vocab_size": state.requests.model_config.vocab_size,
        "internal_states": [state.engine.stats.to_json()],
        "version": package_version(),
    }


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(state: State):
    tokenizer_path = state.args.tokenizer_path or state.engine.info.model_path
    return {
        "model_path": state.model_name,
        "tokenizer_path": state.public_path(tokenizer_path),
        "is_generation": True,
        "served_model_name": state.model_name,
        "architectures": list(state.requests.model_config.architectures),
    }


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(state: State):
    if await state.engine.flush_cache():
        return PlainTextResponse("Cache flushed.", status_code=200)
    return PlainTextResponse("Cache not flushed: requests are running", status_code=400)


@router.post("/abort_request")
async def abort_request(request: Request, state: State):
    """SGLang's abort: `{"rid": ...}` aborts that request, or every choice of the `n > 1`
    request the client named so; `{"abort_all": true}` aborts everything. An id nothing
    live has is a 404 saying so (SGLang answers 200 and does nothing)."""
    body = await json_body(request)
    if isinstance(body, dict) and body.get("abort_all") is True:
        state.engine.abort_all("aborted by the client (abort_all)")
        return {"aborted": "all"}
    rid = body.get("rid") if isinstance(body, dict) else None
    if not isinstance(rid, str):
        raise InvalidRequestError("send {'rid': '<request id>'}", param="rid")
    aborted = state.engine.abort(rid)
    if not aborted:
        return error_response(
            request, f"no live request has the id '{rid}': nothing was aborted", 404, "rid"
        )
    return {"aborted": aborted}


@router.get("/metrics")
async def metrics(state: State):
    if state.metrics is None:
        return PlainTextResponse("metrics are off: start the server with --enable-metrics", 404)
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
