# SPDX-License-Identifier: Apache-2.0
"""The step loop: admit waiting requests, prefill them, decode everyone running.

One `step()` runs one worker step: an EXTEND batch when new requests could be admitted,
else a decode step of every running request (one token each, or one speculative round).
When the token pages run out mid-decode, the most recently admitted request is retracted
(its pages freed, its prompt + output so far re-queued for a later prefill), so the
server keeps going instead of failing. Finish checks run per emitted token, in order, so
nothing after a stop leaks out.
"""

from __future__ import annotations

import logging
from collections import deque

from runtime.cache.slot_table import SlotTable
from runtime.scheduler.request import FinishReason, Req

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, worker, slot_table: SlotTable, eos_ids: set[int], max_running_requests: int):
        self.worker, self.slot_table = worker, slot_table
        self.eos_ids = eos_ids
        self.max_running_requests = max_running_requests
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []

    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Req]:
        """Run one worker step; returns the requests that finished in it."""
        admitted = self._admit()
        rejected = [r for r in admitted if r.finished]
        admitted = [r for r in admitted if not r.finished]
        if admitted:
            new_tokens = self.worker.extend(admitted)
            self.running.extend(admitted)
            return rejected + self._commit(admitted, new_tokens)
        if self.running:
            self._reserve_or_retract()
            return rejected + self._commit(self.running, self.worker.decode(self.running))
        return rejected

    def _needed(self, req: Req) -> int:
        return req.seq_len + self.worker.reserve_ahead()

    # admission ----------------------------------------------------------------------------
    def _admit(self) -> list[Req]:
        admitted: list[Req] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_running_requests:
            req = self.waiting[0]
            idx = self.slot_table.open_request()
            if idx is None:
                break
            if not self.slot_table.reserve(idx, self._needed(req)):
                self.slot_table.release(idx)
                if not self.running and not admitted:
                    self.waiting.popleft()
                    req.finish_reason = FinishReason(
                        "abort", message=f"the request needs {self._needed(req)} tokens of KV cache "
                        f"but the pool holds {self.slot_table.allocator.capacity_tokens}; raise "
                        "--max-total-tokens or shorten the prompt")
                    admitted.append(req)
                break
            self.waiting.popleft()
            req.req_pool_idx, req.num_cached = idx, 0
            admitted.append(req)
        return admitted

    def _reserve_or_retract(self) -> None:
        """Every running request needs slots for its next step; retract newest first."""
        while self.running:
            if all(self.slot_table.reserve(r.req_pool_idx, self._needed(r)) for r in self.running):
                return
            victim = self.running.pop()
            self.slot_table.release(victim.req_pool_idx)
            victim.req_pool_idx, victim.num_cached = None, 0
            victim.num_retractions += 1
            self.waiting.appendleft(victim)
            logger.info("retracted request %s (%d tokens) to free KV cache", victim.rid, victim.seq_len)

    # results ------------------------------------------------------------------------------
    def _commit(self, reqs: list[Req], new_tokens: list[list[int]]) -> list[Req]:
        finished = []
        for req, tokens in zip(reqs, new_tokens):
            for token in tokens:
                req.output_ids.append(token)
                if req.check_finish(token, self.eos_ids):
                    finished.append(req)
                    break
            req.num_cached = req.seq_len - 1  # the newest token is not in the cache yet
        for req in finished:
            self.running.remove(req)
            self.slot_table.release(req.req_pool_idx)
            req.req_pool_idx = None
        return finished
