# SPDX-License-Identifier: Apache-2.0
"""The sizes every per-model cache pool is built from, fixed at start-up."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PoolGeometry:
    max_reqs: int  # request slots
    num_pages: int  # token pages of `page_size` slots
    page_size: int
    # the most positions one request writes in a single verify/draft pass that may later be
    # rejected (speculative draft tokens + 1); position-keyed rings are this much longer
    max_tokens_per_pass: int
    dtype: torch.dtype
    device: torch.device | str = "cpu"
    max_context: int = 0  # longest request, for per-request tables sized by context

    @property
    def req_slots(self) -> int:
        """Rows of per-request buffers: every request slot and the padding request."""
        return self.max_reqs + 1

    @property
    def cache_pages(self) -> int:
        """Pages of per-token buffers: every allocatable page and the scratch page
        (`SlotTable`: positions no request reserved, the padding request's included)."""
        return self.num_pages + 1
