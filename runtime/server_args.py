# SPDX-License-Identifier: Apache-2.0
"""`ServerArgs`: every `launch_server` flag, with SGLang's names, checked before any weights
are loaded."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from runtime.configs.model_config import SUPPORTED_DTYPES
from runtime.configs.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass
class ServerArgs:
    model_path: str | None = None
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"
    device: str = "cpu"
    page_size: int = 1
    max_running_requests: int | None = None  # 64, or 48 with speculative decoding (SGLang)
    max_total_tokens: int = 65536
    chunked_prefill_size: int = 512
    context_length: int | None = None
    random_seed: int | None = None
    api_key: str | None = None
    enable_metrics: bool = False
    log_level: str = "info"
    served_model_name: str | None = None
    skip_tokenizer_init: bool = False
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None

    def resolve(self) -> ServerArgs:
        """Fill defaults that depend on other flags and reject bad combinations (ValueError)."""
        spec = SpeculativeConfig.resolve(
            self.speculative_algorithm,
            self.speculative_num_steps,
            self.speculative_eagle_topk,
            self.speculative_num_draft_tokens,
        )
        if self.max_running_requests is None:
            self.max_running_requests = 48 if spec else 64
        if self.model_path is not None and not Path(self.model_path).is_dir():
            raise ValueError(f"--model-path '{self.model_path}' is not a directory")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"--dtype '{self.dtype}' is not supported; use one of {', '.join(SUPPORTED_DTYPES)}"
            )
        checks = [
            (1 <= self.port <= 65535, f"--port {self.port} is not a valid TCP port"),
            (self.page_size >= 1, f"--page-size must be >= 1, got {self.page_size}"),
            (self.max_running_requests >= 1, "--max-running-requests must be >= 1"),
            (self.max_total_tokens >= self.page_size, "--max-total-tokens must be >= --page-size"),
            (
                self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1,
                "--chunked-prefill-size must be -1 (off) or >= 1",
            ),
            (
                self.context_length is None or self.context_length >= 2,
                "--context-length must be >= 2",
            ),
            (
                self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                f"unknown --log-level {self.log_level}; "
                "use debug, info, warning, error or critical",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if spec:
            self.speculative_algorithm, self.speculative_num_steps = spec.algorithm, spec.num_steps
            self.speculative_eagle_topk, self.speculative_num_draft_tokens = (
                spec.eagle_topk,
                spec.num_draft_tokens,
            )
        return self

    def engine_kwargs(self) -> dict:
        names = (
            "model_path",
            "tokenizer_path",
            "dtype",
            "device",
            "page_size",
            "max_running_requests",
            "max_total_tokens",
            "chunked_prefill_size",
            "context_length",
            "random_seed",
            "skip_tokenizer_init",
            "speculative_algorithm",
            "speculative_num_steps",
            "speculative_eagle_topk",
            "speculative_num_draft_tokens",
        )
        return {n: getattr(self, n) for n in names}

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
        d = cls()
        p.add_argument(
            "--model-path",
            "--model",
            dest="model_path",
            help="checkpoint directory (default: the embedded tiny DeepSeek-V4 + MTP model)",
        )
        p.add_argument("--tokenizer-path", help="tokenizer directory (default: the model path)")
        p.add_argument("--host", default=d.host)
        p.add_argument("--port", type=int, default=d.port)
        p.add_argument("--dtype", default=d.dtype, help=f"one of {', '.join(SUPPORTED_DTYPES)}")
        p.add_argument("--device", default=d.device)
        p.add_argument("--page-size", type=int, default=d.page_size)
        p.add_argument("--max-running-requests", type=int)
        p.add_argument(
            "--max-total-tokens",
            type=int,
            default=d.max_total_tokens,
            help="KV cache capacity in tokens",
        )
        p.add_argument(
            "--chunked-prefill-size",
            type=int,
            default=d.chunked_prefill_size,
            help="prefill tokens per step (-1: no chunking)",
        )
        p.add_argument("--context-length", type=int)
        p.add_argument("--random-seed", type=int)
        p.add_argument("--api-key", help="require `Authorization: Bearer <key>` on every route")
        p.add_argument(
            "--enable-metrics", action="store_true", help="expose Prometheus metrics at /metrics"
        )
        p.add_argument("--log-level", default=d.log_level)
        p.add_argument("--served-model-name")
        p.add_argument("--skip-tokenizer-init", action="store_true")
        p.add_argument("--speculative-algorithm", help="NEXTN (aliases MTP, EAGLE)")
        p.add_argument(
            "--speculative-num-steps", type=int, help="draft steps per round (default 3)"
        )
        p.add_argument("--speculative-eagle-topk", type=int, help="1 (chain drafting)")
        p.add_argument("--speculative-num-draft-tokens", type=int, help="verify width (steps + 1)")
        return p

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> ServerArgs:
        return cls(**vars(cls.parser().parse_args(argv))).resolve()
