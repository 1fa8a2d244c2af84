# SPDX-License-Identifier: Apache-2.0
"""The step loop: admit waiting requests, prefill them, decode everyone running.

One `step()` runs one forward: an EXTEND batch when new requests could be admitted, else
a DECODE batch of every running request. When the token pages run out mid-decode, the
most recently admitted request is retracted (its pages freed, its prompt + output so far
re-queued for a later prefill), so the server keeps going instead of failing.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from runtime.cache.slot_table import SlotTable
from runtime.execution.forward_mode import ForwardMode
from runtime.execution.model_runner import ModelInput, ModelRunner
from runtime.execution.sampler import SamplingBatch, sample
from runtime.scheduler.request import FinishReason, Req

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, runner: ModelRunner, slot_table: SlotTable, eos_ids: set[int], vocab_size: int,
                 max_running_requests: int, generator: torch.Generator | None = None):
        self.runner, self.slot_table = runner, slot_table
        self.eos_ids, self.vocab_size = eos_ids, vocab_size
        self.max_running_requests = max_running_requests
        self.generator = generator
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []

    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Req]:
        """Run one forward; returns the requests that finished in it."""
        admitted = self._admit()
        if admitted:
            return self._run_extend(admitted)
        if self.running:
            return self._run_decode()
        return []

    # admission ----------------------------------------------------------------------------
    def _admit(self) -> list[Req]:
        admitted: list[Req] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_running_requests:
            req = self.waiting[0]
            idx = self.slot_table.open_request()
            if idx is None:
                break
            if not self.slot_table.reserve(idx, req.seq_len):
                self.slot_table.release(idx)
                if not self.running and not admitted:
                    self.waiting.popleft()
                    self._abort(req, f"the request needs {req.seq_len} tokens of KV cache but the "
                                     f"pool holds {self.slot_table.allocator.capacity_tokens}; "
                                     "raise --max-total-tokens or shorten the prompt")
                    admitted.append(req)  # reported as finished by the caller
                break
            self.waiting.popleft()
            req.req_pool_idx, req.num_cached = idx, 0
            admitted.append(req)
        return admitted

    def _abort(self, req: Req, message: str) -> None:
        req.finish_reason = FinishReason("abort", message=message)

    # forwards -----------------------------------------------------------------------------
    def _run_extend(self, reqs: list[Req]) -> list[Req]:
        finished = [r for r in reqs if r.finished]
        reqs = [r for r in reqs if not r.finished]
        if not reqs:
            return finished
        tokens = [r.all_ids[r.num_cached:] for r in reqs]
        inp = ModelInput(
            ForwardMode.EXTEND,
            input_ids=torch.tensor([t for seq in tokens for t in seq], dtype=torch.long),
            req_pool_indices=[r.req_pool_idx for r in reqs],
            prefix_lens=[r.num_cached for r in reqs],
            extend_lens=[len(t) for t in tokens])
        logits = self.runner.forward(inp).next_token_logits
        for r in reqs:
            r.num_cached = r.seq_len
        self.running.extend(reqs)
        return finished + self._append_samples(reqs, logits)

    def _run_decode(self) -> list[Req]:
        self._reserve_or_retract()
        reqs = self.running
        inp = ModelInput(
            ForwardMode.DECODE,
            input_ids=torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long),
            req_pool_indices=[r.req_pool_idx for r in reqs],
            prefix_lens=[r.num_cached for r in reqs],
            extend_lens=[1] * len(reqs))
        logits = self.runner.forward(inp).next_token_logits
        for r in reqs:
            r.num_cached += 1
        return self._append_samples(reqs, logits)

    def _reserve_or_retract(self) -> None:
        """Every running request needs a slot for one more position; retract newest first."""
        while self.running:
            short = [r for r in self.running if not self.slot_table.reserve(r.req_pool_idx, r.seq_len)]
            if not short:
                return
            victim = self.running.pop()
            self.slot_table.release(victim.req_pool_idx)
            victim.req_pool_idx, victim.num_cached = None, 0
            victim.num_retractions += 1
            self.waiting.appendleft(victim)
            logger.info("retracted request %s (%d tokens) to free KV cache", victim.rid, victim.seq_len)

    def _append_samples(self, reqs: list[Req], logits: torch.Tensor) -> list[Req]:
        batch = SamplingBatch.from_params([r.sampling_params for r in reqs], self.vocab_size)
        positions = torch.tensor([r.seq_len for r in reqs], dtype=torch.long)
        next_ids = sample(logits, batch, positions, self.generator).tolist()
        finished = []
        for r, token in zip(reqs, next_ids):
            r.output_ids.append(token)
            if r.check_finish(token, self.eos_ids):
                finished.append(r)
        for r in finished:
            self.running.remove(r)
            self.slot_table.release(r.req_pool_idx)
            r.req_pool_idx = None
        return finished
