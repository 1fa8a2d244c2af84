# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V4 attention: sliding window + compressed KV (CSA with the lightning indexer,
or HCA), single-latent MQA with an attention sink and a grouped output projection.

Math: transformers' `models/deepseek_v4/modeling_deepseek_v4.py` (`DeepseekV4Attention`,
`DeepseekV4CSACompressor`, `DeepseekV4HCACompressor`, `DeepseekV4Indexer`). Caches:
`runtime.cache.deepseek_v4_pool`.

Window keys and compressor state rows live in position-keyed rings (`position_ring`);
their gather indices are built once per forward (`ctx.memo`) and shared by all layers.

Under tensor parallelism the query heads split over `tp` together with their sinks and
their output groups (`wo_a` by group, `wo_b` reducing); the single KV latent, the
compressors and the indexer are replicated, as SGLang does for MLA's latent, so every rank
keeps the whole (small) KV cache and selects the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.cache.deepseek_v4_pool import DeepseekV4KVPool, compressor_overlap
from runtime.core.forward_context import ForwardContext
from runtime.distributed import ParallelGroup
from runtime.kernels.sink_attention import tiled_scores, tiled_sink_attention
from runtime.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from runtime.layers.norm import RMSNorm, WeightlessRMSNorm
from runtime.layers.position_ring import RingAccess, gather_ring, ring_access
from runtime.layers.rotary import RotaryEmbedding
from runtime.layers.weight_utils import make_param, sharded_param


