# SPDX-License-Identifier: Apache-2.0
"""`Req`: one generation request as the scheduler tracks it, with its finish logic."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from runtime.core.sampling_params import SamplingParams
from runtime.core.stop_strings import StopStrings

if TYPE_CHECKING:
    import torch


class Detokenizer(Protocol):
    """Turns a request's tokens into text as they arrive (the scheduler's
    `IncrementalDetokenizer`)."""

    text: str

    def add(self, token: int) -> str: ...

    def flush(self) -> str: ...


class GrammarState(Protocol):
    """A request's structured-output matcher (`runtime.constrained.RequestGrammar`): it
    follows the committed output token by token."""

    def accept(self, token: int) -> bool: ...

    def is_terminated(self) -> bool: ...


@dataclass(frozen=True)
class OwedDraftRows:
    """Target rows an MTP draft has not run over yet, at positions `start ..`: row `p` is the
    target's hidden state at `p` (`hidden[p - start]`) followed by the token at `p + 1`
    (`following[p - start]`). Where a speculative worker skipped the draft (speculation off
    in large batches), a snapshot of the request's state (taken when it finishes, or after a
    prefill chunk) keeps them instead of a draft pass then; a request that resumes from that
    state takes them back, and the draft runs over them before it first proposes for it."""

    start: int
    hidden: torch.Tensor  # [n, D]
    following: tuple[int, ...]

    def copy(self) -> OwedDraftRows:
        """Rows of its own (a snapshot's are a view of a buffer the slot's next state reuses)."""
        return OwedDraftRows(self.start, self.hidden.clone(), self.following)


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_json(self) -> dict:
        out: dict = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message
        return out


@dataclass
class Req:
    rid: str
    prompt_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # first prompt position to return logprobs for; -1 = none
    token_ids_logprob: list[int] | None = None  # ids whose logprobs every position reports
    return_text_in_logprobs: bool = False
    detokenizer: Detokenizer | None = None
    grammar: GrammarState | None = None  # structured output (json_schema / regex / ebnf)
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    num_cached: int = 0  # tokens of `all_ids` whose KV is in the cache
    cached_tokens: int = 0  # prompt tokens the prefix cache served when it was admitted
    finish_reason: FinishReason | None = None
    created_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    num_retractions: int = 0
    # text and stop-string state (with a detokenizer)
    text: str = ""
    # logprobs: (logprob, token id) per output token, its top list and its `token_ids_logprob`
    # list; the same per prompt token from `logprob_start_len` (None where nothing scores it)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_logprobs_done: bool = False
    # speculative decoding: next round's draft tokens and acceptance counters
    draft_tokens: list[int] | None = None
    spec_verify_ct: int = 0
    spec_accept_hist: list[int] = field(default_factory=list)  # [m]: rounds that accepted m drafts
    spec_plain_decode_tokens: int = 0  # tokens of decode steps that ran without speculation
    # rows the draft owes the cached state this request finished with, or resumed from
    owed_draft_rows: OwedDraftRows | None = None
    parent_rid: str | None = None  # the client's request id when this is one of its n choices
    # the compiled stop strings (`Engine.make_request` builds them off the engine thread)
    stop_matcher: StopStrings | None = field(default=None, repr=False)
    # the logprob lists as the last snapshot froze them (`engine.results`)
    snapshot_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_decoding(self) -> bool:
        """Everything but the newest token is cached: the next step is a decode step."""
        return bool(self.output_ids) and self.num_cached == self.seq_len - 1

    def record_verify_round(self, num_accepted: int, num_drafts: int) -> None:
        """Count one speculative verify round that accepted `num_accepted` of `num_drafts`."""
        if not self.spec_accept_hist:
            self.spec_accept_hist = [0] * (num_drafts + 1)
        self.spec_accept_hist[num_accepted] += 1
        self.spec_verify_ct += 1

    def finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.finished_at = time.perf_counter()
        stopped_by_string = reason.type == "stop" and isinstance(reason.matched, str)
        if self.detokenizer is not None and not stopped_by_string:
            self.detokenizer.flush()
            self.text = self.detokenizer.text

    def abort(self, message: str) -> None:
        if not self.finished:
            self.finish(FinishReason("abort", message=message))

    def append_token(self, token: int, eos_ids: set[int]) -> bool:
        """Add a generated token, advance the grammar (if any) and run the finish checks in
        order (EOS, stop ids, stop strings, a completed grammar, then the length cap).
        Returns True when the request finished."""
        self.output_ids.append(token)
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if self.grammar is not None and not self.grammar.accept(token):
            self.finish(FinishReason("abort", message=f"token {token} breaks the grammar"))
            return True
        delta = ""
        if self.detokenizer is not None:
            delta = self.detokenizer.add(token)
            self.text = self.detokenizer.text
        params, produced = self.sampling_params, len(self.output_ids)
        if produced >= params.min_new_tokens:
            if not params.ignore_eos and token in eos_ids:
                self.finish(FinishReason("stop", matched=token))
            elif params.stop_token_ids and token in params.stop_token_ids:
                self.finish(FinishReason("stop", matched=token))
            elif params.stop_strings and self.detokenizer is not None:
                self._check_stop_strings(len(delta))
        if not self.finished and self.grammar is not None and self.grammar.is_terminated():
            self.finish(FinishReason("stop", matched=token))  # the grammar is complete
        if not self.finished and produced >= params.max_new_tokens:
            self.finish(FinishReason("length", length=produced))
        return self.finished

    def _stops(self) -> StopStrings:
        if self.stop_matcher is None:
            self.stop_matcher = StopStrings.of(tuple(self.sampling_params.stop_strings))
        return self.stop_matcher

    def _check_stop_strings(self, delta_len: int) -> None:
        """A stop string starting in the window the new text can complete (the longest
        string's length before it): the earliest one, the shortest at that place."""
        stops = self._stops()
        start = max(0, len(self.text) - delta_len - stops.longest + 1)
        hit = stops.find(self.text, start)
        if hit is None:
            return
        index, stop = hit
        keep = index + len(stop) if self.sampling_params.no_stop_trim else index
        self.text = self.text[:keep]
        self.finish(FinishReason("stop", matched=stop))

    def visible_text(self) -> str:
        """Text safe to stream: while running, a tail that could begin a stop string is held."""
        if self.finished or not self.sampling_params.stop_strings:
            return self.text
        return self.text[: len(self.text) - self._stops().held(self.text)]
