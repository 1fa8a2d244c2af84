# SPDX-License-Identifier: Apache-2.0
"""Full-history token slots handed out a page at a time.

Slot `s` lives in page `s // page_size`. A request owns whole pages, so position `p` of
a request always sits at offset `p % page_size` of its `p // page_size`-th page; caches
that store one entry per block of positions (compressed KV) derive their row from that.

The caches hold one page more than the allocator hands out, page `num_pages`: the scratch
page (`SlotTable`), where positions nobody reserved point, the padding request of captured
steps included (as SGLang reserves slot 0 for padding).
"""

from __future__ import annotations

import torch


class PagedTokenAllocator:
    def __init__(self, num_pages: int, page_size: int, device: torch.device | str = "cpu"):
        if page_size < 1 or num_pages < 1:
            raise ValueError(
                f"need at least one page of at least one slot (pages={num_pages}, "
                f"page_size={page_size})"
            )
        self.num_pages, self.page_size, self.device = num_pages, page_size, device
        self._free_pages = list(range(num_pages - 1, -1, -1))

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def available_pages(self) -> int:
        return len(self._free_pages)

    def available_tokens(self) -> int:
        return len(self._free_pages) * self.page_size

    def alloc_pages(self, count: int) -> list[int] | None:
        """`count` free pages, or None (nothing taken) when there are not enough."""
        if count > len(self._free_pages):
            return None
        pages = self._free_pages[len(self._free_pages) - count :]
        del self._free_pages[len(self._free_pages) - count :]
        return pages

    def free_pages(self, pages: list[int]) -> None:
        self._free_pages.extend(pages)

    def page_slots(self, pages: list[int]) -> torch.Tensor:
        """All slots of `pages`, page by page: `[len(pages) * page_size]`."""
        base = torch.tensor(pages, dtype=torch.long, device=self.device) * self.page_size
        offsets = torch.arange(self.page_size, device=self.device)
        return (base.unsqueeze(1) + offsets).flatten()
