# SPDX-License-Identifier: Apache-2.0
"""What every route needs, kept on `app.state.server` by `create_app` and handed to route
functions as a FastAPI dependency (`state: State`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from runtime.engine.async_engine import AsyncEngine
from runtime.engine.request_factory import RequestFactory
from runtime.server.metrics import ServerMetrics
from runtime.server_args import ServerArgs


@dataclass(frozen=True)
class ServerState:
    engine: AsyncEngine
    args: ServerArgs
    metrics: ServerMetrics | None
    model_name: str  # --served-model-name, or the model directory's name

    @property
    def requests(self) -> RequestFactory:
        """The engine's request factory, what the routes may use off the loop thread:
        tokenizing, validating and building requests, the tokenizer and model config."""
        return self.engine.engine.requests

    def public_path(self, path: str | None) -> str | None:
        """A checkpoint or tokenizer path as responses show it: the served name for the
        model itself, else the directory's name (never a filesystem path)."""
        if path is None:
            return None
        if path == self.engine.info.model_path:
            return self.model_name
        return public_name(path)


def public_name(path: str) -> str:
    """The last component of a directory path (`/ckpt/deepseek_v4_tiny/` -> its name)."""
    return Path(path.rstrip("/\\")).name or path


def server_state(request: Request) -> ServerState:
    return request.app.state.server


# A route parameter `state: State` receives the app's `ServerState` (FastAPI's `Annotated`
# dependency style).
State = Annotated[ServerState, Depends(server_state)]
