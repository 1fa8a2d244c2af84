# SPDX-License-Identifier: Apache-2.0
"""What every route needs, kept on `app.state.server` by `create_app` and handed to route
functions as a FastAPI dependency (`state: State`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from runtime.engine.async_engine import AsyncEngine
from runtime.engine.engine import Engine
from runtime.server.metrics import ServerMetrics
from runtime.server_args import ServerArgs


@dataclass(frozen=True)
class ServerState:
    engine: AsyncEngine
    args: ServerArgs
    metrics: ServerMetrics | None
    model_name: str  # --served-model-name, or the model path

    @property
    def core(self) -> Engine:
        """The engine itself, for what is safe off its thread: validating and building
        requests (`make_request`, `tokenize`) and its fixed configuration."""
        return self.engine.engine

    @property
    def served_names(self) -> set[str]:
        """Model names a client may ask for."""
        return {self.model_name, self.engine.info.model_path}


def server_state(request: Request) -> ServerState:
    return request.app.state.server


# A route parameter `state: State` receives the app's `ServerState` (FastAPI's `Annotated`
# dependency style).
State = Annotated[ServerState, Depends(server_state)]
