# SPDX-License-Identifier: Apache-2.0
"""What the scheduler hands a worker for one step, and what comes back (no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.core.request import Req


@dataclass
class TokenOutput:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # of each new token (raw model distribution)
    top_logprobs: list[list[tuple[float, int]]] | None = None
    token_ids_logprobs: list[list[tuple[float, int]]] | None = None  # per new token
    # prompt tokens this step scored: (position, logprob), each with its top and
    # token_ids_logprob lists when asked (None entries for the prompt's first token)
    input_logprobs: list[tuple[int, float | None]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    # speculative decoding
    num_accepted_drafts: int | None = None  # a verify round: drafts accepted (0..S)
    draft_tokens: list[int] | None = None  # the drafts the next verify round checks


def chunk_budget(chunked_prefill_size: int | None) -> int | None:
    """Rows of prompt a step may hold (`--chunked-prefill-size`; None or -1: no bound)."""
    return chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None


@dataclass
class Chunk:
    """One request's share of a step: tokens `all_ids[start:end]`."""

    req: Req
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def completes(self) -> bool:
        """Reaches the newest token, so the step samples what follows."""
        return self.end == self.req.seq_len

    @property
    def resumes(self) -> bool:
        """Ends just before the newest token of a request that has output already: a
        retracted request whose cache is rebuilt. Its next token comes from a decode step
        (a verify round with speculation), as if it had never been retracted."""
        return bool(self.req.output_ids) and self.end == self.req.seq_len - 1
