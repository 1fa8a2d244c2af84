# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V4 cache buffers, one set per attention layer.

Storage kinds (transformers' `modeling_deepseek_v4.py` keeps the same state in
`DeepseekV4CSACache` / `DeepseekV4HCACache`): a sliding-window KV ring of `swa_ring` rows
per request slot, longer than the window by the most tokens one verify or draft pass writes;
compressor state rows `[kv | gate + ape]` (fp32) in a ring of `state_ring(ratio)` rows per
request slot; compressed KV and indexer keys, full history, one row per block of `ratio`
positions, addressed from the token slot of the block's first position (`compressed_loc`),
so it shares the token pages and is freed with them.

Rows are keyed by position everywhere, so rolling back speculative tokens needs no copy.
Every buffer also holds the padding request's ring rows and the scratch page's rows
(`PoolGeometry.req_slots`, `cache_pages`): padding rows, positions past a reservation and
entries that close no block (`trash_row`) are written there, and no emitted row reads them.
Layouts: docs/architecture.md, section 4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.cache.deepseek_v4_metadata import (
    DeepseekV4UniformMetadata,
    EntryCount,
    compressor_overlap,
    prepare_metadata,
    uniform_metadata_torch,
)
from runtime.cache.pool_geometry import PoolGeometry
from runtime.cache.state_snapshots import RequestStateSnapshots
from runtime.core.forward_context import ForwardContext

__all__ = ["DeepseekV4CacheLayout", "DeepseekV4KVPool", "compressor_overlap"]


@dataclass(frozen=True)
class DeepseekV4CacheLayout:
    """What one model's layers need; `compress_ratios[i]` is 0 for window-only layers."""

    compress_ratios: tuple[int, ...]
    head_dim: int
    index_head_dim: int
    sliding_window: int
    # the CSA layers' ratio: layers with it carry the lightning indexer, and their
    # compressor windows overlap (HCA layers must use another ratio)
    indexer_ratio: int = 4

    def is_sparse(self, ratio: int) -> bool:
        """Whether `ratio` is the CSA layers' (indexer, overlapping compressor windows)."""
        return ratio == self.indexer_ratio

    def has_indexer(self, layer: int) -> bool:
        return self.is_sparse(self.compress_ratios[layer])


