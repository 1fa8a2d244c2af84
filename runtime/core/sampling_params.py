# SPDX-License-Identifier: Apache-2.0
"""Per-request sampling parameters, with SGLang's names and defaults (SGLang's
`sampling/sampling_params.py`).

Every field of SGLang's `SamplingParams` is accepted: those this runtime implements are
fields here; the rest (`UNSUPPORTED_DEFAULTS`) are accepted at their default value (clients
such as SGLang's frontend and sglang-router send them filled in) and refused with a 400
naming the field otherwise. As in SGLang, a null stands for the default, and an empty
grammar or stop list for none.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from runtime.core.errors import InvalidRequestError

# Seeds are 64-bit signed integers (torch.long, as vLLM's `seed` field); choice k of an
# `n > 1` request samples with `sampling_seed + k`, so every one of those must fit too.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

# SGLang sampling parameters this runtime does not implement, with the values that mean
# "not used" (sent that way they are accepted and ignored; anything else is a 400).
UNSUPPORTED_DEFAULTS: dict[str, tuple] = {
    "stop_regex": (None, "", []),
    "structural_tag": (None, ""),
    "beam_width": (None, 1),
    "logit_bias": (None, {}),
    "stream_interval": (None,),
    "custom_params": (None, {}),
    "watermark": (None, {}),
    "ebnf_full_assistant": (None, False),
}
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128  # None: whatever the context leaves (resolved by Engine)
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
    # structured output (at most one): a JSON schema (text), a regular expression, an EBNF
    # grammar (xgrammar's dialect, as in SGLang)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, params: dict | SamplingParams | None) -> SamplingParams:
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, dict):
            raise InvalidRequestError(
                f"sampling_params must be an object, got {type(params).__name__}",
                param="sampling_params",
            )
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(params) - known - set(UNSUPPORTED_DEFAULTS))
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}",
                param=unknown[0],
            )
        for name, defaults in UNSUPPORTED_DEFAULTS.items():
            if name in params and not _is_one_of(params[name], defaults):
                raise InvalidRequestError(
                    f"sampling parameter '{name}' is not supported by this server "
                    f"(send it unset or as {defaults[0]!r})",
                    param=name,
                )
        # null = the default (SGLang's `SamplingParams.__post_init__`), except for
        # max_new_tokens where it means "as many as the context leaves" (`Engine` resolves it)
        out = cls(
            **{
                k: v
                for k, v in params.items()
                if k in known and (v is not None or k == "max_new_tokens")
            }
        )
        out.normalize()
        return out

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, source) of the structured-output constraint, e.g. ("regex", "[0-9]+")."""
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

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
            if name == "max_new_tokens" and value is None:  # as many as the context leaves
                continue
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
            self.max_new_tokens is None or self.max_new_tokens >= 0,
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
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            need(value is None or isinstance(value, str), f"{name} must be a string", name)
            if value == "":
                setattr(self, name, None)  # empty = unset, as in SGLang
        chosen = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        need(
            len(chosen) <= 1,
            f"set at most one of json_schema, regex and ebnf, got {chosen}",
            chosen[-1] if chosen else "json_schema",
        )
        if self.stop_token_ids == []:
            self.stop_token_ids = None

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("extra")
        return out


def _is_one_of(value, defaults: tuple) -> bool:
    """`value == d` for some d, without True == 1 (a bool only matches a bool)."""
    return any(type(value) is type(d) and value == d for d in defaults if d is not None) or (
        value is None and None in defaults
    )
