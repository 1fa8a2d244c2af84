# SPDX-License-Identifier: Apache-2.0
"""SGLang's native `POST /generate`: request parsing, the route, and response shaping with
the engine's SGLang renderer (the same one `Engine.generate` uses)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from runtime.core.errors import InvalidRequestError
from runtime.core.request import Req
from runtime.core.result import RequestResult
from runtime.engine.engine import Engine
from runtime.engine.sglang_output import render_generate
from runtime.server.request_body import json_body
from runtime.server.state import State
from runtime.server.streaming import collect, guarded_sse, merged, sse

router = APIRouter()

# Accepted for compatibility but unused by this runtime; a non-null value is refused.
_UNSUPPORTED = (
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "lora_path",
    "session_params",
    "custom_logit_processor",
    "return_hidden_states",
    "token_ids_logprob",
)


def _expect(value, types, name: str):
    """`value` unchanged when None or of `types` (a bool is not an int here), else a 400."""
    types = types if isinstance(types, tuple) else (types,)
    if value is None:
        return None
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        kinds = " or ".join(t.__name__ for t in types)
        raise InvalidRequestError(
            f"'{name}' must be {kinds}, got {type(value).__name__}", param=name
        )
    return value


@dataclass
class GenerateCall:
    groups: list[list[Req]]  # one group per prompt (n requests each)
    batched: bool
    stream: bool

    @property
    def requests(self) -> list[Req]:
        return [r for group in self.groups for r in group]


def _prompts(body: dict, engine: Engine) -> tuple[list, bool]:
    """(prompts as token id lists, whether the body is a batch)."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise InvalidRequestError("send exactly one of 'text' or 'input_ids'")
    if text is not None:
        _expect(text, (str, list), "text")
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if any(not isinstance(t, str) for t in texts):
            raise InvalidRequestError("'text' must be a string or a list of strings")
        param = "text" if not batched else "text[{}]"
        prompts = [engine.tokenize(t, param.format(i)) if t else [] for i, t in enumerate(texts)]
    else:
        _expect(input_ids, list, "input_ids")
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
    if batched and not prompts:
        raise InvalidRequestError("empty batch: send at least one prompt")
    return prompts, batched


def _per_prompt(value, count: int, name: str, kind: type) -> list:
    """`value` spread over `count` prompts: a list must have one entry each, a single value
    (or null) is shared."""
    if isinstance(value, list):
        if len(value) != count:
            raise InvalidRequestError(f"'{name}' list must have one entry per prompt", param=name)
        for item in value:
            _expect(item, kind, name)
        return value
    _expect(value, kind, name)
    return [value] * count


def parse_generate(body, engine: Engine) -> GenerateCall:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    for name in _UNSUPPORTED:
        if body.get(name) is not None:
            raise InvalidRequestError(f"'{name}' is not supported by this server")
    prompts, batched = _prompts(body, engine)
    params = _per_prompt(body.get("sampling_params"), len(prompts), "sampling_params", dict)
    rids = _per_prompt(body.get("rid"), len(prompts), "rid", str)
    if isinstance(body.get("rid"), str) and len(prompts) > 1:
        raise InvalidRequestError(
            "'rid' must be a list with one id per prompt for a batch", param="rid"
        )
    stream = bool(_expect(body.get("stream", False), bool, "stream"))
    start = _expect(body.get("logprob_start_len", -1), int, "logprob_start_len")
    options = dict(
        return_logprob=bool(_expect(body.get("return_logprob", False), bool, "return_logprob")),
        top_logprobs_num=_expect(body.get("top_logprobs_num", 0), int, "top_logprobs_num") or 0,
        logprob_start_len=-1 if start is None else start,
    )
    groups = [
        engine.make_requests(ids, p, rid=rid, **options)
        for ids, p, rid in zip(prompts, params, rids)
    ]
    return GenerateCall(groups, batched, stream)


def response_shape(call: GenerateCall, results: list[RequestResult]):
    """One object for one prompt and n = 1, else a flat list (SGLang's layout)."""
    rendered = [render_generate(r) for r in results]
    return rendered[0] if not call.batched and len(rendered) == 1 else rendered


async def _stream(
    snapshots: AsyncIterator[tuple[int, RequestResult]], indexed: bool
) -> AsyncIterator[str]:
    async for index, snapshot in snapshots:
        payload = render_generate(snapshot)
        if indexed:
            payload["index"] = index
        yield sse(payload)
    yield sse("[DONE]")


@router.post("/generate")
async def generate(request: Request, state: State):
    """Parsing and tokenizing run in a worker thread (a long prompt must not stall the
    event loop); a live `rid` is refused with 409."""
    body = await json_body(request)
    call = await run_in_threadpool(parse_generate, body, state.core)
    reqs = call.requests
    state.engine.submit(reqs)
    if call.stream:
        indexed = call.batched or len(reqs) > 1
        events = _stream(merged(request, state.engine, reqs), indexed)
        return StreamingResponse(
            guarded_sse(events, request.url.path), media_type="text/event-stream"
        )
    return response_shape(call, await collect(request, state.engine, reqs))
