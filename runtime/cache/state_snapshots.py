# SPDX-License-Identifier: Apache-2.0
"""Copies of a request's non-shareable cache state, kept for the prefix cache.

Full-history rows are shared by reference through the pages a prefix owns; what a pool keeps
*per request* (position-keyed rings, recurrent state) cannot be, since a request slot is
reused. The prefix cache copies it into one of `num_slots` preallocated snapshot slots and
back into a new request's slot when that request resumes, as SGLang's hybrid radix cache
(`mamba_radix_cache.py`) keeps Mamba states at tree nodes.

* `RequestStateSnapshots` (a pool mixin): a pool names a request's rows (`request_state`)
  and holds the snapshot slots of its own buffers, so each tensor-parallel rank copies its
  own shard.
* `StateSnapshots` (the prefix cache's side): free snapshot slots, the copies as
  `PoolCommand`s applied through every runner (`apply`), and per slot the target rows an
  MTP draft still owes (`OwedDraftRows`, rank 0's) in one preallocated buffer rather than
  copies of their own. Why one buffer: docs/prefix_cache.md, "Module notes".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from runtime.core.pool_commands import CopyPages, RestoreSnapshot, SaveSnapshot
from runtime.core.request import OwedDraftRows

logger = logging.getLogger(__name__)


class RequestStateSnapshots:
    """Mixin for a cache pool. The pool provides

    * `request_state(req_pool_idx, verify_row=None) -> list[Tensor]`: views of the request's
      rows in every per-request buffer (the same shapes for every request slot);
    * `copy_pages(src_pages, dst_pages)`: copy the rows stored per token page (the partial page
      a snapshot keeps past the last shared page goes into the resuming request's own page; a
      page several requests read is never written).
    """

    _snapshot_store: list[torch.Tensor] = []

    def request_state(self, req_pool_idx: int, verify_row: int | None = None) -> list:
        raise NotImplementedError

    def allocate_snapshots(self, num_slots: int) -> None:
        self._snapshot_store = [
            torch.zeros((num_slots, *v.shape), dtype=v.dtype, device=v.device)
            for v in self.request_state(0)
        ]

    def snapshot_nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self._snapshot_store)

    def save_snapshot(self, req_pool_idx: int, slot: int, verify_row: int | None = None) -> None:
        """Copy request `req_pool_idx`'s state into snapshot `slot` (`verify_row`: see
        `request_state`)."""
        for store, view in zip(self._snapshot_store, self.request_state(req_pool_idx, verify_row)):
            store[slot].copy_(view)

    def restore_snapshot(self, slot: int, req_pool_idx: int) -> None:
        for store, view in zip(self._snapshot_store, self.request_state(req_pool_idx)):
            view.copy_(store[slot])


class StateSnapshots:
    """Snapshot slots and the copies in and out of them, on the pools of `runners` (objects
    with `kv_pool` and `apply(command)`: the target's and the draft's runner)."""

    def __init__(self, runners: Sequence, num_slots: int, owed_capacity: int | None = None):
        """`owed_capacity`: the most rows a draft may owe a state (its `kv_reach`: it keeps
        no more); None keeps each snapshot's owed rows as its own tensor (a draft reading
        every row owes rows only in rare cases, and then any number)."""
        self.runners, self.num_slots = list(runners), num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.owed_capacity = owed_capacity
        self._owed_rows: torch.Tensor | None = None  # [num_slots, owed_capacity, *row]

    def nbytes(self) -> int:
        return sum(r.kv_pool.snapshot_nbytes() for r in self.runners) + self._owed_nbytes()

    def _owed_nbytes(self) -> int:
        owed = self._owed_rows
        return 0 if owed is None else owed.numel() * owed.element_size()

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"snapshot slot {slot} is not allocated")
        self._free.append(slot)

    def save(self, req_pool_idx: int, slot: int, verify_row: int | None = None) -> None:
        for runner in self.runners:
            runner.apply(SaveSnapshot(req_pool_idx, slot, verify_row))

    def restore(self, slot: int, req_pool_idx: int) -> None:
        for runner in self.runners:
            runner.apply(RestoreSnapshot(slot, req_pool_idx))

    def copy_pages(self, src_pages: list[int], dst_pages: list[int]) -> None:
        if src_pages:
            for runner in self.runners:
                runner.apply(CopyPages(tuple(src_pages), tuple(dst_pages)))

    def keep_owed(self, slot: int, owed: OwedDraftRows) -> OwedDraftRows:
        """`owed` as snapshot `slot` keeps it: its rows copied into the slot's rows of the
        owed-rows buffer (the returned rows are a view of them, valid while the slot is
        not reused: a request resuming from the slot takes a copy, `OwedDraftRows.copy`)."""
        rows = owed.hidden
        store = self._owed_store(rows)
        if store is None or rows.shape[0] > store.shape[1]:
            return owed
        kept = store[slot, : rows.shape[0]]
        kept.copy_(rows)
        return OwedDraftRows(owed.start, kept, owed.following)

    def _owed_store(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The owed-rows buffer (allocated for rows like `rows` at the first call), or None
        without a capacity or for rows of another shape, dtype or device."""
        if self.owed_capacity is None:
            return None
        if self._owed_rows is None:
            shape = (self.num_slots, self.owed_capacity, *rows.shape[1:])
            self._owed_rows = torch.empty(shape, dtype=rows.dtype, device=rows.device)
            logger.info(
                "prefix cache: rows the MTP draft owes its snapshots, %d slots of %d rows "
                "(%.1f MiB)",
                self.num_slots,
                self.owed_capacity,
                self._owed_nbytes() / 2**20,
            )
        store = self._owed_rows
        fits = (store.shape[2:], store.dtype, store.device) == (
            rows.shape[1:],
            rows.dtype,
            rows.device,
        )
        return store if fits else None
