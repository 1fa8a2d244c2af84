# SPDX-License-Identifier: Apache-2.0
"""Token bitmasks for a step: prepared on the host before the forward, applied to the
logits after it (xgrammar's `apply_token_bitmask_inplace`, which picks its CPU, CUDA or
Triton kernel by device).

A bitmask is `[rows, ceil(vocab / 32)]` int32 with bit `t % 32` of word `t // 32` set when
token t is allowed; rows of requests without a grammar allow everything (-1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.constrained.request_grammar import RequestGrammar


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    """All tokens allowed in every row."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def next_token_bitmask(
    grammars: Sequence[RequestGrammar | None], vocab_size: int
) -> torch.Tensor | None:
    """One row per sampled row (`grammars[i]` owns row i): what each grammar allows next.
    None when no row has a grammar (nothing to apply)."""
    if all(g is None for g in grammars):
        return None
    bitmask = allocate(len(grammars), vocab_size)
    for row, grammar in enumerate(grammars):
        if grammar is not None:
            grammar.fill_next(bitmask, row)
    return bitmask


def verify_bitmask(
    grammars: Sequence[RequestGrammar | None], drafts: Sequence[Sequence[int]], vocab_size: int
) -> torch.Tensor | None:
    """`len(drafts[b]) + 1` rows per request, as a speculative verify scores them: row j is
    masked by the grammar state after drafts d1..dj. Each grammar walks over its drafts
    tentatively and rolls back, so it ends where it started. Rows past the first draft the
    grammar refuses allow everything: that draft is rejected at its row (the target's masked
    distribution gives it no mass), so nothing later is emitted."""
    if all(g is None for g in grammars):
        return None
    width = len(drafts[0]) + 1
    bitmask = allocate(len(grammars) * width, vocab_size)
    for b, (grammar, proposal) in enumerate(zip(grammars, drafts)):
        if grammar is None:
            continue
        grammar.fill_next(bitmask, b * width)
        walked = 0
        for j, token in enumerate(proposal, start=1):
            if grammar.walk([token]) == 0:
                break
            walked += 1
            grammar.fill_next(bitmask, b * width + j)
        grammar.rollback(walked)
    return bitmask


def apply(
    logits: torch.Tensor, bitmask: torch.Tensor | None, unadjusted: torch.Tensor | None = None
) -> torch.Tensor:
    """`logits [R, V]` with disallowed tokens at -inf, as a new float tensor (the input keeps
    the values logprobs are read from). `unadjusted`: the same rows before penalties; a row
    the mask and the penalties leave without any finite logit (a grammar that only allows EOS
    while `min_new_tokens` still bans it) takes the grammar's choice over those instead, so
    no row ever samples from nothing."""
    if bitmask is None:
        return logits
    masked = _masked(logits, bitmask)
    if unadjusted is not None and unadjusted is not logits:
        dead = torch.isneginf(masked).all(dim=-1)
        if bool(dead.any()):
            masked[dead] = _masked(unadjusted, bitmask)[dead]
    return masked


def _masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    from xgrammar import apply_token_bitmask_inplace

    masked = logits.float().clone()
    apply_token_bitmask_inplace(
        masked, bitmask.to(masked.device, non_blocking=True), vocab_size=masked.shape[-1]
    )
    return masked
