# SPDX-License-Identifier: Apache-2.0
"""`DraftBatch`: what the MTP draft reads for one drafting pass.

Per request b the batch holds a run of target rows at positions
`prefix_lens[b] .. prefix_lens[b] + extend_lens[b] - 1` (the rows the target just ran: a
prefill chunk, or the `S + 1` rows of a verify round), the token that follows each row and
the target's captured hidden state of each row. The MTP layer at position p reads the
target's state at p and the token at p + 1 (TokenSpeed's `deepseek_nextn.py`, vLLM's
`qwen3_next_mtp.py`), so the draft runs over every row to fill its own cache and proposes
from `gather_rows[b]`, the row whose successor is the newest committed token.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.constrained.bitmask import DraftWalk
from runtime.core.request import Req
from runtime.core.step_io import Chunk, TokenOutput


@dataclass
class DraftBatch:
    reqs: Sequence[Req]  # [bs]
    prefix_lens: list[int]  # [bs] position of each request's first row
    extend_lens: list[int]  # [bs] rows of each request; T = sum(extend_lens)
    next_tokens: torch.Tensor  # [T] the token that follows each row
    target_hidden: torch.Tensor  # [T, D] the target's captured hidden state of each row
    gather_rows: list[int]  # [bs] row (within the request) to draft from
    propose: list[bool]  # [bs] False: only fill the draft's cache (a prefill chunk mid-prompt)
    # [bs] tokens this step emits that the request's grammar has not seen yet (drafting under
    # a grammar starts from the state after them); None: no request has a grammar
    pending_tokens: list[list[int]] | None = None
    # which rows of the target's latest output `target_hidden` holds (None: all of them), so
    # the other ranks of a replica can take them from their own copy
    target_rows: torch.Tensor | None = None
    # False: `target_hidden` was gathered over earlier steps (rows a request decoded without
    # speculation), so the other ranks of a replica receive the tensor itself
    from_latest_target: bool = True

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def req_pool_indices(self) -> list[int]:
        return [r.req_pool_idx for r in self.reqs]

    def row_starts(self) -> list[int]:
        """[bs] index in `[T]` of each request's first row."""
        return [0, *itertools.accumulate(self.extend_lens)][:-1]

    def gather_indices(self) -> list[int]:
        """[bs] index in `[T]` of each request's gather row."""
        return [s + g for s, g in zip(self.row_starts(), self.gather_rows)]

    def has_grammar(self, keep: Sequence[int]) -> bool:
        """Whether any of the requests `keep` drafts under a grammar."""
        return self.pending_tokens is not None and any(
            self.reqs[b].grammar is not None for b in keep
        )

    def grammar_walk(self, keep: Sequence[int], vocab_size: int) -> DraftWalk | None:
        """A tentative walk of the proposing requests' grammars (see `DraftWalk`), or None
        when none of them has a grammar."""
        if not self.has_grammar(keep):
            return None
        return DraftWalk(
            [self.reqs[b].grammar for b in keep],
            [self.pending_tokens[b] for b in keep],
            vocab_size,
        )

    def proposing(self) -> list[int]:
        """Batch indices of the requests that want proposals."""
        return [b for b, wanted in enumerate(self.propose) if wanted]

    def first_chain_position(self, b: int) -> int:
        """Position of request b's first chained draft step: just past its newest token."""
        return self.prefix_lens[b] + self.gather_rows[b] + 1

    def drop_leading_rows(self, skip: Sequence[int]) -> DraftBatch:
        """The batch without the first `skip[b]` rows of each request (its positions start
        later; its gather row is the same row)."""
        if not any(skip):
            return self
        kept = torch.cat(
            [
                torch.arange(start + k, start + n)
                for start, k, n in zip(self.row_starts(), skip, self.extend_lens)
            ]
        )
        return DraftBatch(
            self.reqs,
            [p + k for p, k in zip(self.prefix_lens, skip)],
            [n - k for n, k in zip(self.extend_lens, skip)],
            self.next_tokens[kept],
            self.target_hidden[kept],
            [g - k for g, k in zip(self.gather_rows, skip)],
            self.propose,
            self.pending_tokens,
            kept if self.target_rows is None else self.target_rows[kept],
            self.from_latest_target,
        )


def following_tokens(chunk: Chunk, output: TokenOutput) -> list[int]:
    """The token after each row of `chunk`: the next prompt token, or for the last row of a
    completing chunk the token just sampled."""
    req = chunk.req
    return req.all_ids[chunk.start + 1 : chunk.end] + (output.tokens or [req.all_ids[chunk.end]])


def chunk_spans(chunks: Sequence[Chunk]) -> list[tuple[int, int]]:
    """Each chunk's rows `[begin, end)` in the step's `[sum len, D]`."""
    spans, end = [], 0
    for c in chunks:
        spans.append((end, end + c.length))
        end += c.length
    return spans