@dataclass
class RopeInputs:
    """A rotary table and its cos/sin at the forward's positions (computed once per forward)."""

    rope: RotaryEmbedding
    cos: torch.Tensor
    sin: torch.Tensor

    def apply(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return self.rope.apply(x, self.cos, self.sin, inverse=inverse)


# ---------------------------------------------------------------------------------------
# Per-forward metadata
# ---------------------------------------------------------------------------------------


TILE_ROWS = 32  # prefill rows sharing one gathered key window (see tiled_sink_attention)


@dataclass
class QueryTiles:
    """Consecutive rows of one request, `TILE_ROWS` at most per tile (decode: one row each).
    A tile's keys are gathered once for all its rows."""

    rows: torch.Tensor  # [N, R] input rows of each tile; `num_tokens` pads a short tile
    row_slot: torch.Tensor  # [T] each row's index in the flattened [N * R] layout
    row_pos: torch.Tensor  # [N, R] position of each tile row, -1 for padding
    last_row: torch.Tensor  # [N] last real row of each tile
    req: torch.Tensor  # [N] batch index of each tile


def query_tiles(ctx: ForwardContext) -> QueryTiles:
    def build() -> QueryTiles:
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
        offset = (
            torch.arange(ctx.num_tokens, device=device) - ctx.extend_start_loc[ctx.token_to_req]
        )
        row_slot = (
            first_tile[ctx.token_to_req] + offset // tile_len
        ) * tile_len + offset % tile_len
        row_pos = torch.cat([ctx.positions, ctx.positions.new_full((1,), -1)])[rows]
        return QueryTiles(rows, row_slot, row_pos, end - 1, req)

    return ctx.memo("v4.tiles", build)


@dataclass
class WindowAccess:
    ring: RingAccess  # reads: each tile's key positions; writes: the window ring
    valid: torch.Tensor  # [N, R, W + R - 1] key visible to the tile row: p - window < k <= p


def window_access(ctx: ForwardContext, pool: DeepseekV4KVPool, window: int) -> WindowAccess:
    """Sliding-window keys of every tile: its rows read positions `p - window + 1 .. p`."""

    def build() -> WindowAccess:
        tiles = query_tiles(ctx)
        width = window + tiles.rows.shape[1] - 1
        offsets = torch.arange(width - 1, -1, -1, device=ctx.device)
        key_pos = ctx.positions[tiles.last_row].unsqueeze(1) - offsets
        ring = ring_access(ctx, tiles.last_row, key_pos, pool.swa_ring, pool.swa_kv[0].shape[0])
        row_pos, key_pos = tiles.row_pos.unsqueeze(2), key_pos.unsqueeze(1)
        valid = (key_pos >= 0) & (key_pos <= row_pos) & (key_pos > row_pos - window)
        return WindowAccess(ring, valid)

    return ctx.memo("v4.window", build)


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


def compress_access(ctx: ForwardContext, pool: DeepseekV4KVPool, ratio: int) -> CompressAccess:
    def build() -> CompressAccess:
        device, pos = ctx.device, ctx.positions
        boundary_rows = ((pos + 1) % ratio == 0).nonzero().squeeze(1)
        window = compressor_overlap(ratio) * ratio
        key_pos = pos[boundary_rows].unsqueeze(1) - torch.arange(window - 1, -1, -1, device=device)
        ring = pool.state_ring(ratio)
        state = ring_access(ctx, boundary_rows, key_pos, ring, pool.max_reqs * ring)

        req_slots = ctx.req_pool_indices
        entry_pos = pos[boundary_rows] // ratio * ratio
        first_slot = ctx.req_to_token[req_slots[ctx.token_to_req[boundary_rows]], entry_pos]
        entry_loc = pool.compressed_loc(ratio, first_slot)

        num_entries = max(ctx.seq_lens_cpu) // ratio if ctx.batch_size else 0
        block_starts = torch.arange(num_entries, device=device) * ratio
        loc_per_req = pool.compressed_loc(
            ratio, ctx.req_to_token[req_slots.unsqueeze(1), block_starts]
        )
        read_loc = loc_per_req[ctx.token_to_req]
        entries = torch.arange(num_entries, device=device)
        read_valid = entries < ((pos + 1) // ratio).unsqueeze(1)
        row_pos = query_tiles(ctx).row_pos.unsqueeze(2)
        tile_valid = entries < torch.div(row_pos + 1, ratio, rounding_mode="floor")
        return CompressAccess(
            ratio,
            state,
            boundary_rows,
            entry_pos,
            entry_loc,
            loc_per_req,
            read_loc,
            read_valid,
            tile_valid,
        )

    return ctx.memo(f"v4.compress.{ratio}", build)


# ---------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------


class DeepseekV4Compressor(nn.Module):
    """Gated pooling of each block of `ratio` tokens into one `dim`-wide entry (transformers'
    `DeepseekV4CSACompressor` / `DeepseekV4HCACompressor`).

    Ratio 4 pools 8 rows: the previous block's first channel half and this block's second
    half. The per-token `[kv | gate + ape]` rows live in the state ring; an entry is made when
    its block's last token is processed, then RMS-normed and rotated at the block's first
    position.
    """

    def __init__(self, hidden_size: int, dim: int, ratio: int, eps: float):
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, compressor_overlap(ratio)
        width = self.overlap * dim
        self.fused_wkv_wgate = MergedColumnParallelLinear(hidden_size, [width, width])
        self.ape = make_param((ratio, width), torch.float32)
        self.norm = RMSNorm(dim, eps)

    def forward(
        self,
        x: torch.Tensor,
        ctx: ForwardContext,
        access: CompressAccess,
        state_buf: torch.Tensor,
        entry_buf: torch.Tensor,
        rope: RotaryEmbedding,
    ) -> None:
        kv, gate = self.fused_wkv_wgate(x).float().chunk(2, dim=-1)
        state_rows = torch.cat([kv, gate + self.ape[ctx.positions % self.ratio]], dim=-1)
        if access.boundary_rows.numel():
            entries = self._pool(
                gather_ring(state_buf, state_rows, access.state.read_idx), access.state.read_valid
            ).to(x.dtype)
            entries = self.norm(entries)
            cos, sin = rope.cos_sin(access.entry_pos)
            entry_buf[access.entry_loc] = rope.apply(entries, cos, sin).to(entry_buf.dtype)
        write = access.state
        state_buf[write.write_loc] = state_rows[write.write_rows]

    def _pool(self, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`rows [B, overlap*ratio, 2*overlap*dim]` -> entries `[B, dim]` (fp32)."""
        width, d, r = self.overlap * self.dim, self.dim, self.ratio
        kv, gate = rows[..., :width], rows[..., width:]
        if self.overlap == 2:
            kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
            gate = torch.cat([gate[:, :r, :d], gate[:, r:, d:]], dim=1)
        gate = gate.masked_fill(~valid.unsqueeze(-1), float("-inf"))
        return (torch.softmax(gate, dim=1) * kv).sum(dim=1)


class DeepseekV4Indexer(nn.Module):
    """Lightning indexer (transformers' `DeepseekV4Indexer`): scores every visible compressed
    entry per query and keeps the top `index_topk`.

    `score[t, j] = sum_h w[t, h] * relu(q[t, h] . k_j) / sqrt(index_head_dim)` with
    `w = weights_proj(x) / sqrt(index_n_heads)`.
    """

    def __init__(self, config, ratio: int):
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.topk = config.index_topk
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.num_heads, bias=False)
        self.compressor = DeepseekV4Compressor(
            config.hidden_size, self.head_dim, ratio, config.rms_norm_eps
        )

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        ctx: ForwardContext,
        access: CompressAccess,
        state_buf: torch.Tensor,
        key_buf: torch.Tensor,
        rope: RopeInputs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(selected [T, k], valid [T, k])`: positions in each row's entry list."""
        self.compressor(x, ctx, access, state_buf, key_buf, rope.rope)
        num_entries = access.read_loc.shape[1]
        if num_entries == 0:
            empty = access.read_loc.new_zeros((x.shape[0], 0))
            return empty, empty.bool()
        q = rope.apply(self.wq_b(qr).view(-1, self.num_heads, self.head_dim))
        tiles = query_tiles(ctx)
        keys = key_buf[access.req_loc[tiles.req]]  # [N, C, d]: each tile's request's keys
        scores = tiled_scores(q.float(), tiles.rows, tiles.row_slot, keys.float())
        scores = torch.relu(scores) * self.head_dim**-0.5
        weights = self.weights_proj(x).float() * self.num_heads**-0.5
        total = (
            torch.bmm(weights.unsqueeze(1), scores)
            .squeeze(1)
            .masked_fill(~access.read_valid, float("-inf"))
        )
        # Ties are common (relu zeroes whole scores); a stable sort breaks them toward the
        # older entry, the same way whatever the batch looks like (topk's order is unspecified).
        selected = total.sort(dim=-1, descending=True, stable=True).indices[
            :, : min(self.topk, num_entries)
        ]
        return selected, access.read_valid.gather(1, selected)


class DeepseekV4Attention(nn.Module):
    """One V4 attention block. `cache_layer` addresses the layer's buffers in the pool
    (compact: the MTP layer's cache index differs from its checkpoint layer id)."""

    def __init__(
        self,
        config,
        compress_ratio: int,
        cache_layer: int,
        rope: RotaryEmbedding,
        tp: ParallelGroup | None = None,
    ):
        super().__init__()
        tp = tp or ParallelGroup()
        heads, groups = config.num_attention_heads, config.o_groups
        if heads % tp.size or groups % tp.size:
            raise ValueError(
                f"{heads} attention heads in {groups} output groups do not split over "
                f"{tp.size} ranks"
            )
        self.rope = rope  # this layer's table (cos/sin come precomputed per forward)
        self.num_heads, self.head_dim = heads // tp.size, config.head_dim
        self.window, self.eps = config.sliding_window, config.rms_norm_eps
        self.compress_ratio, self.cache_layer = compress_ratio, cache_layer
        self.o_groups, self.o_lora_rank = groups // tp.size, config.o_lora_rank
        self.scale = self.head_dim**-0.5
        self.fused_wqa_wkv = MergedColumnParallelLinear(
            config.hidden_size, [config.q_lora_rank, self.head_dim]
        )
        self.q_norm = RMSNorm(config.q_lora_rank, self.eps)
        self.wq_b = ColumnParallelLinear(config.q_lora_rank, heads * self.head_dim, tp=tp)
        self.q_head_norm = WeightlessRMSNorm(self.eps)
        self.kv_norm = RMSNorm(self.head_dim, self.eps)
        group_in = heads * self.head_dim // groups
        # wo_a's rows are group-major, so a rank's groups are a contiguous block of rows
        self.wo_a = ColumnParallelLinear(group_in, groups * self.o_lora_rank, tp=tp)
        self.wo_b = RowParallelLinear(groups * self.o_lora_rank, config.hidden_size, tp=tp)
        self.attn_sink = sharded_param((heads,), 0, tp.rank, tp.size, torch.float32)
        self.compressor = (
            DeepseekV4Compressor(config.hidden_size, self.head_dim, compress_ratio, self.eps)
            if compress_ratio > 1
            else None
        )
        self.indexer = DeepseekV4Indexer(config, compress_ratio) if compress_ratio == 4 else None

    # `project` and `output` are pure tensor math; `forward` does the cache reads and writes
    # between them.

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """-> (query latent qr [T, q_lora], q [T, heads, D], kv [T, D]), rotated."""
        qr, kv = self.fused_wqa_wkv(x).split(self.fused_wqa_wkv.local_sizes, dim=-1)
        qr = self.q_norm(qr)
        q = self.q_head_norm(self.wq_b(qr).view(-1, self.num_heads, self.head_dim))
        return qr, self.rope.apply(q, cos, sin), self.rope.apply(self.kv_norm(kv), cos, sin)

    def output(self, attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # K = V carried rope; undo it at the query position
        out = self.rope.apply(attn, cos, sin, inverse=True)
        return self.wo_b(self._grouped_wo_a(out))

    def forward(self, x: torch.Tensor, ctx: ForwardContext, rope: RopeInputs) -> torch.Tensor:
        pool: DeepseekV4KVPool = ctx.kv_pool
        qr, q, kv = self.project(x, rope.cos, rope.sin)
        tiles = query_tiles(ctx)

        swa_buf = pool.swa_kv[self.cache_layer]
        window = window_access(ctx, pool, self.window)
        tile_kv, tile_valid = gather_ring(swa_buf, kv, window.ring.read_idx), window.valid
        swa_buf[window.ring.write_loc] = kv[window.ring.write_rows].to(swa_buf.dtype)

        row_kv = row_valid = None
        if self.compressor is not None:
            layer = self.cache_layer
            access = compress_access(ctx, pool, self.compress_ratio)
            self.compressor(
                x, ctx, access, pool.compressor_state[layer], pool.compressed_kv[layer], rope.rope
            )
            if self.indexer is None:  # HCA: every visible entry, shared by a tile's rows
                entries = pool.compressed_kv[layer][access.req_loc[tiles.req]]
                tile_kv = torch.cat([tile_kv, entries], dim=1)
                tile_valid = torch.cat([tile_valid, access.tile_valid], dim=2)
            else:  # CSA: each row's own top-k entries
                selected, row_valid = self.indexer(
                    x, qr, ctx, access, pool.indexer_state[layer], pool.indexer_k[layer], rope
                )
                row_kv = pool.compressed_kv[layer][access.read_loc.gather(1, selected)]

        attn = tiled_sink_attention(
            q,
            tiles.rows,
            tiles.row_slot,
            tile_kv,
            tile_valid,
            row_kv,
            row_valid,
            self.attn_sink,
            self.scale,
        )
        return self.output(attn, rope.cos, rope.sin)

    def _grouped_wo_a(self, out: torch.Tensor) -> torch.Tensor:
        """Group g (heads `g*H/G .. (g+1)*H/G - 1`) goes through its own `o_lora_rank` block."""
        grouped = out.reshape(out.shape[0], self.o_groups, -1)
        w = self.wo_a.weight.view(self.o_groups, self.o_lora_rank, -1)
        return torch.bmm(grouped.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).flatten(1)
