# SPDX-License-Identifier: Apache-2.0
"""The FastAPI app over an `AsyncEngine`: one router per surface (SGLang-native
`/generate`, the OpenAI `/v1` API, admin and metrics), error handlers, and the request
gate (API key, body size). Bad input is a 4xx that says what to fix, a client that goes
away aborts its requests, and nothing a request sends can stop the server. When the app
shuts down, what is still running is aborted and the engine loop stops."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from runtime.core.version import package_version
from runtime.engine.async_engine import AsyncEngine
from runtime.server import admin_api, native_api, openai_api
from runtime.server.errors import install_error_handlers
from runtime.server.metrics import ServerMetrics
from runtime.server.request_gate import RequestGate
from runtime.server.state import ServerState, public_name
from runtime.server_args import ServerArgs


def create_app(
    engine: AsyncEngine, args: ServerArgs, metrics: ServerMetrics | None = None
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        # uvicorn re-raises SIGTERM after its graceful shutdown, so stopping the engine
        # loop (what is left is aborted) and the replica's other ranks happens here
        engine.shutdown("the server is shutting down")
        engine.engine.shutdown()

    app = FastAPI(title="nextn-runtime", version=package_version(), lifespan=lifespan)
    model_name = args.served_model_name or public_name(engine.info.model_path)
    app.state.server = ServerState(engine, args, metrics, model_name)
    app.add_middleware(RequestGate, api_key=args.api_key, max_body_size=args.max_body_size)
    install_error_handlers(app)
    for router in (admin_api.router, native_api.router, openai_api.router):
        app.include_router(router)
    return app
