# SPDX-License-Identifier: Apache-2.0
"""Logit adjustments that depend on a request's history, applied before sampling.

* frequency / presence (OpenAI semantics, output tokens only):
  `logit -= frequency_penalty * count + presence_penalty * (count > 0)`
* repetition (CTRL / HF semantics, prompt and output tokens): positive logits are divided
  by the penalty, negative ones multiplied.
* min_new_tokens: EOS and `stop_token_ids` are banned while fewer tokens were produced.

A row may stand for a tentative continuation (speculative verify row j has drafts
`d1..dj` appended); `extra_tokens` carries them so the row sees exactly the history plain
decoding would have at that position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.core.request import Req


@dataclass(frozen=True)
class RowHistory:
    req: Req
    extra_tokens: tuple[int, ...] = ()


def needs_adjustment(req, eos_ids: set[int]) -> bool:
    p = req.sampling_params
    return (
        p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
        or p.repetition_penalty != 1.0
        or (p.min_new_tokens > len(req.output_ids) and bool(eos_ids or p.stop_token_ids))
    )


def adjust_logits(
    logits: torch.Tensor, rows: Sequence[RowHistory], eos_ids: set[int]
) -> torch.Tensor:
    """Returns adjusted logits `[R, V]` (a copy when anything changes)."""
    todo = [i for i, row in enumerate(rows) if needs_adjustment(row.req, eos_ids)]
    if not todo:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i in todo:  # only requests with penalties pay; each row is one vectorised update
        req, extra = rows[i].req, rows[i].extra_tokens
        p = req.sampling_params
        output = list(req.output_ids) + list(extra)
        row = logits[i]
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            history = torch.tensor(output, dtype=torch.long, device=row.device)
            counts = torch.bincount(history, minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(req.prompt_ids) | set(output)), dtype=torch.long, device=row.device
            )
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if len(output) < p.min_new_tokens:
            banned = set(eos_ids) | set(p.stop_token_ids or [])
            row[torch.tensor(sorted(banned), dtype=torch.long, device=row.device)] = float("-inf")
    return logits
