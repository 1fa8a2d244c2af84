# SPDX-License-Identifier: Apache-2.0
"""Error answers, always JSON in the shape of the route that failed: OpenAI error objects
under `/v1` (`{"error": {"message", "type", "param", "code"}}`), SGLang's
`{"error": {"message", "code"}}` elsewhere. A 400 (or 409, 413) says what to fix; a 500
names the exception, the server logs its traceback and keeps serving."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.core.errors import InvalidRequestError
from runtime.server.openai_render import error_body

logger = logging.getLogger(__name__)

_OPENAI_KINDS = {
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    500: "server_error",
    503: "server_error",
}


def error_payload(path: str, message: str, status: int, param: str | None = None) -> dict:
    if path.startswith("/v1/"):
        kind = _OPENAI_KINDS.get(status, "invalid_request_error")
        return error_body(message, status, kind, param)
    error = {"message": message, "code": status}
    if param is not None:
        error["param"] = param
    return {"error": error}


def error_response(
    request: Request, message: str, status: int, param: str | None = None
) -> JSONResponse:
    return JSONResponse(error_payload(request.url.path, message, status, param), status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        message = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in errors
        )
        locs = [[str(p) for p in e["loc"] if p != "body"] for e in errors]
        param = ".".join(locs[0]) if locs and locs[0] else None
        return error_response(request, f"invalid request: {message}", 400, param)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, exc: InvalidRequestError):
        return error_response(request, str(exc), exc.status, exc.param)

    @app.exception_handler(json.JSONDecodeError)
    async def bad_json(request: Request, exc: json.JSONDecodeError):
        message = f"the body is not valid JSON: {exc.msg} at position {exc.pos}"
        return error_response(request, message, 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        response = error_response(request, str(exc.detail), exc.status_code)
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        message = f"internal server error: {type(exc).__name__}: {exc}"
        return error_response(request, message, 500)
