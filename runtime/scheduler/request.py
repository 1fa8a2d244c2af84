# SPDX-License-Identifier: Apache-2.0
"""`Req`: one generation request as the scheduler tracks it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from runtime.engine.sampling_params import SamplingParams


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
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    num_cached: int = 0  # tokens of `all_ids` whose KV is in the cache
    finish_reason: FinishReason | None = None
    created_at: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None
    num_retractions: int = 0
    # speculative decoding: next round's draft tokens and acceptance counters
    draft_tokens: list[int] = field(default_factory=list)
    spec_verify_ct: int = 0
    spec_accept_hist: list[int] = field(default_factory=list)  # [m]: rounds that accepted m drafts

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def check_finish(self, token: int, eos_ids: set[int]) -> bool:
        """Finish checks for a just-appended `token`, in SGLang's order; sets the reason."""
        params, produced = self.sampling_params, len(self.output_ids)
        if produced >= params.min_new_tokens:
            if not params.ignore_eos and token in eos_ids:
                self.finish_reason = FinishReason("stop", matched=token)
            elif params.stop_token_ids and token in params.stop_token_ids:
                self.finish_reason = FinishReason("stop", matched=token)
        if self.finish_reason is None and produced >= params.max_new_tokens:
            self.finish_reason = FinishReason("length", length=produced)
        if self.finish_reason is not None:
            self.finished_at = time.perf_counter()
        return self.finished
