# SPDX-License-Identifier: Apache-2.0
"""Continuous batching: admit, prefill in chunks, decode, retract, abort, finish.

Each `step()` runs one worker step over the running requests. Admission is FCFS while
request slots, `max_running_requests` and token pages allow, and reserves the whole prompt;
prefill chunks share at most `chunked_prefill_size` tokens a step; decoding requests add
their newest token or one speculative round (in the same step as chunks where the worker
`supports_mixed`, else prefill and decode steps alternate so neither starves). When pages
run out the prefix cache gives back first, then the most recently admitted request is
retracted and later rebuilt to decode exactly as if never retracted (same rounds, same
seeded draws). A worker step that raises fails only the requests it can be pinned on
(`fault_isolation`); an error admitting or committing one request aborts that one only.
Finish checks run per emitted token, in order, so nothing after a stop leaks out.

The prefix cache (`runtime.cache.prefix_cache`) is used through a small interface; the
full step walk-through is docs/architecture.md, section 2 and "Module notes".
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from functools import partial

from runtime.cache.prefix_cache import Admission, PrefixCache
from runtime.cache.slot_table import SlotTable
from runtime.core.request import FinishReason, Req
from runtime.core.step_io import Chunk, TokenOutput, chunk_budget
from runtime.core.worker import Worker
from runtime.scheduler.fault_isolation import FaultIsolation, SuspectGroup

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        worker: Worker,
        slot_table: SlotTable,
        eos_ids: set[int],
        max_running_requests: int,
        chunked_prefill_size: int | None = None,
        prefix_cache: PrefixCache | None = None,
        step_failure_is_fatal: Callable[[Exception], bool] | None = None,
    ):
        """`step_failure_is_fatal(error)`: True when a worker step that raised leaves
        something the scheduler cannot recover (another rank inside the forward): the error
        is then raised instead of pinned on a request."""
        self.worker, self.slot_table = worker, slot_table
        self.step_failure_is_fatal = step_failure_is_fatal
        self.prefix_cache = prefix_cache or PrefixCache(slot_table)
        # a speculative worker decodes a request only once it has drafts for it
        speculation = worker.speculation
        self._needs_drafts = speculation is not None and speculation.needs_drafts
        self.eos_ids = eos_ids
        self.max_running_requests = max_running_requests
        self.chunk_budget = chunk_budget(chunked_prefill_size)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.isolation = FaultIsolation()
        self._last_step_prefilled = False
        self._finishing: list[tuple[Req, int | None]] = []  # (request, verify row) this step
        self.num_retractions = 0
        self.num_failed_steps = 0

    # queue --------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.isolation.active)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission, suspects of a failed step included."""
        return len(self.waiting) + self.isolation.num_pending()

    def abort(self, rid: str, message: str = "aborted by the client") -> Req | None:
        """Stop a waiting or running request and free everything it holds."""
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                self._drop(req, message)
                return req
        for req in self.running:
            if req.rid == rid:
                self._release(req)
                self._drop(req, message)
                return req
        req = self.isolation.take_pending(rid)
        if req is not None:
            self._drop(req, message)
        return req

    def abort_all(self, message: str) -> list[Req]:
        reqs = list(self.running) + list(self.waiting) + self.isolation.pending()
        for req in reqs:
            self.abort(req.rid, message)
        return reqs

    # one step -----------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one worker step; returns the requests that got tokens or finished in it.
        While the requests of a failed step are re-run (`isolation.current()`), steps hold
        only the current group of suspects."""
        group = self.isolation.current()
        touched = self._admit(group)
        touched += self._ensure_decode_slots(group)
        active = self._active(group)
        prefill = self._plan_prefill(active)
        decode = [r for r in active if self._decodes(r)]
        if prefill and decode and not self.worker.supports_mixed:
            if self._last_step_prefilled:
                prefill = []
            else:
                decode = []
        if not prefill and not decode:
            self.isolation.settle()
            return touched
        self._last_step_prefilled = bool(prefill)
        try:
            prefill_out, decode_out = self.worker.step(prefill, decode)
        except Exception as error:  # noqa: BLE001 - pinned on its requests, see _isolate
            if self.step_failure_is_fatal is not None and self.step_failure_is_fatal(error):
                raise
            return touched + self._isolate(prefill, decode, error)
        touched += self._commit_prefill(prefill, prefill_out)
        touched += self._commit_decode(decode, decode_out)
        self._release_finished()
        self.isolation.settle()
        return touched

    def tokens_to_admit(self, req: Req) -> int:
        """Token slots reserved for `req` when it is admitted (and at each later step)."""
        return self._needed(req)

    def _needed(self, req: Req) -> int:
        """Token slots `req` needs for its next step: its tokens and what the worker writes
        ahead of them, but never past the last position whose row can still emit a token
        (`max_len - 2`): later rows of a speculative pass go to the scratch page."""
        last_useful = len(req.prompt_ids) + req.sampling_params.max_new_tokens - 1
        return min(req.seq_len + self.worker.reserve_ahead(), max(last_useful, req.seq_len))

    def _decodes(self, req: Req) -> bool:
        """The request's next step is a decode step (a request resumed from the prefix cache
        right at its newest token still runs it as a prefill chunk to get its drafts)."""
        return req.is_decoding and (not self._needs_drafts or req.draft_tokens is not None)

    def _active(self, group: SuspectGroup | None) -> list[Req]:
        """The running requests this step may schedule."""
        if group is None:
            return self.running
        return [r for r in self.running if group.holds(r)]

    def _admit(self, group: SuspectGroup | None) -> list[Req]:
        """Move queued requests in (FCFS) while request slots and pages allow. A re-run
        group of suspects takes the room of idle requests if it must: nothing else runs
        until it is cleared."""
        queue = self.waiting if group is None else group.pending
        rejected: list[Req] = []
        capacity = self.slot_table.allocator.capacity_tokens
        while queue:
            req = queue[0]
            need = self._needed(req)
            if need > capacity:  # could never run (the engine refuses such prompts up front)
                queue.popleft()
                self._drop(
                    req,
                    f"the request needs {need} tokens of KV cache but the pool holds "
                    f"{capacity}; raise --max-total-tokens or shorten the prompt",
                )
                rejected.append(req)
                continue
            if group is None and self.prefix_cache.waits_for_prefix(req, self.running):
                break
            try:
                admission = self._try_admit(req, need, strict=group is None)
            except Exception as error:  # noqa: BLE001 - fails this request only
                logger.exception("admitting request %s failed", req.rid)
                queue.popleft()
                self._drop(req, f"internal error while admitting this request: {error!r}")
                rejected.append(req)
                continue
            if admission is Admission.ADMITTED:
                queue.popleft()
                self.running.append(req)
            elif admission is Admission.NO_ROOM and not self.running:
                queue.popleft()  # alone and still no room: it can never run
                self._drop(
                    req,
                    f"the request needs {need} tokens of KV cache but the pool holds "
                    f"{capacity}; raise --max-total-tokens or shorten the prompt",
                )
                rejected.append(req)
            elif group is None or not self._retract_idle(group):
                break
        return rejected

    def _try_admit(self, req: Req, need: int, strict: bool) -> Admission:
        """A request slot and `need` token slots for `req` (reusing what the prefix cache
        holds). `strict` keeps a page of headroom per running request so those can keep
        decoding."""
        if len(self.running) >= self.max_running_requests:
            return Admission.NO_REQUEST_SLOT
        headroom = len(self.running) * self.slot_table.page_size if strict else 0
        return self.prefix_cache.admit(req, need, headroom, alone=not self.running)

    def _retract_idle(self, group: SuspectGroup) -> bool:
        """Retract the newest running request outside `group`; False if there is none."""
        idle = [r for r in self.running if not group.holds(r)]
        if not idle:
            return False
        self._retract(idle[-1])
        return True

    def _plan_prefill(self, active: list[Req]) -> list[Chunk]:
        budget = self.chunk_budget
        chunks = []
        for req in active:
            if self._decodes(req):
                continue
            remaining = self._prefill_end(req) - req.num_cached
            if remaining <= 0:
                continue
            if budget is not None and budget <= 0:
                break
            size = remaining if budget is None else min(remaining, budget)
            end = self.prefix_cache.chunk_end(req, req.num_cached, req.num_cached + size)
            size = end - req.num_cached
            chunks.append(Chunk(req, req.num_cached, end))
            if budget is not None:
                budget -= size
        return chunks

    def _prefill_end(self, req: Req) -> int:
        """Where prefill stops: the end of the prompt, or for a retracted request with
        output, just before its newest token (`Chunk.resumes`): that token is then decoded
        as it would have been without the retraction, so a seeded request draws the same
        randomness and a speculative one runs the same verify rounds (its last chunk drafts
        them). A speculative request put back right at its newest token without drafts has
        no row to draft from: it runs that token as a prefill chunk."""
        if not req.output_ids:
            return req.seq_len
        if self._needs_drafts and req.num_cached == req.seq_len - 1:
            return req.seq_len
        return req.seq_len - 1

    def _ensure_decode_slots(self, group: SuspectGroup | None) -> list[Req]:
        """Every decoding request needs slots for its next step: the prefix cache gives
        back what it holds first, then the newest requests are retracted (idle ones first
        while suspects are re-run) until they fit; a lone request that cannot fit is
        aborted."""
        while True:
            decode = [r for r in self._active(group) if self._decodes(r)]
            if all(self.slot_table.reserve(r.req_pool_idx, self._needed(r)) for r in decode):
                return []
            short = sum(
                self.slot_table.pages_needed(r.req_pool_idx, self._needed(r)) for r in decode
            )
            short -= self.slot_table.allocator.available_pages()
            if short > 0 and self.prefix_cache.make_room(short) >= short:
                continue
            idle = [] if group is None else [r for r in self.running if not group.holds(r)]
            victim = (idle or self.running)[-1]
            if len(self.running) == 1:
                self._release(victim, keep_state=True)
                self._drop(
                    victim,
                    "out of KV cache: this request alone needs more tokens than the pool "
                    "holds; raise --max-total-tokens or lower max_new_tokens",
                )
                return [victim]
            self._retract(victim)
            logger.info(
                "retracted request %s (%d tokens) to free KV cache", victim.rid, victim.seq_len
            )

    def _retract(self, req: Req) -> None:
        """Free `req`'s slots (the prefix cache may keep its state) and queue it to be
        rebuilt from prompt + output so far. Its drafts stay: they are valid if it resumes
        right at its newest token (the prefix cache clears them otherwise)."""
        self._release(req, keep_state=True)
        self._restart(req)
        self.num_retractions += 1
        if not self.isolation.requeue(req):
            self.waiting.appendleft(req)

    def _restart(self, req: Req) -> None:
        """`req` holds no cache any more: prompt logprobs of an unfinished prompt are
        recomputed with it."""
        req.num_cached = 0
        req.num_retractions += 1
        if not req.input_logprobs_done:
            req.input_token_logprobs = []
            req.input_top_logprobs = []
            req.input_token_ids_logprobs = []

    def _release(self, req: Req, keep_state: bool = False, verify_row: int | None = None) -> None:
        """Free what `req` holds; with `keep_state` the prefix cache may keep its computed
        prefix (see `PrefixCache.release` for `verify_row`)."""
        (drafts,) = self.worker.release([req], keep_state and self.prefix_cache.enabled)
        if drafts is not None:  # the drafts of the round it resumes with
            req.draft_tokens = drafts
        self._free(req, keep_state, verify_row)

    def _free(self, req: Req, keep_state: bool, verify_row: int | None) -> None:
        self.running.remove(req)
        self.prefix_cache.release(req, keep_state, verify_row)

    def _release_finished(self) -> None:
        """Free the requests that finished in this step, the prefix cache keeping their state;
        the worker lets go of them all at once (a speculative worker leaves the rows its
        draft skipped with each one, `Req.owed_draft_rows`, for the cache to keep, or runs
        the draft over them first, in one batch)."""
        finishing, self._finishing = self._finishing, []
        if not finishing:
            return
        self.worker.release([req for req, _ in finishing], self.prefix_cache.enabled)
        for req, verify_row in finishing:
            self._free(req, True, verify_row)
            self.isolation.forget(req)

    def _drop(self, req: Req, message: str) -> None:
        """Abort a request that holds no slots (any more)."""
        req.abort(message)
        self.isolation.forget(req)

    # failures -----------------------------------------------------------------------------
    def _isolate(self, prefill: list[Chunk], decode: list[Req], error: Exception) -> list[Req]:
        """A worker step raised. Alone, its request is aborted with the error; otherwise
        every request of the step is retracted and becomes a suspect (`fault_isolation`):
        the others' outputs are those of a run without the culprit. Nothing the failed step
        may have written is kept: no state goes to the prefix cache, drafts are dropped."""
        self.num_failed_steps += 1
        failed = [(c.req, c.end) for c in prefill] + [(r, r.seq_len) for r in decode]
        logger.warning(
            "a step over %d request(s) failed; %s",
            len(failed),
            "aborting it" if len(failed) == 1 else "re-running them in halves",
            exc_info=error,
        )
        if len(failed) == 1:
            req = failed[0][0]
            self._release(req)
            self._drop(req, f"internal error while running this request: {error!r}")
            return [req]
        for req, _ in failed:
            self._release(req)
            self._restart(req)
            req.draft_tokens = None
        self.isolation.suspect(failed)
        return []

    # results ------------------------------------------------------------------------------
    def _commit_prefill(self, chunks: list[Chunk], outputs: list[TokenOutput]) -> list[Req]:
        touched = []
        for chunk, out in zip(chunks, outputs):
            if self._commit_one(chunk.req, self._commit_chunk, chunk, out):
                touched.append(chunk.req)
        return touched

    def _commit_decode(self, reqs: list[Req], outputs: list[TokenOutput]) -> list[Req]:
        for req, out in zip(reqs, outputs):
            self._commit_one(req, self._commit_round, req, out)
        return list(reqs)

    def _commit_one(self, req: Req, commit, *args) -> bool:
        """Run `commit(*args)` for one request; an error aborts that request only. True
        when the request changed in a way its caller must see (tokens, finished)."""
        try:
            return commit(*args)
        except Exception as error:  # noqa: BLE001 - e.g. a detokenizer failing on a token
            logger.exception("committing the output of request %s failed", req.rid)
            self._finishing = [(r, row) for r, row in self._finishing if r is not req]
            if req.req_pool_idx is not None:
                self._release(req)
            self._drop(req, f"internal error while committing this request: {error!r}")
            return True

    def _commit_chunk(self, chunk: Chunk, out: TokenOutput) -> bool:
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
            self.prefix_cache.after_prefill_chunk(req, partial(self.worker.owed_draft_rows, req))
        self._store_speculation(req, out)
        if chunk.completes and req.sampling_params.max_new_tokens == 0:
            # a scoring request (prompt logprobs only): its prefill is all it wanted
            req.finish(FinishReason("length", length=0))
            self._release(req)
            self.isolation.forget(req)
            return True
        if out.tokens:
            self._append(req, out)
            return True
        return False

    def _commit_round(self, req: Req, out: TokenOutput) -> bool:
        self._store_speculation(req, out)
        self._append(req, out)
        return True

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
            self._finishing.append((req, verify_row))  # freed once the step is committed
