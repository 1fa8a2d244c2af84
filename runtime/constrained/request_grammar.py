# SPDX-License-Identifier: Apache-2.0
"""`RequestGrammar`: one request's xgrammar `GrammarMatcher`."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RequestGrammar:
    """The grammar state after the request's committed output. `Req.append_token` calls
    `accept` for every committed token; workers read it (`fill_next`) and may walk it over
    tentative tokens, always rolling back before the step ends (`walk` / `rollback`)."""

    def __init__(self, matcher, key: tuple[str, str]):
        self.matcher = matcher
        self.key = key  # (kind, source): what it was compiled from

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(int(token)))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill_next(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` = the tokens the grammar allows next (all tokens once it
        has terminated: nothing follows a finished request, and the row must not be empty)."""
        if self.matcher.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def walk(self, tokens: Sequence[int]) -> int:
        """Accept `tokens` tentatively, stopping at the first one the grammar refuses or
        after it terminates; returns how many were accepted (undo with `rollback`)."""
        taken = 0
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
                break
            taken += 1
        return taken

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)
