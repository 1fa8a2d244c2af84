# SPDX-License-Identifier: Apache-2.0
"""Request bodies parsed off the event loop.

JSON decoding, the Unicode check and pydantic validation of a large body take long enough
to stall every other connection (a 2 MB prompt held `/health` for seconds), so they run in
Starlette's thread pool, as does everything that tokenizes (the routes call
`run_in_threadpool` for that). The body itself was read and size-capped by `RequestGate`.

Rejected with a 400 naming the place: bytes that are not UTF-8, JSON's non-standard
`NaN`/`Infinity`, nesting too deep to parse, and strings holding a lone surrogate
(`"\\ud800"` is valid JSON but no UTF-8 text, so no tokenizer can take it).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from runtime.core.errors import InvalidRequestError

Model = TypeVar("Model", bound=BaseModel)


def _reject_constant(name: str):
    raise InvalidRequestError(f"the body is not valid JSON: {name} is not a JSON number")


def parse_json(raw: bytes) -> Any:
    """The parsed body (`{}` when empty). Bad JSON raises `json.JSONDecodeError` (a 400)."""
    if not raw:
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidRequestError(
            f"the body is not valid UTF-8: byte {err.start} cannot start or continue a character"
        ) from None
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise InvalidRequestError("the body is nested too deeply to parse") from None
    where = lone_surrogate_path(value)
    if where is not None:
        raise InvalidRequestError(
            f"'{where}' is not valid Unicode: it holds a lone surrogate", param=where
        )
    return value


def lone_surrogate_path(value: Any) -> str | None:
    """Path (`messages[0].content`) of the first string, or key, that is not encodable
    as UTF-8; None when every string is."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _is_utf8(item):
                return path or "body"
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{path}.{key}" if path else str(key)
                if not _is_utf8(key):
                    return path or "body"
                stack.append((child, child_path))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return None


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def json_body(request: Request) -> Any:
    """The request's JSON body, parsed and checked in a worker thread."""
    return await run_in_threadpool(parse_json, await request.body())


def _validate(model: type[Model], body: Any) -> Model:
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise RequestValidationError(err.errors(include_url=False, include_context=False)) from None


async def model_body(request: Request, model: type[Model]) -> Model:
    """The body as `model` (pydantic), parsed and validated in a worker thread; a
    validation error is a 400 naming the field."""
    body = await json_body(request)
    return await run_in_threadpool(_validate, model, body)
