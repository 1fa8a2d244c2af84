# SPDX-License-Identifier: Apache-2.0
"""Per-request sampling parameters, with SGLang's names and defaults."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from runtime.core.errors import InvalidRequestError


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

        def need(ok: bool, message: str) -> None:
            if not ok:
                raise InvalidRequestError(message)

        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool),
                f"{name} must be an integer, got {value!r}",
            )
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
            )
            setattr(self, name, float(value))
        need(self.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        need(0 <= self.min_new_tokens, f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        need(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        need(
            self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (off) or >= 1, got {self.top_k}"
        )
        need(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        need(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        need(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        need(
            0.0 < self.repetition_penalty <= 2.0,
            f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
        )
        need(self.n >= 1, f"n must be >= 1, got {self.n}")
        need(
            self.stop is None
            or isinstance(self.stop, str)
            or (isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop)),
            "stop must be a string or a list of strings",
        )
        need(
            self.stop_token_ids is None
            or (
                isinstance(self.stop_token_ids, list)
                and all(isinstance(t, int) for t in self.stop_token_ids)
            ),
            "stop_token_ids must be a list of integers",
        )
        need(
            self.sampling_seed is None or isinstance(self.sampling_seed, int),
            f"sampling_seed must be an integer, got {self.sampling_seed!r}",
        )

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("extra")
        return out
