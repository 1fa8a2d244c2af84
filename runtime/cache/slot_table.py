# SPDX-License-Identifier: Apache-2.0
"""Which token slots each request holds: request slots + paged token allocator together.

`reserve(req, n)` makes positions `[0, n)` addressable (whole pages), `slots(req, a, b)`
returns their slots, `release(req)` gives everything back. Invariants:

* a position keeps its slot for the request's lifetime, so a rejected speculative token
  rewritten at the same position reuses the same slot;
* every position past a reservation points into the scratch page (the page after the
  allocator's last, held by the pools, owned by no request), so speculative rows past what
  a request can commit, and the padding request (`ReqToTokenPool.pad_req`, which reserves
  nothing), read and write only there;
* with a prefix cache a request's leading pages may be *borrowed* (`open_request
  (prefix_pages)`, `share_prefix`): a request never writes a borrowed page, and `release`
  frees only the pages the request owns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from runtime.cache.allocator import PagedTokenAllocator
from runtime.cache.req_to_token_pool import ReqToTokenPool


class SlotTable:
    def __init__(self, req_pool: ReqToTokenPool, allocator: PagedTokenAllocator):
        self.req_pool, self.allocator = req_pool, allocator
        self.page_size = allocator.page_size
        self._pages: dict[int, list[int]] = {}
        self._borrowed: dict[int, int] = {}  # leading pages the request does not own
        self._point_at_scratch(req_pool.pad_req, 0)  # the padding request reserves nothing

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_pool.req_to_token

    @property
    def scratch_page(self) -> int:
        """The page past the allocator's last one (see the module docstring)."""
        return self.allocator.num_pages

    def scratch_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Scratch slots of `positions`, each at its offset `p % page_size` as in a page."""
        return self.scratch_page * self.page_size + positions % self.page_size

    def open_request(self, prefix_pages: Sequence[int] = ()) -> int | None:
        """A request slot whose first pages are the borrowed `prefix_pages`, or None when
        every request slot is taken."""
        idx = self.req_pool.alloc()
        if idx is not None:
            self._pages[idx], self._borrowed[idx] = [], 0
            self._point_at_scratch(idx, 0)
            self.share_prefix(idx, prefix_pages)
        return idx

    def _point_at_scratch(self, req_pool_idx: int, start: int) -> None:
        row = self.req_to_token[req_pool_idx]
        positions = torch.arange(start, row.shape[0], device=row.device)
        row[start:] = self.scratch_slots(positions)

    def pages(self, req_pool_idx: int) -> list[int]:
        """The request's pages in position order (borrowed ones first)."""
        return list(self._pages[req_pool_idx])

    def borrowed_pages(self, req_pool_idx: int) -> int:
        return self._borrowed[req_pool_idx]

    def share_prefix(self, req_pool_idx: int, pages: Sequence[int]) -> list[int]:
        """Make `pages` the request's leading, borrowed pages (they hold the same positions'
        contents). Returns the owned pages they replace (duplicates for the caller to free);
        a page handed over to the cache appears in `pages` and is not returned."""
        owned, replaced = self._pages[req_pool_idx], []
        for i, page in enumerate(pages):
            if i == len(owned):
                owned.append(page)
            elif owned[i] != page:
                if i >= self._borrowed[req_pool_idx]:
                    replaced.append(owned[i])
                owned[i] = page
        if pages:
            self._write_slots(req_pool_idx, 0, list(pages))
            self._borrowed[req_pool_idx] = max(self._borrowed[req_pool_idx], len(pages))
        return replaced

    def reserved_tokens(self, req_pool_idx: int) -> int:
        return len(self._pages[req_pool_idx]) * self.page_size

    def pages_needed(self, req_pool_idx: int, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(self._pages[req_pool_idx]))

    def reserve(self, req_pool_idx: int, num_tokens: int) -> bool:
        """Make positions `[0, num_tokens)` addressable; False (nothing taken) if out of pages."""
        if num_tokens > self.req_pool.max_context_len:
            raise ValueError(
                f"{num_tokens} tokens exceed the context length {self.req_pool.max_context_len}"
            )
        need = self.pages_needed(req_pool_idx, num_tokens)
        if need == 0:
            return True
        new_pages = self.allocator.alloc_pages(need)
        if new_pages is None:
            return False
        owned = self._pages[req_pool_idx]
        first = len(owned)
        owned.extend(new_pages)
        self._write_slots(req_pool_idx, first, new_pages)
        return True

    def _write_slots(self, req_pool_idx: int, first_page: int, pages: list[int]) -> None:
        start = first_page * self.page_size
        slots = self.allocator.page_slots(pages)
        end = min(start + slots.shape[0], self.req_pool.max_context_len)
        self.req_to_token[req_pool_idx, start:end] = slots[: end - start]

    def slots(self, req_pool_idx: int, start: int, end: int) -> torch.Tensor:
        if end > self.reserved_tokens(req_pool_idx):
            raise ValueError(
                f"positions up to {end} requested but only "
                f"{self.reserved_tokens(req_pool_idx)} reserved"
            )
        return self.req_to_token[req_pool_idx, start:end]

    def release(self, req_pool_idx: int, keep: Iterable[int] = ()) -> None:
        """Free the request slot and the pages it owns, except those in `keep` (handed to
        the caller, e.g. a prefix cache); borrowed pages stay with their owner."""
        pages = self._pages.pop(req_pool_idx)
        borrowed = self._borrowed.pop(req_pool_idx)
        kept = set(keep)
        self.allocator.free_pages([p for p in pages[borrowed:] if p not in kept])
        self.req_pool.free(req_pool_idx)

    def trim(self, req_pool_idx: int, keep_tokens: int) -> None:
        """Give back whole pages past `keep_tokens` (e.g. after rejected speculative tokens)."""
        owned = self._pages[req_pool_idx]
        keep_pages = max(-(-keep_tokens // self.page_size), self._borrowed[req_pool_idx])
        if keep_pages < len(owned):
            self.allocator.free_pages(owned[keep_pages:])
            del owned[keep_pages:]
            self._point_at_scratch(req_pool_idx, keep_pages * self.page_size)
