# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V4 attention: sliding window + compressed KV (CSA with the lightning indexer,
or HCA), single-latent MQA with an attention sink and a grouped output projection.

Math: transformers' `models/deepseek_v4/modeling_deepseek_v4.py` (`DeepseekV4Attention`,
`DeepseekV4CSACompressor`, `DeepseekV4HCACompressor`, `DeepseekV4Indexer`). Caches:
`runtime.cache.deepseek_v4_pool`.

Window keys and compressor state rows live in position-keyed rings; every index a layer
reads comes from the metadata the runner prepared before the forward
(`runtime.cache.deepseek_v4_metadata`, `ctx.attn_metadata`). A uniform batch (decode,
verify, draft steps) takes the fixed-shape path a captured step replays; prefill chunks the
ragged one.

Under tensor parallelism the query heads split over `tp` together with their sinks and
their output groups (`wo_a` by group, `wo_b` reducing); the single KV latent, the
compressors and the indexer are replicated, as SGLang does for MLA's latent, so every rank
keeps the whole (small) KV cache and selects the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.cache.deepseek_v4_metadata import (
    CompressAccess,
    DeepseekV4RaggedMetadata,
    DeepseekV4UniformMetadata,
    UniformCompress,
    compressor_overlap,
)
from runtime.cache.deepseek_v4_pool import DeepseekV4KVPool
from runtime.core.forward_context import ForwardContext
from runtime.distributed import ParallelGroup
from runtime.kernels import compressor_entries as entries_kernel
from runtime.kernels import compressor_pool as pool_kernel
from runtime.kernels import compressor_rows as rows_kernel
from runtime.kernels.indexer_topk import indexer_topk
from runtime.kernels.quantized_product import fp8_linear
from runtime.kernels.row_gather import take_rows
from runtime.kernels.sink_attention import (
    TileKeys,
    grouped_sink_attention,
    tiled_sink_attention,
    to_tiles,
)
from runtime.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from runtime.layers.narrow_weights import batched_product, product_weight
from runtime.layers.norm import RMSNorm, WeightlessRMSNorm
from runtime.layers.position_ring import gather_ring
from runtime.layers.quantized import quantized_format
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
# Modules
# ---------------------------------------------------------------------------------------


def sparse_ratio(config) -> int:
    """The compress ratio of the CSA layers (`compressed_sparse_attention`): caches and
    metadata are keyed by ratio, so this ratio marks a layer as CSA (indexer, overlapping
    compressor windows) wherever the layer type is not at hand (the pool, MTP layers)."""
    return config.compress_rates["compressed_sparse_attention"]


