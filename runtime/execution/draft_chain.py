# SPDX-License-Identifier: Apache-2.0
"""The draft chain, written once: from the draft's first prediction (the logits and hidden
state of each request's gather row), `num_steps - 1` single-token steps, each fed the
previous step's token and hidden state (SGLang's EAGLE `topk = 1` chain, gpt-fast's
`speculative_decode` draft loop).

Three callers run it: the eager drafter (`speculative/drafter.py`, which may pick under a
grammar), the captured draft round (`GraphRunner.try_draft_round`) and the fused NEXTN round
(`speculative/captured_round.py`). Each hands in its own `step(i, tokens, hidden)`, the draft
forward of chained step `i` (how it builds the step's context is its own business). The
chain itself has fixed shapes and no host sync (a Python loop over a fixed count, `pick` a
tensor op), so captured callers trace it whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.core.model_output import LogitsProcessorOutput

ChainStep = Callable[[int, torch.Tensor, torch.Tensor], LogitsProcessorOutput]


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """Each row's draft token: the argmax of its logits."""
    return logits.argmax(-1)


def draft_chain(
    first_logits: torch.Tensor,
    first_hidden: torch.Tensor,
    num_steps: int,
    step: ChainStep,
    pick: Callable[[torch.Tensor], torch.Tensor] = greedy_pick,
) -> torch.Tensor:
    """Draft tokens `[k, num_steps]` of `k` requests: the first picked from `first_logits`
    `[k, V]`, each later one from `step(i, tokens, hidden)` (`i` in `1 .. num_steps - 1`)
    fed the previous token `[k]` and hidden state (`first_hidden` `[k, D]` for step 1)."""
    tokens, hidden = pick(first_logits), first_hidden
    drafts = [tokens]
    for i in range(1, num_steps):
        out = step(i, tokens, hidden)
        tokens, hidden = pick(out.next_token_logits), out.hidden_states
        drafts.append(tokens)
    return torch.stack(drafts, dim=1)
