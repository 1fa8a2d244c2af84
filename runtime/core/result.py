# SPDX-License-Identifier: Apache-2.0
"""`RequestResult`: a request as its caller sees it, finished or part-way (a snapshot).

The engine builds one from its `Req` after a step; the HTTP layer renders it as SGLang's
`/generate` JSON (`meta_info` as in SGLang's `tokenizer_manager.py`) or as OpenAI objects.
It is immutable, so the engine loop thread can hand it to the event loop without copies.
Like mini-sglang's `core.py`, these are plain types with no runtime logic behind them.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.core.request import FinishReason

TokenLogprob = tuple[float, int]  # (logprob, token id), SGLang's order without the text


TokenLogprobList = tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Logprobs:
    """Log probabilities a request asked for (`return_logprob`, `top_logprobs_num`,
    `token_ids_logprob`, `logprob_start_len`); prompt entries run from `logprob_start_len`
    and are None where nothing scores the token (the prompt's first)."""

    input_token_logprobs: tuple[tuple[float | None, int], ...]  # prompt from logprob_start_len
    output_token_logprobs: tuple[TokenLogprob, ...]
    output_top_logprobs: tuple[TokenLogprobList, ...]  # empty unless top_logprobs_num
    top_logprobs_num: int = 0
    input_top_logprobs: tuple[TokenLogprobList | None, ...] = ()
    token_ids_logprob: tuple[int, ...] | None = None
    input_token_ids_logprobs: tuple[TokenLogprobList | None, ...] = ()
    output_token_ids_logprobs: tuple[TokenLogprobList, ...] = ()
    with_text: bool = False  # the request asked for each token's text (return_text_in_logprobs)


@dataclass(frozen=True)
class SpecCounters:
    """Speculative decoding counters of one request (SGLang's `spec_verify_ct` & co.).

    A request's first token comes from its prefill; every later one from either a verify
    round or a decode step the speculation policy ran plainly. `accept_length` is over the
    rounds alone: sum over rounds of (drafts accepted + 1) / rounds, the tokens a round
    yields before a stop cuts it, so `1 <= accept_length <= num_steps + 1`; None before the
    first round. `plain_decode_tokens` counts the tokens of the plain steps.
    """

    verify_rounds: int
    accept_length: float | None
    accept_histogram: tuple[int, ...]  # [m]: rounds that accepted m drafts
    plain_decode_tokens: int = 0


@dataclass(frozen=True)
class RequestTiming:
    """`time.perf_counter()` readings; `e2e_latency` runs to `finished_at` or the snapshot."""

    created_at: float
    first_token_at: float | None
    finished_at: float | None
    e2e_latency: float


@dataclass(frozen=True)
class RequestResult:
    rid: str
    output_ids: tuple[int, ...]
    text: str | None  # None without a tokenizer; while running, a possible stop is held back
    finish_reason: FinishReason | None  # None while running
    prompt_tokens: int
    completion_tokens: int
    timing: RequestTiming
    cached_tokens: int = 0
    logprobs: Logprobs | None = None  # None unless the request asked for logprobs
    spec: SpecCounters | None = None  # None when speculative decoding is off

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def aborted(self) -> bool:
        return self.finish_reason is not None and self.finish_reason.type == "abort"
