# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding settings, resolved once from the user's flags."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from runtime.configs.token_map import load_token_map

logger = logging.getLogger(__name__)

ALGORITHM_ALIASES = {"NEXTN": "NEXTN", "MTP": "NEXTN", "EAGLE": "NEXTN"}


@dataclass(frozen=True)
class SpeculativeConfig:
    algorithm: str  # "NEXTN"
    num_steps: int  # draft forwards per round (S)
    eagle_topk: int  # 1: chain drafting
    num_draft_tokens: int  # verify width N = S + 1
    # a decode step of at least this many requests runs without speculation (vLLM's
    # `speculative_disable_by_batch_size`); None: every step speculates
    disable_by_batch_size: int | None = None
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
        disable_by_batch_size: int | None = None,
        token_map: str | None = None,
    ) -> SpeculativeConfig | None:
        """None when speculation is off. Raises ValueError with the fix for bad settings."""
        if algorithm is None or str(algorithm).upper() in ("", "NONE"):
            shape = (num_steps, eagle_topk, num_draft_tokens, disable_by_batch_size, token_map)
            if any(v is not None for v in shape):
                raise ValueError("speculative options need --speculative-algorithm NEXTN")
            return None
        name = ALGORITHM_ALIASES.get(str(algorithm).upper())
        if name is None:
            raise ValueError(
                f"unknown --speculative-algorithm '{algorithm}'; supported: NEXTN "
                "(aliases MTP, EAGLE)"
            )
        steps = 3 if num_steps is None else int(num_steps)
        if steps < 1:
            raise ValueError(f"--speculative-num-steps must be >= 1, got {steps}")
        topk = 1 if eagle_topk is None else int(eagle_topk)
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
        if disable_by_batch_size is not None and int(disable_by_batch_size) < 1:
            raise ValueError(
                "--speculative-disable-by-batch-size must be >= 1 (a decode step of at least "
                f"that many requests runs without speculation), got {disable_by_batch_size}"
            )
        limit = None if disable_by_batch_size is None else int(disable_by_batch_size)
        if token_map is None:
            return cls(name, steps, topk, tokens, limit)
        return cls(name, steps, topk, tokens, limit, str(token_map), load_token_map(token_map))
