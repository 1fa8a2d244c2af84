# SPDX-License-Identifier: Apache-2.0
"""Error answers: a 400 that says what to fix for bad input, a 401 for a missing or wrong
API key; OpenAI error objects under `/v1`, SGLang's `{"error": {...}}` elsewhere."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from runtime.core.errors import InvalidRequestError
from runtime.server.openai_render import error_body

OPEN_PATHS = ("/health",)  # answered without an API key (liveness probes)


def error_response(request: Request, message: str, status: int) -> JSONResponse:
    if request.url.path.startswith("/v1/"):
        kind = "authentication_error" if status == 401 else "invalid_request_error"
        return JSONResponse(error_body(message, status, kind), status_code=status)
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in exc.errors()
        )
        return error_response(request, f"invalid request: {errors}", 400)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, exc: InvalidRequestError):
        return error_response(request, str(exc), 400)

    @app.exception_handler(json.JSONDecodeError)
    async def bad_json(request: Request, exc: json.JSONDecodeError):
        message = f"the body is not valid JSON: {exc.msg} at position {exc.pos}"
        return error_response(request, message, 400)


def install_api_key_check(app: FastAPI, api_key: str | None) -> None:
    """Every route but `OPEN_PATHS` needs `Authorization: Bearer <api_key>` (when set)."""
    if not api_key:
        return

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if request.url.path not in OPEN_PATHS:
            if request.headers.get("authorization") != f"Bearer {api_key}":
                message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                return error_response(request, message, 401)
        return await call_next(request)
