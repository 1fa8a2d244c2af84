# SPDX-License-Identifier: Apache-2.0
"""The FastAPI app over an `AsyncEngine`: one router per surface (SGLang-native
`/generate`, the OpenAI `/v1` API, admin and metrics), error handlers and the API key
check. Bad input is a 400 that says what to fix, a client that goes away aborts its
requests, and nothing a request sends can stop the server."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from runtime.core.version import package_version
from runtime.engine.async_engine import AsyncEngine
from runtime.server import admin_api, native_api, openai_api
from runtime.server.errors import install_api_key_check, install_error_handlers
from runtime.server.metrics import ServerMetrics
from runtime.server.state import ServerState, public_name
from runtime.server_args import ServerArgs


def create_app(
    engine: AsyncEngine, args: ServerArgs, metrics: ServerMetrics | None = None
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        # uvicorn re-raises SIGTERM after its graceful shutdown, so stopping the engine
        # loop and the replica's other ranks happens here, not after `uvicorn.run`
        engine.shutdown()
        engine.engine.shutdown()

    app = FastAPI(title="nextn-runtime", version=package_version(), lifespan=lifespan)
    model_name = args.served_model_name or public_name(engine.info.model_path)
    app.state.server = ServerState(engine, args, metrics, model_name)
    install_api_key_check(app, args.api_key)
    install_error_handlers(app)
    for router in (admin_api.router, native_api.router, openai_api.router):
        app.include_router(router)
    return app
