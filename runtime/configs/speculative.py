# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding settings, resolved once from the user's flags."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from runtime.configs.token_map import AUTO, NONE, load_token_map, resolve_token_map

logger = logging.getLogger(__name__)

ALGORITHM_ALIASES = {"NEXTN": "NEXTN", "MTP": "NEXTN", "EAGLE": "NEXTN"}
# the defaults of `--speculative-num-steps` and `--speculative-eagle-topk`, written only
# here: the flags' help (`EngineConfig`, the benchmarks' flags) quotes them
DEFAULT_NUM_STEPS = 3
DEFAULT_EAGLE_TOPK = 1  # chain drafting, the only kind implemented


@dataclass(frozen=True)
class SpeculativeConfig:
    algorithm: str  # "NEXTN"
    num_steps: int  # draft forwards per round (S)
    eagle_topk: int  # 1: chain drafting
    num_draft_tokens: int  # verify width N = S + 1
    # a decode step of at least this many requests runs without speculation (vLLM's
    # `speculative_disable_by_batch_size`); None: every step speculates, unless `measured`
    disable_by_batch_size: int | None = None
    # `auto`: each captured batch bucket speculates while its measured rounds yield tokens
    # faster than plain decode steps (`speculation_policy.MeasuredSpeculation`)
    measured: bool = False
    # the draft's LM head scores only these ids (FR-Spec, SGLang's `--speculative-token-map`),
    # read from the file `token_map`; None: the whole vocabulary
    token_map: str | None = None
    hot_token_ids: tuple[int, ...] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def resolve(
        cls,
        algorithm: str | None,
        num_steps: int | None = None,
        eagle_topk: int | None = None,
        num_draft_tokens: int | None = None,
        disable_by_batch_size: int | str | None = None,
        token_map: str | None = None,
        model_path: str | Path | None = None,
    ) -> SpeculativeConfig | None:
        """None when speculation is off. Raises ValueError with the fix for bad settings.
        `disable_by_batch_size`: a batch size, `auto` (measured) or None / `none` (always
        speculate). `token_map`: a table file, `auto` or None (the table the checkpoint at
        `model_path` names, if any) or `none` (the whole vocabulary; `resolve_token_map`)."""
        limit, measured = parse_disable_by_batch_size(disable_by_batch_size)
        chosen = token_map is not None and str(token_map).strip().lower() not in (AUTO, NONE)
        if algorithm is None or str(algorithm).upper() in ("", "NONE"):
            shape = (num_steps, eagle_topk, num_draft_tokens, limit, token_map if chosen else None)
            if any(v is not None for v in shape):
                raise ValueError("speculative options need --speculative-algorithm NEXTN")
            return None
        name = ALGORITHM_ALIASES.get(str(algorithm).upper())
        if name is None:
            raise ValueError(
                f"unknown --speculative-algorithm '{algorithm}'; supported: NEXTN "
                "(aliases MTP, EAGLE)"
            )
        steps = DEFAULT_NUM_STEPS if num_steps is None else int(num_steps)
        if steps < 1:
            raise ValueError(f"--speculative-num-steps must be >= 1, got {steps}")
        topk = DEFAULT_EAGLE_TOPK if eagle_topk is None else int(eagle_topk)
        if topk != 1:
            raise ValueError(
                f"--speculative-eagle-topk {topk} is not supported: only chain drafting "
                "(topk 1) is implemented; tree drafting is not. Use --speculative-eagle-topk 1."
            )
        tokens = steps + 1
        if num_draft_tokens is not None and int(num_draft_tokens) != tokens:
            logger.warning(
                "--speculative-num-draft-tokens %s does not match chain drafting with %d "
                "steps; using %d (steps + 1)",
                num_draft_tokens,
                steps,
                tokens,
            )
        token_map = resolve_token_map(token_map, model_path)
        if token_map is None:
            return cls(name, steps, topk, tokens, limit, measured)
        return cls(
            name, steps, topk, tokens, limit, measured, str(token_map), load_token_map(token_map)
        )

    def describe_limit(self) -> str | None:
        """`auto`, the batch size from which decode steps run plainly, or None (always)."""
        return "auto" if self.measured else self.disable_by_batch_size


def parse_disable_by_batch_size(value: int | str | None) -> tuple[int | None, bool]:
    """(limit, measured) of `--speculative-disable-by-batch-size`: a batch size >= 1, `auto`
    or `none`. ValueError names the flag."""
    if value is None or str(value).strip().lower() == "none":
        return None, False
    if str(value).strip().lower() == "auto":
        return None, True
    try:
        limit = int(value)
    except (TypeError, ValueError):
        limit = 0
    if limit < 1 or str(limit) != str(value).strip():
        raise ValueError(
            "--speculative-disable-by-batch-size must be a batch size >= 1 (a decode step of "
            "at least that many requests runs without speculation), 'auto' (measured per "
            f"batch bucket) or 'none' (always speculate), got {value!r}"
        )
    return limit, False
