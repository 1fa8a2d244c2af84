# SPDX-License-Identifier: Apache-2.0
"""Per-request sampling parameters, with SGLang's names and defaults."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from runtime.core.errors import InvalidRequestError

# Seeds are 64-bit signed integers (torch.long, as vLLM's `seed` field); choice k of an
# `n > 1` request samples with `sampling_seed + k`, so every one of those must fit too.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = all tokens
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    sampling_seed: int | None = None
    no_stop_trim: bool = False
    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, params: dict | SamplingParams | None) -> SamplingParams:
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, dict):
            raise InvalidRequestError(
                f"sampling_params must be an object, got {type(params).__name__}"
            )
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}"
            )
        out = cls(**{k: v for k, v in params.items() if k in known})
        out.normalize()
        return out

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def normalize(self) -> None:
        """Check types and ranges; raises `InvalidRequestError` saying what to fix."""

        def need(ok: bool, message: str, param: str) -> None:
            if not ok:
                raise InvalidRequestError(message, param=param)

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            value = getattr(self, name)
            need(is_int(value), f"{name} must be an integer, got {value!r}", name)
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            need(
                isinstance(value, (int, float)) and not isinstance(value, bool),
                f"{name} must be a number, got {value!r}",
                name,
            )
            need(math.isfinite(value), f"{name} must be finite, got {value!r}", name)
            setattr(self, name, float(value))
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
            value = getattr(self, name)
            need(isinstance(value, bool), f"{name} must be true or false, got {value!r}", name)
        need(
            isinstance(self.no_stop_trim, bool),
            f"no_stop_trim must be true or false, got {self.no_stop_trim!r}",
            "no_stop_trim",
        )
        need(
            self.max_new_tokens >= 0,
            f"max_new_tokens must be >= 0, got {self.max_new_tokens}",
            "max_new_tokens",
        )
        need(
            0 <= self.min_new_tokens,
            f"min_new_tokens must be >= 0, got {self.min_new_tokens}",
            "min_new_tokens",
        )
        need(
            self.temperature >= 0.0,
            f"temperature must be >= 0, got {self.temperature}",
            "temperature",
        )
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        need(
            self.top_k == -1 or self.top_k >= 1,
            f"top_k must be -1 (off) or >= 1, got {self.top_k}",
            "top_k",
        )
        need(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        need(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            "frequency_penalty",
        )
        need(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            "presence_penalty",
        )
        need(
            0.0 < self.repetition_penalty <= 2.0,
            f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
            "repetition_penalty",
        )
        need(self.n >= 1, f"n must be >= 1, got {self.n}", "n")
        need(
            self.stop is None
            or isinstance(self.stop, str)
            or (isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop)),
            "stop must be a string or a list of strings",
            "stop",
        )
        need(
            self.stop_token_ids is None
            or (
                isinstance(self.stop_token_ids, list)
                and all(is_int(t) and t >= 0 for t in self.stop_token_ids)
            ),
            "stop_token_ids must be a list of token ids (integers >= 0)",
            "stop_token_ids",
        )
        seed = self.sampling_seed
        need(
            seed is None or is_int(seed),
            f"sampling_seed must be an integer, got {seed!r}",
            "sampling_seed",
        )
        if seed is not None:
            need(
                SEED_MIN <= seed and seed + self.n - 1 <= SEED_MAX,
                f"sampling_seed must be a 64-bit signed integer in [{SEED_MIN}, {SEED_MAX}]"
                + (f" and so must sampling_seed + n - 1 (n = {self.n})" if self.n > 1 else "")
                + f", got {seed}",
                "sampling_seed",
            )

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("extra")
        return out
