# SPDX-License-Identifier: Apache-2.0
"""Continuous batching: admit, prefill in chunks, decode, retract, abort, finish.

Each `step()` runs one worker step over the running requests:

* admission moves waiting requests in (FCFS) while request slots, `max_running_requests`
  and token pages allow; a request's whole prompt is reserved when it is admitted.
* prefill requests contribute chunks, together at most `chunked_prefill_size` tokens a
  step; the chunk that reaches the end of the prompt samples the first token.
* decoding requests contribute their newest token (or one speculative round). A worker
  that `supports_mixed` runs chunks and decode rows in one forward; otherwise prefill
  steps and decode steps alternate so neither starves.
* when token pages run out for a decode, the most recently admitted request is retracted:
  its pages are freed and it is re-queued to be recomputed from prompt + output so far.

Finish checks run per emitted token, in order, so nothing after a stop leaks out.
"""

from __future__ import annotations

import logging
from collections import deque

from runtime.cache.slot_table import SlotTable
from runtime.core.request import FinishReason, Req
from runtime.core.step_io import Chunk, TokenOutput

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        worker,
        slot_table: SlotTable,
        eos_ids: set[int],
        max_running_requests: int,
        chunked_prefill_size: int | None = None,
    ):
        self.worker, self.slot_table = worker, slot_table
        self.eos_ids = eos_ids
        self.max_running_requests = max_running_requests
        self.chunk_budget = (
            chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None
        )
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._last_step_prefilled = False
        self.num_retractions = 0

    # queue --------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, rid: str, message: str = "aborted by the client") -> Req | None:
        """Stop a waiting or running request and free everything it holds."""
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.abort(message)
                return req
        for req in self.running:
            if req.rid == rid:
                self._release(req)
                req.abort(message)
                return req
        return None

    # one step -----------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one worker step; returns the requests that got tokens or finished in it."""
        touched = self._admit()
        touched += self._ensure_decode_slots()
        prefill = self._plan_prefill()
        decode = [r for r in self.running if r.is_decoding]
        if prefill and decode and not self.worker.supports_mixed:
            if self._last_step_prefilled:
                prefill = []
            else:
                decode = []
        if not prefill and not decode:
            return touched
        self._last_step_prefilled = bool(prefill)
        prefill_out, decode_out = self.worker.step(prefill, decode)
        return (
            touched
            + self._commit_prefill(prefill, prefill_out)
            + self._commit_decode(decode, decode_out)
        )

    def _needed(self, req: Req) -> int:
        return req.seq_len + self.worker.reserve_ahead()

    def _admit(self) -> list[Req]:
        rejected: list[Req] = []
        while self.waiting and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            idx = self.slot_table.open_request()
            if idx is None:
                break
            # keep a page of headroom per running request so they can keep decoding
            headroom = len(self.running) * self.slot_table.page_size
            fits = (
                self.slot_table.allocator.available_tokens() >= self._needed(req) + headroom
                or not self.running
            )
            if not fits or not self.slot_table.reserve(idx, self._needed(req)):
                self.slot_table.release(idx)
                if not self.running:
                    self.waiting.popleft()
                    req.finish(
                        FinishReason(
                            "abort",
                            message=f"the request needs {self._needed(req)} tokens of KV cache but "
                            f"the pool holds {self.slot_table.allocator.capacity_tokens}; raise "
                            "--max-total-tokens or shorten the prompt",
                        )
                    )
                    rejected.append(req)
                    continue
                break
            self.waiting.popleft()
            req.req_pool_idx, req.num_cached = idx, 0
            self.running.append(req)
        return rejected

    def _plan_prefill(self) -> list[Chunk]:
        budget = self.chunk_budget
        chunks = []
        for req in self.running:
            if req.is_decoding:
                continue
            remaining = req.seq_len - req.num_cached
            size = remaining if budget is None else min(remaining, budget)
            if size <= 0:
                break
            chunks.append(Chunk(req, req.num_cached, req.num_cached + size))
            if budget is not None:
                budget -= size
        return chunks

    def _ensure_decode_slots(self) -> list[Req]:
        """Every decoding request needs slots for its next step: retract the newest
        requests until they fit (a lone request that cannot fit is aborted)."""
        while True:
            decode = [r for r in self.running if r.is_decoding]
            if all(self.slot_table.reserve(r.req_pool_idx, self._needed(r)) for r in decode):
                return []
            victim = self.running[-1]
            self._release(victim)
            if not self.running:
                victim.abort(
                    "out of KV cache: this request alone needs more tokens than the pool "
                    "holds; raise --max-total-tokens or lower max_new_tokens"
                )
                return [victim]
            victim.num_cached, victim.draft_tokens = 0, None
            victim.num_retractions += 1
            self.num_retractions += 1
            self.waiting.appendleft(victim)
            logger.info(
                "retracted request %s (%d tokens) to free KV cache", victim.rid, victim.seq_len
            )

    def _release(self, req: Req) -> None:
        self.running.remove(req)
        self.slot_table.release(req.req_pool_idx)
        req.req_pool_idx = None

    # results ------------------------------------------------------------------------------
    def _commit_prefill(self, chunks: list[Chunk], outputs: list[TokenOutput]) -> list[Req]:
        touched = []
        for chunk, out in zip(chunks, outputs):
            req = chunk.req
            if out.input_logprobs:
                req.input_token_logprobs += [
                    (lp, req.prompt_ids[pos]) for pos, lp in out.input_logprobs
                ]
                req.input_top_logprobs += out.input_top_logprobs or []
                req.input_token_ids_logprobs += out.input_token_ids_logprobs or []
            req.num_cached = chunk.end
            if chunk.end >= len(req.prompt_ids):
                req.input_logprobs_done = True
            self._store_speculation(req, out)
            if chunk.completes and req.sampling_params.max_new_tokens == 0:
                # a scoring request (prompt logprobs only): its prefill is all it wanted
                req.finish(FinishReason("length", length=0))
                self._release(req)
                touched.append(req)
            elif out.tokens:
                self._append(req, out)
                touched.append(req)
        return touched

    def _commit_decode(self, reqs: list[Req], outputs: list[TokenOutput]) -> list[Req]:
        for req, out in zip(reqs, outputs):
            self._store_speculation(req, out)
            self._append(req, out)
        return list(reqs)

    @staticmethod
    def _store_speculation(req: Req, out: TokenOutput) -> None:
        """A speculative worker's round counters and the drafts for the next round."""
        if out.num_accepted_drafts is not None:
            req.record_verify_round(out.num_accepted_drafts, len(req.draft_tokens))
        if out.draft_tokens is not None:
            req.draft_tokens = out.draft_tokens

    def _append(self, req: Req, out: TokenOutput) -> None:
        for i, token in enumerate(out.tokens):
            if out.logprobs is not None:
                req.output_token_logprobs.append((out.logprobs[i], token))
                if out.top_logprobs is not None:
                    req.output_top_logprobs.append(out.top_logprobs[i])
            if out.token_ids_logprobs is not None:
                req.output_token_ids_logprobs.append(out.token_ids_logprobs[i])
            if req.append_token(token, self.eos_ids):
                break
        req.num_cached = req.seq_len - 1  # the newest token is not in the cache yet
        if req.finished:
            self._release(req)
