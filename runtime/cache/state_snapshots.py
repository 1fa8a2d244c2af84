# SPDX-License-Identifier: Apache-2.0
"""Copies of a request's non-shareable cache state, kept for the prefix cache.

Full-history rows (KV per token slot, compressed entries per page) are shared by reference
through the pages a prefix owns. What a pool keeps *per request* instead (position-keyed
rings, recurrent state) cannot be shared that way: a request slot is reused by the next
request. The prefix cache copies it into one of `num_slots` preallocated snapshot slots at
a chosen position and copies it back into a new request's slot when that request resumes
from there, as SGLang's hybrid linear-attention radix cache (`mamba_radix_cache.py`) keeps
Mamba states at tree nodes.

A pool takes part through two methods:

* `request_state(req_pool_idx, verify_row=None) -> list[Tensor]`: views of the request's
  rows in every per-request buffer (same shapes for every request slot);
* `copy_pages(src_pages, dst_pages)`: copy the rows stored per token page (the partial
  page a snapshot keeps past the last shared page is copied into the resuming request's own
  page; a page holding rows several requests read is never written).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class StateSnapshots:
    def __init__(self, pools: Sequence, num_slots: int):
        self.pools, self.num_slots = list(pools), num_slots
        views = self._views(0, None)
        self._store = [
            torch.zeros((num_slots, *v.shape), dtype=v.dtype, device=v.device) for v in views
        ]
        self._free = list(range(num_slots - 1, -1, -1))

    def _views(self, req_pool_idx: int, verify_row: int | None) -> list[torch.Tensor]:
        return [v for pool in self.pools for v in pool.request_state(req_pool_idx, verify_row)]

    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self._store)

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"snapshot slot {slot} is not allocated")
        self._free.append(slot)

    def save(self, req_pool_idx: int, slot: int, verify_row: int | None = None) -> None:
        """Copy request `req_pool_idx`'s state into snapshot `slot` (`verify_row`: see
        `request_state`)."""
        for store, view in zip(self._store, self._views(req_pool_idx, verify_row)):
            store[slot].copy_(view)

    def restore(self, slot: int, req_pool_idx: int) -> None:
        for store, view in zip(self._store, self._views(req_pool_idx, None)):
            view.copy_(store[slot])

    def copy_pages(self, src_pages: list[int], dst_pages: list[int]) -> None:
        if src_pages:
            for pool in self.pools:
                pool.copy_pages(src_pages, dst_pages)
