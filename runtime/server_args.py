# SPDX-License-Identifier: Apache-2.0
"""`ServerArgs`: every `launch_server` flag, with SGLang's names, checked before any weights
are loaded. The engine settings and their defaults are `EngineConfig`'s; this adds only what
the HTTP server needs."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from runtime.configs.engine_config import EngineConfig, setting

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_MAX_BODY_SIZE = 32 * 2**20  # bytes: a full context as JSON token ids, many times over
DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT = 30.0  # seconds


@dataclass
class ServerArgs(EngineConfig):
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(30000, "TCP port to listen on")
    api_key: str | None = setting(None, "require `Authorization: Bearer <key>` on every route")
    enable_metrics: bool = setting(False, "expose Prometheus metrics at /metrics")
    log_level: str = setting("info", "debug, info, warning, error or critical")
    served_model_name: str | None = setting(None, "model name in the API (default: the path)")
    max_body_size: int = setting(
        DEFAULT_MAX_BODY_SIZE, "largest request body in bytes; larger ones get 413"
    )
    graceful_shutdown_timeout: float = setting(
        DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT,
        "seconds SIGTERM waits for running requests before aborting them and exiting",
    )

    def resolve(self) -> ServerArgs:
        """Fill defaults that depend on other flags and reject bad combinations (ValueError,
        FileNotFoundError for a missing checkpoint)."""
        super().resolve()
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a valid TCP port")
        if self.max_body_size < 1:
            raise ValueError(f"--max-body-size must be >= 1 byte, got {self.max_body_size}")
        if not self.graceful_shutdown_timeout >= 0:
            raise ValueError(
                f"--graceful-shutdown-timeout must be >= 0, got {self.graceful_shutdown_timeout}"
            )
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(
                f"unknown --log-level {self.log_level}; use debug, info, warning, error or critical"
            )
        return self

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**self.engine_fields())

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["api_key"] = "***" if self.api_key else None
        return out

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog="launch_server",
            description="Serve a model over HTTP (SGLang-native /generate and the OpenAI API).",
        )
        cls.add_cli_args(p)
        return p

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> ServerArgs:
        return cls.from_cli_args(cls.parser().parse_args(argv)).resolve()
