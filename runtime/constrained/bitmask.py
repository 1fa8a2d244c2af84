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


class DraftWalk:
    """Keeps a chain of draft proposals grammatical: each request's grammar is walked
    tentatively over the tokens of this step that are not committed yet (`pending`), then
    over each draft as it is chosen, and `close` rolls every walk back. A grammar that
    refuses its pending tokens (a request that finishes this step) stops masking."""

    def __init__(
        self,
        grammars: Sequence[RequestGrammar | None],
        pending: Sequence[Sequence[int]],
        vocab_size: int,
    ):
        self.grammars, self.vocab_size = list(grammars), vocab_size
        self.walked = [0 if g is None else g.walk(p) for g, p in zip(self.grammars, pending)]
        self.active = [
            g is not None and w == len(p) for g, w, p in zip(self.grammars, self.walked, pending)
        ]

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy proposals `[k]` from `logits [k, V]` (row i: request i) under each active
        grammar, which then advances over its proposal."""
        rows = [g if on else None for g, on in zip(self.grammars, self.active)]
        tokens = apply(logits, next_token_bitmask(rows, self.vocab_size)).argmax(-1)
        for i, token in enumerate(tokens.tolist()):
            if self.active[i]:
                if self.grammars[i].walk([token]):
                    self.walked[i] += 1
                else:
                    self.active[i] = False
        return tokens

    def close(self) -> None:
        for grammar, walked in zip(self.grammars, self.walked):
            if grammar is not None:
                grammar.rollback(walked)
        self.walked = [0] * len(self.grammars)
