# SPDX-License-Identifier: Apache-2.0
"""Request slots and the `[request, position] -> token slot` table shared by target and draft.

The table has one row more than there are request slots: the padding request (`pad_req`),
which rows that pad a captured batch up to its size use; `SlotTable` points every position
of it into the scratch page. Per-request cache buffers hold its rows too; the prefix
cache's state snapshots live in buffers of their own (`state_snapshots`), never in these rows.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str = "cpu"):
        self.max_reqs, self.max_context_len = max_reqs, max_context_len
        self.pad_req = max_reqs
        self.req_to_token = torch.zeros(
            (max_reqs + 1, max_context_len), dtype=torch.long, device=device
        )
        self._free = list(range(max_reqs - 1, -1, -1))

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free request slot, or None when all are taken."""
        return self._free.pop() if self._free else None

    def free(self, req_pool_idx: int) -> None:
        if not 0 <= req_pool_idx < self.max_reqs or req_pool_idx in self._free:
            raise ValueError(f"request slot {req_pool_idx} is not allocated")
        self._free.append(req_pool_idx)
