# SPDX-License-Identifier: Apache-2.0
"""`Worker`: what the scheduler and the engine may call on a worker, and the speculation
facet a speculative one adds.

A worker sits between the scheduler (requests, token ids) and the model runners
(tensors): `step` runs one batch of prefill chunks and decode requests, `release` lets
requests go, `reserve_ahead` says how many positions past `seq_len` a step may write,
`owed_draft_rows` what a snapshot taken now must keep. `PlainWorker`
(`runtime.execution.worker`) and `NextNWorker` (`runtime.speculative.nextn_worker`) are
the two; both are used on the engine's loop thread only.

A worker that speculates exposes `speculation` (`SpeculationFacet`), None otherwise:
callers test `worker.speculation is None` instead of probing attributes. The facet names
what the engine's warm-up, calibration and statistics touch: the drafter and its runner,
the speculation policy (which the warm-up and calibration swap for a while), the
acceptance counters, and the fused greedy round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from runtime.core.request import OwedDraftRows, Req
from runtime.core.step_io import Chunk, TokenOutput


@runtime_checkable
class SpeculationFacet(Protocol):
    needs_drafts: bool  # a request decodes only once a prefill step has drafted for it
    drafter: Any  # the MTP drafter (`drafter.runner`: the draft's `ModelRunner`)
    policy: Any  # when to speculate (`speculation_policy`); swappable on the loop thread
    stats: Any  # acceptance counters (`SpecStats`); swappable on the loop thread
    captured_round: Any  # the fused greedy round (`CapturedRound`)


@runtime_checkable
class Worker(Protocol):
    supports_mixed: bool  # decode rows and prefill chunks may share a step

    @property
    def speculation(self) -> SpeculationFacet | None: ...

    def step(
        self, prefill: Sequence[Chunk], decode: Sequence[Req]
    ) -> tuple[list[TokenOutput], list[TokenOutput]]:
        """One step: an output per prefill chunk and per decode request, in order."""

    def reserve_ahead(self) -> int:
        """Positions past `seq_len` a step may write."""

    def release(self, reqs: Sequence[Req], keep_state: bool = False) -> list:
        """`reqs` leave the running batch; per request, the drafts of the round it resumes
        with (a retracted request kept by the prefix cache) or None."""

    def owed_draft_rows(self, req: Req) -> OwedDraftRows | None:
        """Rows a draft has not run over for `req`, for a snapshot of its state now."""