class DeepseekV4Compressor(nn.Module):
    """Gated pooling of each block of `ratio` tokens into one `dim`-wide entry (transformers'
    `DeepseekV4CSACompressor` / `DeepseekV4HCACompressor`).

    A CSA compressor (`overlap` 2) pools `2 * ratio` rows: the previous block's first
    channel half and this block's second half; an HCA compressor (`overlap` 1) pools its
    block's `ratio` rows. The per-token `[kv | gate + ape]` rows live in the state ring; an
    entry is made when its block's last token is processed, then RMS-normed and rotated at
    the block's first position.
    """

    def __init__(self, hidden_size: int, dim: int, ratio: int, eps: float, sparse: bool):
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, compressor_overlap(sparse)
        width = self.overlap * dim
        self.fused_wkv_wgate = MergedColumnParallelLinear(hidden_size, [width, width])
        self.ape = make_param((ratio, width), torch.float32)
        self.norm = RMSNorm(dim, eps)

    def state_rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each row's `[kv | gate + ape]` state (fp32)."""
        kv_gate = self.fused_wkv_wgate(x)
        if rows_kernel.uses_kernel(kv_gate, self.ape, positions):
            return rows_kernel.compressor_rows(kv_gate, self.ape, positions)
        return rows_kernel.compressor_rows_reference(kv_gate, self.ape, positions)

    def make_entries(
        self,
        rows: torch.Tensor,
        valid: torch.Tensor,
        entry_pos: torch.Tensor,
        rope: RotaryEmbedding,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Pooled, normed and rotated entries from their blocks' state rows."""
        if dtype == torch.float32 and entries_kernel.uses_kernel(rows, valid, entry_pos):
            rd = rope.rotary_dim
            return entries_kernel.compressor_entries(
                rows,
                valid,
                self.norm.weight,
                self.norm.eps,
                entry_pos,
                rope.inv_freq,
                rope.attention_scaling,
                self.dim,
                self.ratio,
                self.overlap,
                self.dim - rd if rope.rotate_tail else 0,
                rope.interleaved,
            )
        entries = self.norm(self._pool(rows, valid).to(dtype))
        cos, sin = rope.cos_sin(entry_pos)
        return rope.apply(entries, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        ctx: ForwardContext,
        access: CompressAccess,
        state_buf: torch.Tensor,
        entry_buf: torch.Tensor,
        rope: RotaryEmbedding,
    ) -> None:
        """Ragged rows: entries for the rows that close a block, then the ring writes."""
        state_rows = self.state_rows(x, ctx.positions)
        if access.boundary_rows.numel():
            window = gather_ring(state_buf, state_rows, access.state)
            entries = self.make_entries(
                window, access.state.read_valid, access.entry_pos, rope, x.dtype
            )
            entry_buf[access.entry_loc] = entries.to(entry_buf.dtype)
        write = access.state
        state_buf[write.write_loc] = state_rows[write.write_rows]

    def forward_uniform(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        access: UniformCompress,
        state_buf: torch.Tensor,
        entry_buf: torch.Tensor,
        rope: RotaryEmbedding,
    ) -> None:
        """Uniform rows: write every state row, pool an entry at every row, keep the ones
        that close a block (the others land on the trash row)."""
        state_buf[access.state_write] = self.state_rows(x, positions)
        window = state_buf[access.state_read]
        entries = self.make_entries(window, access.state_valid, access.entry_pos, rope, x.dtype)
        entry_buf[access.entry_write] = entries.to(entry_buf.dtype)

    def _pool(self, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`rows [B, overlap*ratio, 2*overlap*dim]` -> entries `[B, dim]` (fp32)."""
        width, d, r = self.overlap * self.dim, self.dim, self.ratio
        if pool_kernel.uses_kernel(rows, valid):
            return pool_kernel.compressor_pool(rows, valid, d, r, self.overlap)
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
            config.hidden_size, self.head_dim, ratio, config.rms_norm_eps, sparse=True
        )

    def queries(self, qr: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        return rope.apply(self.wq_b(qr).view(-1, self.num_heads, self.head_dim)).float()

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        return self.weights_proj(x).float() * self.num_heads**-0.5

    def weigh(self, x: torch.Tensor, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Per-head relu scores `[T, heads, C]` -> index scores `[T, C]` (-inf if unseen)."""
        scores = torch.relu(scores) * self.head_dim**-0.5
        total = torch.bmm(self.head_weights(x).unsqueeze(1), scores).squeeze(1)
        return total.masked_fill(~visible, float("-inf"))

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        ctx: ForwardContext,
        tiles,
        access: CompressAccess,
        state_buf: torch.Tensor,
        key_buf: torch.Tensor,
        rope: RopeInputs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged rows. Returns `(selected [T, k], valid [T, k])`: positions in each row's
        entry list."""
        self.compressor(x, ctx, access, state_buf, key_buf, rope.rope)
        keys = key_buf[access.req_loc[tiles.req]].float()  # [N, C, d]: each tile's request's
        # The per-head scores [N, R * heads, C] stay in the tile layout up to the weighted
        # sum over heads; only the summed [T, C] scores come back to the rows.
        num_tiles, tile_len = tiles.rows.shape
        tile_q = to_tiles(self.queries(qr, rope), tiles.rows)
        scores = torch.bmm(tile_q.view(num_tiles, -1, self.head_dim), keys.transpose(1, 2))
        scores = scores.relu_().mul_(self.head_dim**-0.5)
        weights = to_tiles(self.head_weights(x), tiles.rows).view(-1, 1, self.num_heads)
        total = torch.bmm(weights, scores.view(num_tiles * tile_len, self.num_heads, -1))
        total = total.squeeze(1)[tiles.row_slot].masked_fill(~access.read_valid, float("-inf"))
        return indexer_topk(total, access.topk_len, access.visible, self.topk)

    def forward_uniform(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        meta: DeepseekV4UniformMetadata,
        access: UniformCompress,
        state_buf: torch.Tensor,
        key_buf: torch.Tensor,
        rope: RopeInputs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniform rows: `(selected [N, k], valid [N, k])` as in `forward`."""
        self.compressor.forward_uniform(x, meta.positions, access, state_buf, key_buf, rope.rope)
        bs, rows = meta.num_reqs, meta.rows_per_req
        keys = key_buf[access.entry_rows].float()  # [bs, C, d]
        q = self.queries(qr, rope).view(bs, rows * self.num_heads, self.head_dim)
        scores = torch.bmm(q, keys.transpose(1, 2)).view(bs * rows, self.num_heads, -1)
        total = self.weigh(x, scores, access.entry_visible)
        return indexer_topk(total, access.topk_len, access.visible, self.topk)


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
        # CSA layers (the sparse ratio) carry the indexer and overlapping compressor windows
        sparse = compress_ratio > 1 and compress_ratio == sparse_ratio(config)
        self.compressor = (
            DeepseekV4Compressor(
                config.hidden_size, self.head_dim, compress_ratio, self.eps, sparse
            )
            if compress_ratio > 1
            else None
        )
        self.indexer = DeepseekV4Indexer(config, compress_ratio) if sparse else None

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
        meta = ctx.attn_metadata
        qr, q, kv = self.project(x, rope.cos, rope.sin)
        if isinstance(meta, DeepseekV4UniformMetadata):
            attn = self._attend_uniform(x, qr, q, kv, ctx.kv_pool, meta, rope)
        else:
            attn = self._attend_ragged(x, qr, q, kv, ctx, meta, rope)
        return self.output(attn, rope.cos, rope.sin)

    def _attend_ragged(
        self, x, qr, q, kv, ctx: ForwardContext, meta: DeepseekV4RaggedMetadata, rope: RopeInputs
    ) -> torch.Tensor:
        pool: DeepseekV4KVPool = ctx.kv_pool
        tiles, window = meta.tiles, meta.window
        swa_buf = pool.swa_kv[self.cache_layer]
        tile_kv, tile_valid = gather_ring(swa_buf, kv, window.ring), window.valid
        swa_buf[window.ring.write_loc] = kv[window.ring.write_rows].to(swa_buf.dtype)

        row_source = row_index = row_valid = None
        if self.compressor is not None:
            layer = self.cache_layer
            access = meta.compress[self.compress_ratio]
            self.compressor(
                x, ctx, access, pool.compressor_state[layer], pool.compressed_kv[layer], rope.rope
            )
            num_entries = access.read_loc.shape[1]
            if self.indexer is not None and num_entries <= self.indexer.topk:
                # no row sees more entries than the indexer keeps: every visible entry is
                # selected whatever the scores, so CSA attends like HCA (entries shared by a
                # tile's rows instead of gathered per row); the indexer's keys still go in
                self.indexer.compressor(
                    x,
                    ctx,
                    access,
                    pool.indexer_state[layer],
                    pool.indexer_k[layer],
                    rope.rope,
                )
            if self.indexer is None or num_entries <= self.indexer.topk:
                # HCA (or CSA selecting everything): every visible entry, shared by a tile
                entries = take_rows(pool.compressed_kv[layer], access.req_loc[tiles.req])
                tile_kv = torch.cat([tile_kv, entries], dim=1)
                tile_valid = torch.cat([tile_valid, access.tile_valid], dim=2)
            else:  # CSA: each row's own top-k entries
                selected, row_valid = self.indexer(
                    x,
                    qr,
                    ctx,
                    tiles,
                    access,
                    pool.indexer_state[layer],
                    pool.indexer_k[layer],
                    rope,
                )
                # read where they lie (`merge_row_keys`), not gathered into a copy
                row_index = access.read_loc.gather(1, selected.clamp(max=num_entries - 1))
                row_source = pool.compressed_kv[layer]

        keys = TileKeys(
            tiles.rows,
            tiles.row_slot,
            tile_kv,
            tile_valid,
            row_valid=row_valid,
            row_source=row_source,
            row_index=row_index,
        )
        return tiled_sink_attention(q, keys, self.attn_sink, self.scale)

    def _attend_uniform(
        self, x, qr, q, kv, pool: DeepseekV4KVPool, meta: DeepseekV4UniformMetadata, rope
    ) -> torch.Tensor:
        """Every new row is written first; all keys then come from the caches."""
        bs, rows = meta.num_reqs, meta.rows_per_req
        swa_buf = pool.swa_kv[self.cache_layer]
        swa_buf[meta.window.write] = kv.to(swa_buf.dtype)
        tile_kv, tile_valid = swa_buf[meta.window.read], meta.window.valid

        row_kv = row_valid = None
        if self.compressor is not None:
            layer = self.cache_layer
            access = meta.compress[self.compress_ratio]
            entry_buf = pool.compressed_kv[layer]
            self.compressor.forward_uniform(
                x, meta.positions, access, pool.compressor_state[layer], entry_buf, rope.rope
            )
            if self.indexer is None:
                tile_kv = torch.cat([tile_kv, entry_buf[access.entry_rows]], dim=1)
                visible = access.entry_visible.view(bs, rows, -1)
                tile_valid = torch.cat([tile_valid, visible], dim=2)
            else:
                selected, row_valid = self.indexer.forward_uniform(
                    x,
                    qr,
                    meta,
                    access,
                    pool.indexer_state[layer],
                    pool.indexer_k[layer],
                    rope,
                )
                per_row = access.entry_rows.repeat_interleave(rows, dim=0)
                picked = per_row.gather(1, selected.clamp(max=access.num_entries - 1))
                row_kv = entry_buf[picked]
        return grouped_sink_attention(
            q.view(bs, rows, self.num_heads, self.head_dim),
            tile_kv,
            tile_valid,
            row_kv,
            row_valid,
            self.attn_sink,
            self.scale,
        )

    def _grouped_wo_a(self, out: torch.Tensor) -> torch.Tensor:
        """Group g (heads `g*H/G .. (g+1)*H/G - 1`) goes through its own `o_lora_rank` block."""
        grouped = out.reshape(out.shape[0], self.o_groups, -1).transpose(0, 1)
        quant = quantized_format(self.wo_a, "weight")
        if quant is not None:  # FP8 codes, one scale row per weight row: grouped alike
            codes = self.wo_a.weight.view(self.o_groups, self.o_lora_rank, -1)
            scales = self.wo_a.weight_scale_inv.view(self.o_groups, self.o_lora_rank, -1)
            y = fp8_linear(grouped.contiguous(), codes, scales, [1, quant[1]])
            return y.transpose(0, 1).flatten(1)
        w, path = product_weight(self.wo_a, "weight", out.shape[0])
        w = w.view(self.o_groups, self.o_lora_rank, -1)
        return batched_product(grouped, w, path).transpose(0, 1).flatten(1)
