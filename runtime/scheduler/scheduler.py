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
* when token pages run out for a decode, the prefix cache gives back what it holds first;
  then the most recently admitted request is retracted: its pages are freed (its state goes
  to the prefix cache) and it is re-queued to be recomputed from prompt + output so far.
* the prefix cache (`runtime.cache.prefix_cache`) is consulted through a small interface:
  match at admission, cache after prefill chunks that end at its snapshot points and when a
  request finishes or is retracted, make room under pressure.

Finish checks run per emitted token, in order, so nothing after a stop leaks out.
"""

from __future__ import annotations

import logging
from collections import deque

from runtime.cache.prefix_cache import Admission, PrefixCache
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
        prefix_cache: PrefixCache | None = None,
    ):
        self.worker, self.slot_table = worker, slot_table
        self.prefix_cache = prefix_cache or PrefixCache(slot_table)
        # a speculative worker decodes a request only once it has drafts for it
        self._needs_drafts = bool(getattr(worker, "needs_drafts", False))
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
        decode = [r for r in self.running if self._decodes(r)]
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

    def _decodes(self, req: Req) -> bool:
        """The request's next step is a decode step (a request resumed from the prefix cache
        right at its newest token still runs it as a prefill chunk to get its drafts)."""
        return req.is_decoding and (not self._needs_drafts or req.draft_tokens is not None)

    def _admit(self) -> list[Req]:
        rejected: list[Req] = []
        while self.waiting and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            if self.prefix_cache.waits_for_prefix(req, self.running):
                break
            # keep a page of headroom per running request so they can keep decoding
            headroom = len(self.running) * self.slot_table.page_size
            admission = self.prefix_cache.admit(
                req, self._needed(req), headroom, alone=not self.running
            )
            if admission is Admission.NO_REQUEST_SLOT:
                break
            if admission is Admission.NO_ROOM:
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
            self.running.append(req)
        return rejected

    def _plan_prefill(self) -> list[Chunk]:
        budget = self.chunk_budget
        chunks = []
        for req in self.running:
            if self._decodes(req):
                continue
            remaining = req.seq_len - req.num_cached
            size = remaining if budget is None else min(remaining, budget)
            if size <= 0:
                break
            end = self.prefix_cache.chunk_end(req, req.num_cached, req.num_cached + size)
            size = end - req.num_cached
            chunks.append(Chunk(req, req.num_cached, end))
            if budget is not None:
                budget -= size
        return chunks

    def _ensure_decode_slots(self) -> list[Req]:
        """Every decoding request needs slots for its next step: retract the newest
        requests until they fit (a lone request that cannot fit is aborted)."""
        while True:
            decode = [r for r in self.running if self._decodes(r)]
            if all(self.slot_table.reserve(r.req_pool_idx, self._needed(r)) for r in decode):
                return []
            short = sum(
                self.slot_table.pages_needed(r.req_pool_idx, self._needed(r)) for r in decode
            )
            short -= self.slot_table.allocator.available_pages()
            if short > 0 and self.prefix_cache.make_room(short) >= short:
                continue
            victim = self.running[-1]
            self._release(victim, keep_state=True)
            if not self.running:
                victim.abort(
                    "out of KV cache: this request alone needs more tokens than the pool "
                    "holds; raise --max-total-tokens or lower max_new_tokens"
                )
                return [victim]
            victim.num_cached = 0  # its drafts stay: valid if it resumes at its newest token
            victim.num_retractions += 1
            self.num_retractions += 1
            self.waiting.appendleft(victim)
            logger.info(
                "retracted request %s (%d tokens) to free KV cache", victim.rid, victim.seq_len
            )

    def _release(self, req: Req, keep_state: bool = False, verify_row: int | None = None) -> None:
        """Free what `req` holds; with `keep_state` the prefix cache may keep its computed
        prefix (see `PrefixCache.release` for `verify_row`)."""
        self.running.remove(req)
        self.prefix_cache.release(req, keep_state, verify_row)

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
            if not chunk.completes:
                self.prefix_cache.after_prefill_chunk(req)
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
        appended = 0
        for i, token in enumerate(out.tokens):
            if out.logprobs is not None:
                req.output_token_logprobs.append((out.logprobs[i], token))
                if out.top_logprobs is not None:
                    req.output_top_logprobs.append(out.top_logprobs[i])
            if out.token_ids_logprobs is not None:
                req.output_token_ids_logprobs.append(out.token_ids_logprobs[i])
            appended = i + 1
            if req.append_token(token, self.eos_ids):
                break
        req.num_cached = req.seq_len - 1  # the newest token is not in the cache yet
        if req.finished:
            # a speculative round that emitted tokens past the stop left the caches at its
            # last row; the state at the stop is that after verify row `appended - 1`
            verify_row = appended - 1 if appended < len(out.tokens) else None
            self._release(req, keep_state=True, verify_row=verify_row)
