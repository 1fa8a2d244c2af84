# SPDX-License-Identifier: Apache-2.0
"""Per-forward addressing of the DeepSeek-V4 caches, built before the forward runs.

The runner calls `DeepseekV4KVPool.prepare(ctx)` once per forward (SGLang's attention
backends split `init_forward_metadata` from the forward the same way); every layer then
reads the same index tensors. Two layouts:

* `DeepseekV4UniformMetadata`: every request runs the same `q` rows, at most the rings'
  speculative slack; every tensor's shape is fixed by `(bs, q)` and the per-ratio entry
  count `C` (padded and marked dynamic by the graph runner), so a captured step replays it.
* `DeepseekV4RaggedMetadata`: prefill chunks of any length (eager), keys from the virtual
  buffer `[ring | this forward's rows]` (`runtime.cache.ring_access`), queries in tiles of
  up to `TILE_ROWS` rows of one request.

Both carry, per compressed ratio, the entry count each row's indexer top-k runs over as
transformers does (`runtime.kernels.indexer_topk`). Details: docs/captured_decode.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from runtime.cache.ring_access import RingAccess, ring_access
from runtime.core.forward_context import ForwardContext
from runtime.core.forward_mode import ForwardMode

TILE_ROWS = 32  # prefill rows sharing one gathered key window (see tiled_sink_attention)

EntryCount = Callable[[int, int], int]  # (ratio, entries needed) -> entries laid out


def compressor_overlap(sparse: bool) -> int:
    """Blocks pooled per compressed entry: a CSA (sparse) entry's window overlaps the
    previous block; an HCA entry pools its own block alone."""
    return 2 if sparse else 1


def topk_lengths(ctx: ForwardContext, ratio: int, visible: torch.Tensor) -> torch.Tensor:
    """`[T]` entries each row's indexer top-k runs over (see the module docstring)."""
    if ctx.forward_mode.is_extend():
        return (ctx.seq_lens // ratio)[ctx.token_to_req]
    return visible


# ---------------------------------------------------------------------------------------
# Uniform rows (decode, verify, draft): fixed shapes
# ---------------------------------------------------------------------------------------


@dataclass
class UniformWindow:
    """The sliding window of each request's `q` rows: one shared key list per request."""

    write: torch.Tensor  # [N] ring row of every new row
    read: torch.Tensor  # [bs, W + q - 1] ring rows of the request's key positions
    valid: torch.Tensor  # [bs, q, W + q - 1] key visible to the row: p - W < key <= p


@dataclass
class UniformCompress:
    """One compress ratio's addressing, shared by every layer (and indexer) of that ratio."""

    ratio: int
    state_write: torch.Tensor  # [N] state-ring row of every new row
    state_read: torch.Tensor  # [N, overlap * ratio] state rows of the block(s) ending at the row
    state_valid: torch.Tensor  # [N, overlap * ratio] position >= 0
    entry_pos: torch.Tensor  # [N] first position of the row's block (the entry's rope position)
    entry_write: torch.Tensor  # [N] compressed row of the entry the row closes, or `trash_row`
    entry_rows: torch.Tensor  # [bs, C] compressed rows of the request's entries 0..C-1
    visible: torch.Tensor  # [N] entries complete at the row: (p + 1) // ratio
    entry_visible: torch.Tensor  # [N, C] entry j < visible
    topk_len: torch.Tensor  # [N] entries the row's indexer top-k runs over

    @property
    def num_entries(self) -> int:
        return self.entry_rows.shape[1]


@dataclass
class DeepseekV4UniformMetadata:
    rows_per_req: int
    positions: torch.Tensor  # [N]
    window: UniformWindow
    compress: dict[int, UniformCompress]

    @property
    def num_reqs(self) -> int:
        return self.window.read.shape[0]

    def dynamic_dims(self) -> list[tuple[torch.Tensor, int]]:
        """(tensor, dim) pairs that grow with the context (the entry count `C`)."""
        return [
            pair
            for access in self.compress.values()
            for pair in ((access.entry_rows, 1), (access.entry_visible, 1))
        ]


def entries_needed(ctx: ForwardContext, ratio: int) -> int:
    """Entries of the longest request at the end of the forward (at least one; one for a
    context built inside a captured step, whose entry count comes from its caller)."""
    if ctx.prefix_lens_cpu is None:
        return 1
    return max(1, max(ctx.seq_lens_cpu, default=0) // ratio)


def uniform_metadata(
    ctx: ForwardContext, pool, entries: EntryCount | None = None
) -> DeepseekV4UniformMetadata:
    """`entries(ratio, needed)`: the entry count `C` to lay out for a batch whose longest
    request has `needed` entries (default: exactly those). On CPU the index math runs in
    numpy (a few hundred microseconds of torch per-op cost saved per step; the same values
    as `uniform_metadata_torch`, which other devices use)."""
    if ctx.device.type != "cpu":
        return uniform_metadata_torch(ctx, pool, entries)
    bs, q = ctx.batch_size, ctx.extend_lens_cpu[0]
    slots = ctx.req_pool_indices.numpy()
    positions = ctx.positions.numpy()
    req_to_token = ctx.req_to_token.numpy()
    row_slot = np.repeat(slots, q)
    pos = positions.reshape(bs, q)

    window, ring = pool.layout.sliding_window, pool.swa_ring
    key_pos = pos[:, -1:] - np.arange(window + q - 2, -1, -1)  # [bs, Kw]
    keys, row_pos = key_pos[:, None, :], pos[:, :, None]
    swa = UniformWindow(
        _tensor(row_slot * ring + positions % ring),
        _tensor(slots[:, None] * ring + np.maximum(key_pos, 0) % ring),
        _tensor((keys >= 0) & (keys <= row_pos) & (keys > row_pos - window)),
    )
    compress = {}
    for ratio in pool.ratios:
        span, sring = pool.overlap(ratio) * ratio, pool.state_ring(ratio)
        state_pos = positions[:, None] - np.arange(span - 1, -1, -1)
        entry_pos = positions // ratio * ratio
        loc = _compressed_loc(pool, ratio)
        closes = (positions + 1) % ratio == 0
        count = entries_needed(ctx, ratio)
        if entries is not None:
            count = entries(ratio, count)
        starts = np.minimum(np.arange(count) * ratio, req_to_token.shape[1] - 1)
        visible = (positions + 1) // ratio
        compress[ratio] = UniformCompress(
            ratio=ratio,
            state_write=_tensor(row_slot * sring + positions % sring),
            state_read=_tensor(row_slot[:, None] * sring + np.maximum(state_pos, 0) % sring),
            state_valid=_tensor(state_pos >= 0),
            entry_pos=_tensor(entry_pos),
            entry_write=_tensor(
                np.where(closes, loc(req_to_token[row_slot, entry_pos]), pool.trash_row(ratio))
            ),
            entry_rows=_tensor(loc(req_to_token[slots[:, None], starts])),
            visible=_tensor(visible),
            entry_visible=_tensor(np.arange(count) < visible[:, None]),
            topk_len=_tensor(
                (np.asarray(ctx.seq_lens_cpu) // ratio).repeat(q)
                if ctx.forward_mode.is_extend()
                else visible
            ),
        )
    return DeepseekV4UniformMetadata(q, ctx.positions, swa, compress)


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def _compressed_loc(pool, ratio: int):
    """`pool.compressed_loc` on numpy arrays."""
    rows_per_page, page_size = pool.compressed_rows_per_page(ratio), pool.page_size

    def loc(first_slot: np.ndarray) -> np.ndarray:
        return first_slot // page_size * rows_per_page + first_slot % page_size // ratio

    return loc


def uniform_metadata_torch(
    ctx: ForwardContext, pool, entries: EntryCount | None = None
) -> DeepseekV4UniformMetadata:
    """The same metadata in torch ops, on the context's device."""
    bs, q = ctx.batch_size, ctx.extend_lens_cpu[0]
    device, slots = ctx.device, ctx.req_pool_indices
    positions = ctx.positions
    row_slot = slots.repeat_interleave(q)
    pos = positions.view(bs, q)

    window, ring = pool.layout.sliding_window, pool.swa_ring
    width = window + q - 1
    key_pos = pos[:, -1:] - torch.arange(width - 1, -1, -1, device=device)  # [bs, Kw]
    read = slots.unsqueeze(1) * ring + key_pos.clamp(min=0) % ring
    row_pos, keys = pos.unsqueeze(2), key_pos.unsqueeze(1)
    valid = (keys >= 0) & (keys <= row_pos) & (keys > row_pos - window)
    swa = UniformWindow(row_slot * ring + positions % ring, read, valid)

    compress = {}
    for ratio in pool.ratios:
        span, sring = pool.overlap(ratio) * ratio, pool.state_ring(ratio)
        state_pos = positions.unsqueeze(1) - torch.arange(span - 1, -1, -1, device=device)
        entry_pos = positions // ratio * ratio
        first_slot = ctx.req_to_token[row_slot, entry_pos]
        closes = (positions + 1) % ratio == 0
        count = entries_needed(ctx, ratio)
        if entries is not None:
            count = entries(ratio, count)
        starts = (torch.arange(count, device=device) * ratio).clamp(
            max=ctx.req_to_token.shape[1] - 1
        )
        visible = (positions + 1) // ratio
        compress[ratio] = UniformCompress(
            ratio=ratio,
            state_write=row_slot * sring + positions % sring,
            state_read=row_slot.unsqueeze(1) * sring + state_pos.clamp(min=0) % sring,
            state_valid=state_pos >= 0,
            entry_pos=entry_pos,
            entry_write=torch.where(
                closes, pool.compressed_loc(ratio, first_slot), pool.trash_row(ratio)
            ),
            entry_rows=pool.compressed_loc(ratio, ctx.req_to_token[slots.unsqueeze(1), starts]),
            visible=visible,
            entry_visible=torch.arange(count, device=device) < visible.unsqueeze(1),
            topk_len=topk_lengths(ctx, ratio, visible),
        )
    return DeepseekV4UniformMetadata(q, positions, swa, compress)


# ---------------------------------------------------------------------------------------
# Ragged rows (prefill chunks)
# ---------------------------------------------------------------------------------------


@dataclass
class QueryTiles:
    """Consecutive rows of one request, `TILE_ROWS` at most per tile (decode: one row each).
    A tile's keys are gathered once for all its rows."""

    rows: torch.Tensor  # [N, R] input rows of each tile; `num_tokens` pads a short tile
    row_slot: torch.Tensor  # [T] each row's index in the flattened [N * R] layout
    row_pos: torch.Tensor  # [N, R] position of each tile row, -1 for padding
    last_row: torch.Tensor  # [N] last real row of each tile
    req: torch.Tensor  # [N] batch index of each tile


@dataclass
class WindowAccess:
    ring: RingAccess  # reads: each tile's key positions; writes: the window ring
    valid: torch.Tensor  # [N, R, W + R - 1] key visible to the tile row: p - window < k <= p


@dataclass
class CompressAccess:
    """One compress ratio's per-forward addressing, shared by every layer of that ratio."""

    ratio: int
    state: RingAccess  # reads: the pooled rows of each new entry's window
    boundary_rows: torch.Tensor  # [B] rows whose position closes a block
    entry_pos: torch.Tensor  # [B] first position of each new entry's block (its rope position)
    entry_loc: torch.Tensor  # [B] compressed-pool row of each new entry
    req_loc: torch.Tensor  # [bs, C] compressed-pool rows of each request's entries
    read_loc: torch.Tensor  # [T, C] the entries each row may see (its request's)
    read_valid: torch.Tensor  # [T, C] entry j visible to a row at p iff j < (p + 1) // ratio
    tile_valid: torch.Tensor  # [N, R, C] the same for each query tile row
    visible: torch.Tensor  # [T] entries complete at each row
    topk_len: torch.Tensor  # [T] entries each row's indexer top-k runs over


@dataclass
class DeepseekV4RaggedMetadata:
    tiles: QueryTiles
    window: WindowAccess
    compress: dict[int, CompressAccess]


def query_tiles(ctx: ForwardContext) -> QueryTiles:
    device, lens = ctx.device, ctx.extend_lens
    tile_len = max(1, min(TILE_ROWS, max(ctx.extend_lens_cpu, default=1)))
    per_req = (lens + tile_len - 1) // tile_len
    first_tile = torch.cumsum(per_req, 0) - per_req
    req = torch.repeat_interleave(torch.arange(ctx.batch_size, device=device), per_req)
    start = (
        ctx.extend_start_loc[req]
        + (torch.arange(req.numel(), device=device) - first_tile[req]) * tile_len
    )
    end = torch.minimum(start + tile_len, ctx.extend_start_loc[req] + lens[req])
    rows = start.unsqueeze(1) + torch.arange(tile_len, device=device)
    rows = torch.where(rows < end.unsqueeze(1), rows, ctx.num_tokens)
    offset = torch.arange(ctx.num_tokens, device=device) - ctx.extend_start_loc[ctx.token_to_req]
    row_slot = (first_tile[ctx.token_to_req] + offset // tile_len) * tile_len + offset % tile_len
    row_pos = torch.cat([ctx.positions, ctx.positions.new_full((1,), -1)])[rows]
    return QueryTiles(rows, row_slot, row_pos, end - 1, req)


def window_access(ctx: ForwardContext, pool, tiles: QueryTiles) -> WindowAccess:
    """Sliding-window keys of every tile: its rows read positions `p - window + 1 .. p`.
    A tile reads the `W + R - 1` positions ending at its last row, or fewer when no request
    is that long yet: `[last - width + 1, last]` still covers every key its rows see from
    position 0 (a prompt shorter than the window attends over its own length, not the
    window's)."""
    window = pool.layout.sliding_window
    width = min(window + tiles.rows.shape[1] - 1, max(ctx.seq_lens_cpu, default=1))
    offsets = torch.arange(width - 1, -1, -1, device=ctx.device)
    key_pos = ctx.positions[tiles.last_row].unsqueeze(1) - offsets
    ring = ring_access(ctx, tiles.last_row, key_pos, pool.swa_ring, pool.swa_kv[0].shape[0])
    row_pos, key_pos = tiles.row_pos.unsqueeze(2), key_pos.unsqueeze(1)
    valid = (key_pos >= 0) & (key_pos <= row_pos) & (key_pos > row_pos - window)
    return WindowAccess(ring, valid)


def compress_access(ctx: ForwardContext, pool, ratio: int, tiles: QueryTiles) -> CompressAccess:
    device, pos = ctx.device, ctx.positions
    boundary_rows = ((pos + 1) % ratio == 0).nonzero().squeeze(1)
    span = pool.overlap(ratio) * ratio
    key_pos = pos[boundary_rows].unsqueeze(1) - torch.arange(span - 1, -1, -1, device=device)
    ring = pool.state_ring(ratio)
    state = ring_access(ctx, boundary_rows, key_pos, ring, pool.req_slots * ring)

    req_slots = ctx.req_pool_indices
    entry_pos = pos[boundary_rows] // ratio * ratio
    first_slot = ctx.req_to_token[req_slots[ctx.token_to_req[boundary_rows]], entry_pos]
    entry_loc = pool.compressed_loc(ratio, first_slot)

    num_entries = max(ctx.seq_lens_cpu) // ratio if ctx.batch_size else 0
    block_starts = torch.arange(num_entries, device=device) * ratio
    loc_per_req = pool.compressed_loc(ratio, ctx.req_to_token[req_slots.unsqueeze(1), block_starts])
    entries = torch.arange(num_entries, device=device)
    visible = (pos + 1) // ratio
    row_pos = tiles.row_pos.unsqueeze(2)
    return CompressAccess(
        ratio,
        state,
        boundary_rows,
        entry_pos,
        entry_loc,
        loc_per_req,
        loc_per_req[ctx.token_to_req],
        entries < visible.unsqueeze(1),
        entries < torch.div(row_pos + 1, ratio, rounding_mode="floor"),
        visible,
        topk_lengths(ctx, ratio, visible),
    )


def ragged_metadata(ctx: ForwardContext, pool) -> DeepseekV4RaggedMetadata:
    tiles = query_tiles(ctx)
    return DeepseekV4RaggedMetadata(
        tiles,
        window_access(ctx, pool, tiles),
        {ratio: compress_access(ctx, pool, ratio, tiles) for ratio in pool.ratios},
    )


# ---------------------------------------------------------------------------------------


def is_uniform(ctx: ForwardContext, max_rows_per_req: int) -> bool:
    """Every request runs the same number of rows, within the rings' slack."""
    lens = ctx.extend_lens_cpu
    return bool(lens) and 1 <= lens[0] <= max_rows_per_req and lens.count(lens[0]) == len(lens)


def prepare_metadata(
    ctx: ForwardContext, pool, entries: EntryCount | None = None
) -> DeepseekV4UniformMetadata | DeepseekV4RaggedMetadata:
    if ctx.forward_mode is not ForwardMode.EXTEND and is_uniform(ctx, pool.max_pass):
        return uniform_metadata(ctx, pool, entries)
    return ragged_metadata(ctx, pool)
