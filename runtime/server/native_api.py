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
from runtime.engine.request_factory import RequestFactory
from runtime.engine.sglang_output import render_generate
from runtime.server.generate_fields import check_fields
from runtime.server.rendering import json_response
from runtime.server.request_body import json_body
from runtime.server.state import State
from runtime.server.streaming import collect, guarded_sse, merged, sse

router = APIRouter()


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


def _prompts(body: dict, engine: RequestFactory) -> tuple[list, bool]:
    """(prompts as token id lists, whether the body is a batch)."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise InvalidRequestError("send exactly one of 'text' or 'input_ids'", param="text")
    if text is not None:
        _expect(text, (str, list), "text")
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if any(not isinstance(t, str) for t in texts):
            raise InvalidRequestError("'text' must be a string or a list of strings", param="text")
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


def prompt_rids(rid, count: int) -> list[str | None]:
    """The client's request id of each of `count` prompts (SGLang's `rid`): one id, or
    one per prompt for a batch; `RequestFactory.make_requests` checks each and names the choices
    of an `n > 1` prompt `<rid>-<k>`."""
    if isinstance(rid, str) and count > 1:
        raise InvalidRequestError(
            "'rid' must be a list with one id per prompt for a batch", param="rid"
        )
    return _per_prompt(rid, count, "rid", str)


def _token_ids_logprob(value, count: int) -> list:
    """SGLang's `token_ids_logprob`: one id list shared by every prompt, or one per prompt."""
    _expect(value, list, "token_ids_logprob")
    if value is None or all(isinstance(v, int) for v in value):
        return [value] * count
    return _per_prompt(value, count, "token_ids_logprob", list)


def parse_generate(body, engine: RequestFactory) -> GenerateCall:
    """The requests of a `/generate` body (SGLang's `GenerateReqInput`). Builds them, grammar
    compilation included, so call it off the event loop."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    check_fields(body)
    prompts, batched = _prompts(body, engine)
    count = len(prompts)
    params = _per_prompt(body.get("sampling_params"), count, "sampling_params", dict)
    rids = prompt_rids(body.get("rid"), count)
    stream = bool(_expect(body.get("stream", False), bool, "stream"))
    per_prompt = zip(
        _per_prompt(body.get("return_logprob"), count, "return_logprob", bool),
        _per_prompt(body.get("logprob_start_len"), count, "logprob_start_len", int),
        _per_prompt(body.get("top_logprobs_num"), count, "top_logprobs_num", int),
        _token_ids_logprob(body.get("token_ids_logprob"), count),
    )
    with_text = bool(_expect(body.get("return_text_in_logprobs"), bool, "return_text_in_logprobs"))
    options = [
        dict(
            return_logprob=bool(logprob),
            logprob_start_len=-1 if start is None else start,
            top_logprobs_num=top or 0,
            token_ids_logprob=ids,
            return_text_in_logprobs=with_text,
        )
        for logprob, start, top, ids in per_prompt
    ]
    groups = [
        engine.make_requests(ids, p, rid=rid, **option)
        for ids, p, rid, option in zip(prompts, params, rids, options)
    ]
    call = GenerateCall(groups, batched, stream)
    engine.limits.check_logprob_entries(call.requests)  # one response carries them all
    return call


def response_shape(call: GenerateCall, results: list[RequestResult], token_texts=None):
    """One object for one prompt and n = 1, else a flat list (SGLang's layout)."""
    rendered = [render_generate(r, token_texts) for r in results]
    return rendered[0] if not call.batched and len(rendered) == 1 else rendered


def _event(snapshot: RequestResult, index: int | None, token_texts) -> str:
    payload = render_generate(snapshot, token_texts)
    if index is not None:
        payload["index"] = index
    return sse(payload)


async def _stream(
    snapshots: AsyncIterator[tuple[int, RequestResult]], indexed: bool, token_texts
) -> AsyncIterator[str]:
    """SGLang's stream: every event holds the whole result so far. With logprobs that grows
    with the request, so those events are rendered in a worker thread."""
    async for index, snapshot in snapshots:
        position = index if indexed else None
        if snapshot.logprobs is None:
            yield _event(snapshot, position, token_texts)
        else:
            yield await run_in_threadpool(_event, snapshot, position, token_texts)
    yield sse("[DONE]")


@router.post("/generate")
async def generate(request: Request, state: State):
    """Parsing and tokenizing run in a worker thread (a long prompt must not stall the
    event loop); a live `rid` is refused with 409."""
    call = await run_in_threadpool(parse_generate, await json_body(request), state.requests)
    reqs = call.requests
    state.engine.submit(reqs)
    if call.stream:
        indexed = call.batched or len(reqs) > 1
        events = _stream(merged(request, state.engine, reqs), indexed, state.requests.token_texts)
        return StreamingResponse(
            guarded_sse(events, request.url.path), media_type="text/event-stream"
        )
    results = await collect(request, state.engine, reqs)
    return await json_response(request, response_shape, call, results, state.requests.token_texts)
