# SPDX-License-Identifier: Apache-2.0
"""Pinning a failed step on the requests that caused it.

When a worker step raises, nothing tells which of its requests is to blame: a bad value can
fail the sampler for the whole batch. The scheduler then treats the step's requests as
suspects: each is retracted (its cache freed, to be recomputed from prompt + output so far)
and the suspects are re-run in halves, one group at a time, with nothing else in their
steps. A group whose requests all get past the point where the step failed is cleared and
its requests go back to normal batching; a group that fails again is halved again; a
request that fails alone is aborted with the error: bisection over the batch, which finds
one culprit among n requests in about log2(n) re-runs.

Why recompute rather than re-run the failed step in place: a failed forward may already
have written cache rows for every request of the batch. Rows keyed by position (KV, rings,
compressed entries) would simply be rewritten by a re-run, but recurrent state (Gated
DeltaNet's `ssm_state`) is updated in place, so re-running the step would apply it twice.
Recomputing from position 0 rebuilds every kind of cache from scratch, exactly as a
retraction does, and a new request's recurrent state starts from zero.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from runtime.core.request import Req


@dataclass
class SuspectGroup:
    members: list[Req]  # not cleared yet: pending or running
    pending: deque[Req] = field(default_factory=deque)  # retracted, to be re-admitted

    def holds(self, req: Req) -> bool:
        return any(m is req for m in self.members)


class FaultIsolation:
    def __init__(self):
        self.groups: deque[SuspectGroup] = deque()
        self._marks: dict[int, int] = {}  # id(req) -> cached tokens that clear it

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def current(self) -> SuspectGroup | None:
        """The group being re-run now (nothing else runs meanwhile)."""
        return self.groups[0] if self.groups else None

    def num_pending(self) -> int:
        return sum(len(g.pending) for g in self.groups)

    def pending(self) -> list[Req]:
        return [r for g in self.groups for r in g.pending]

    def suspect(self, failed: list[tuple[Req, int]]) -> None:
        """`failed`: the retracted requests of a step that raised, each with the cached
        length that step would have taken it to. They are re-run as two halves, ahead of
        every other group (depth first: a culprit is isolated in log2(batch) rounds)."""
        reqs = [req for req, _ in failed]
        for req, mark in failed:
            self._marks[id(req)] = max(self._marks.get(id(req), 0), mark)
            self._drop(req)
        self._pop_empty()
        half = (len(reqs) + 1) // 2
        for part in (reqs[half:], reqs[:half]):
            if part:
                self.groups.appendleft(SuspectGroup(list(part), deque(part)))

    def requeue(self, req: Req) -> bool:
        """Put a retracted member of the current group back in its queue; False when `req`
        is no suspect."""
        group = self.current()
        if group is None or not group.holds(req):
            return False
        group.pending.appendleft(req)
        return True

    def take_pending(self, rid: str) -> Req | None:
        """Remove and return the pending suspect with id `rid` (an abort)."""
        for group in self.groups:
            for req in group.pending:
                if req.rid == rid:
                    self.forget(req)
                    return req
        return None

    def forget(self, req: Req) -> None:
        """`req` left the scheduler (finished, aborted)."""
        self._drop(req)
        self._marks.pop(id(req), None)
        self._pop_empty()

    def settle(self) -> None:
        """Clear the members of the current group that got past their failure point."""
        group = self.current()
        if group is None:
            return
        for req in list(group.members):
            if req.finished or (
                req.req_pool_idx is not None and req.num_cached >= self._marks.get(id(req), 0)
            ):
                self.forget(req)
        self._pop_empty()

    def _drop(self, req: Req) -> None:
        for group in self.groups:
            group.members = [m for m in group.members if m is not req]
            group.pending = deque(m for m in group.pending if m is not req)

    def _pop_empty(self) -> None:
        self.groups = deque(g for g in self.groups if g.members)