class DeepseekV4KVPool(RequestStateSnapshots):
    def __init__(self, layout: DeepseekV4CacheLayout, geometry: PoolGeometry):
        dtype, device = geometry.dtype, geometry.device
        self.layout, self.max_reqs, self.page_size = layout, geometry.max_reqs, geometry.page_size
        self.num_pages, self.dtype, self.device = geometry.num_pages, dtype, device
        self.req_slots, self.cache_pages = geometry.req_slots, geometry.cache_pages
        self.swa_ring = layout.sliding_window + geometry.max_tokens_per_pass
        self.max_pass = geometry.max_tokens_per_pass
        self.swa_kv = [
            torch.zeros(
                (self.req_slots * self.swa_ring, layout.head_dim), dtype=dtype, device=device
            )
            for _ in layout.compress_ratios
        ]
        self.compressor_state: dict[int, torch.Tensor] = {}
        self.compressed_kv: dict[int, torch.Tensor] = {}
        self.indexer_state: dict[int, torch.Tensor] = {}
        self.indexer_k: dict[int, torch.Tensor] = {}
        for layer, ratio in enumerate(layout.compress_ratios):
            if ratio <= 1:
                continue
            self.compressor_state[layer] = self._state_buffer(ratio, layout.head_dim)
            self.compressed_kv[layer] = self._compressed_buffer(ratio, layout.head_dim, dtype)
            if layout.has_indexer(layer):
                self.indexer_state[layer] = self._state_buffer(ratio, layout.index_head_dim)
                self.indexer_k[layer] = self._compressed_buffer(ratio, layout.index_head_dim, dtype)

    # per-forward metadata -----------------------------------------------------------------
    capturable = True  # uniform batches have fixed-shape metadata (`prepare`)

    def prepare(self, ctx: ForwardContext, entries: EntryCount | None = None):
        """The addressing every layer of this forward reads (`deepseek_v4_metadata`);
        `entries(ratio, needed)` pads the compressed entry count of a uniform batch."""
        return prepare_metadata(ctx, self, entries)

    def prepare_in_step(
        self, ctx: ForwardContext, like: DeepseekV4UniformMetadata
    ) -> DeepseekV4UniformMetadata:
        """The uniform addressing of `ctx`, built inside a captured step from its tensors
        (positions computed in the step; torch ops only), laid out with the entry counts of
        `like`, metadata the same step received (whose counts cover `ctx`'s positions)."""
        return uniform_metadata_torch(ctx, self, lambda ratio, _: like.compress[ratio].num_entries)

    # geometry -----------------------------------------------------------------------------
    @property
    def ratios(self) -> list[int]:
        """The compress ratios some layer uses, ascending."""
        return sorted({r for r in self.layout.compress_ratios if r > 1})

    def overlap(self, ratio: int) -> int:
        """Blocks pooled per entry at `ratio`: the CSA layers' ratio overlaps."""
        return compressor_overlap(self.layout.is_sparse(ratio))

    def state_ring(self, ratio: int) -> int:
        return self.overlap(ratio) * ratio + self.max_pass

    def compressed_rows_per_page(self, ratio: int) -> int:
        return -(-self.page_size // ratio)

    def _state_buffer(self, ratio: int, dim: int) -> torch.Tensor:
        width = 2 * self.overlap(ratio) * dim
        return torch.zeros(
            (self.req_slots * self.state_ring(ratio), width),
            dtype=torch.float32,
            device=self.device,
        )

    def _compressed_buffer(self, ratio: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
        rows = self.cache_pages * self.compressed_rows_per_page(ratio)
        return torch.zeros((rows, dim), dtype=dtype, device=self.device)

    # addressing ---------------------------------------------------------------------------
    def swa_loc(self, req_pool_indices: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return req_pool_indices * self.swa_ring + positions % self.swa_ring

    def state_loc(
        self, ratio: int, req_pool_indices: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        ring = self.state_ring(ratio)
        return req_pool_indices * ring + positions % ring

    def compressed_loc(self, ratio: int, block_first_slot: torch.Tensor) -> torch.Tensor:
        """Row of a compressed entry from the token slot of its block's first position."""
        page, offset = block_first_slot // self.page_size, block_first_slot % self.page_size
        return page * self.compressed_rows_per_page(ratio) + offset // ratio

    def trash_row(self, ratio: int) -> int:
        """A compressed row of the scratch page: where writes that must go nowhere land."""
        return self.num_pages * self.compressed_rows_per_page(ratio)

    def commit_verified(self, req_pool_indices, num_accepted) -> None:
        """Nothing to do: every V4 cache row is keyed by position (see the module docstring)."""

    # prefix cache -------------------------------------------------------------------------
    def share_alignment(self) -> int:
        """Shared prefixes end on a block boundary of every compress ratio: an entry is
        written when its block closes, into the page of the block's first position, so a
        block straddling the end of a shared page range would be written into a shared page
        by whichever request continues it."""
        ratios = [r for r in self.layout.compress_ratios if r > 1]
        return math.lcm(*ratios) if ratios else 1

    def request_state(self, req_pool_idx: int, verify_row: int | None = None) -> list:
        """Views of everything kept per request rather than per token slot: the window ring
        and the compressor / indexer state rings. Every row is keyed by position, so the
        rows of the last verify pass need no special case (`verify_row` is unused)."""
        del verify_row
        views = [self._ring_rows(buf, self.swa_ring, req_pool_idx) for buf in self.swa_kv]
        for states in (self.compressor_state, self.indexer_state):
            for layer, buf in states.items():
                ring = self.state_ring(self.layout.compress_ratios[layer])
                views.append(self._ring_rows(buf, ring, req_pool_idx))
        return views

    @staticmethod
    def _ring_rows(buf: torch.Tensor, ring: int, req_pool_idx: int) -> torch.Tensor:
        return buf[req_pool_idx * ring : (req_pool_idx + 1) * ring]

    def copy_pages(self, src_pages: list[int], dst_pages: list[int]) -> None:
        """Copy the rows stored per token page (compressed KV, indexer keys) page by page."""
        for group in (self.compressed_kv, self.indexer_k):
            for layer, buf in group.items():
                rows = self.compressed_rows_per_page(self.layout.compress_ratios[layer])
                buf[self._page_rows(dst_pages, rows)] = buf[self._page_rows(src_pages, rows)]

    def _page_rows(self, pages: list[int], rows: int) -> torch.Tensor:
        base = torch.tensor(pages, dtype=torch.long, device=self.device) * rows
        return (base.unsqueeze(1) + torch.arange(rows, device=self.device)).flatten()

    # reporting ----------------------------------------------------------------------------
    def nbytes(self) -> int:
        buffers = [
            *self.swa_kv,
            *self.compressor_state.values(),
            *self.compressed_kv.values(),
            *self.indexer_state.values(),
            *self.indexer_k.values(),
        ]
        return sum(b.numel() * b.element_size() for b in buffers)

    def describe(self) -> str:
        ratios = sorted({r for r in self.layout.compress_ratios if r > 1})
        return (
            f"DeepSeek-V4 cache: {len(self.layout.compress_ratios)} layers, SWA ring "
            f"{self.swa_ring} rows x {self.max_reqs} requests, compress ratios {ratios}, "
            f"{self.nbytes() / 2**20:.1f} MiB"
        )
