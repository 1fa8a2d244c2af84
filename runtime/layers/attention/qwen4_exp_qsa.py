# SPDX-License-Identifier: Apache-2.0
"""Qwen4Exp gated attention with the QSA (Qwen Sparse Attention) token indexer.

    [q | gate] per head = q_proj(x);  v = v_proj(x)
    q = rope(q_norm(q));  k = rope(k_norm(k_proj(x)))
    o = o_proj(attention(q, k, v) * sigmoid(gate))       GQA, causal, restricted by QSA

QSA follows transformers' `Qwen4ExpTextQSAIndexer` (`models/qwen4_exp/modeling_qwen4_exp.py`):
blocks of `ratio` visible keys are scored and the top `budget / ratio` kept with the tail
block; short contexts stay dense through a per-row mask, not a branch. Keys, values and raw
index keys are keyed by position, so rejected speculative rows are rewritten, not undone.
Indices come from `runtime.cache.qwen4_exp_metadata` (uniform batches take the fixed-shape
captured path, prefill chunks the ragged one). Under tensor parallelism query and KV heads
split over `tp` (KV heads replicated when fewer than ranks, as vLLM does) and the indexer
is replicated so every rank selects the same blocks. Block scoring, the MTP draft's reuse
of its selection: docs/architecture.md, "Module notes".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.cache.qwen4_exp_metadata import (
    Qwen4ExpRaggedMetadata,
    Qwen4ExpUniformMetadata,
    UniformKeys,
    VisibleKeys,
)
from runtime.core.forward_context import ForwardContext
from runtime.distributed import ParallelGroup
from runtime.kernels.indexer_topk import indexer_topk
from runtime.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from runtime.layers.norm import OffsetRMSNorm
from runtime.layers.rotary import RotaryEmbedding


def top_blocks(
    scores: torch.Tensor, block_visible: torch.Tensor, num_blocks: torch.Tensor, k: int
) -> torch.Tensor:
    """The `k` best visible blocks of each row as a mask `[T, B]` (every visible block for
    rows that see at most `k`). `scores [T, B]` in the row's own request's block numbering,
    so a row's visible blocks are its first `num_blocks`.

    Relu zeroes whole scores, so exact ties are common. The reference (transformers'
    `Qwen4ExpTextQSAIndexer`) runs `topk` over the row's visible blocks alone, and which of
    several tied blocks it keeps depends on how many there are; `indexer_topk` takes one
    fixed-size `topk` where no tie straddles the k-th place and the reference's `topk` over
    exactly `num_blocks` entries where one does, so a row's choice never depends on what else
    shares the batch (which speculative verify, batched differently from plain decode, relies
    on) or on padding. It is a custom op with a fake implementation: one opaque node of fixed
    shape in a captured step."""
    width = scores.shape[1]
    visible = scores.masked_fill(~block_visible, float("-inf"))
    picked, valid = indexer_topk(visible, num_blocks, num_blocks, k)
    columns = torch.where(valid, picked, width)  # invalid picks land in a dropped column
    selected = block_visible.new_zeros((scores.shape[0], width + 1))
    return selected.scatter(1, columns, True)[:, :width]


class QSAIndexer(nn.Module):
    def __init__(self, config, rope: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.head_dim = config.indexer_n_heads, config.indexer_head_dim
        self.ratio = config.indexer_compress_ratio
        self.block_topk = config.indexer_budget // self.ratio
        self.rope = rope
        self.index_qk_proj = ReplicatedLinear(
            config.hidden_size, (self.num_heads + 1) * self.head_dim
        )
        self.q_layernorm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_layernorm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)

    def write_keys(self, x: torch.Tensor, ctx: ForwardContext, index_cache: torch.Tensor):
        """Writes this forward's raw index keys at their token slots; returns the queries'
        projection `[T, heads * d]`."""
        q, raw_k = self.index_qk_proj(x).split(
            [self.num_heads * self.head_dim, self.head_dim], dim=-1
        )
        index_cache[ctx.out_cache_loc] = raw_k.to(index_cache.dtype)
        return q

    def queries(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q_layernorm(q.view(-1, self.num_heads, self.head_dim))
        return self.rope.apply(q, cos, sin).float()

    def forward(
        self,
        x: torch.Tensor,
        ctx: ForwardContext,
        cos: torch.Tensor,
        sin: torch.Tensor,
        index_cache: torch.Tensor,
        keys: VisibleKeys,
    ) -> torch.Tensor:
        """Ragged rows: writes this forward's raw index keys; returns the selected-block
        mask `[T, Bmax]` in each row's request's block numbering."""
        q = self.write_keys(x, ctx, index_cache)
        if keys.most_blocks <= self.block_topk:  # every row keeps all of its blocks
            return keys.block_visible
        q = self.queries(q, cos, sin)
        raw = index_cache[keys.slots].float()  # [L, d]
        num_blocks = keys.block_start.shape[0]
        complete = keys.block_of_key < num_blocks
        sums = torch.zeros(num_blocks, self.head_dim, device=x.device).index_add_(
            0, keys.block_of_key[complete], raw[complete]
        )
        pooled = self.k_layernorm((sums / self.ratio).to(x.dtype))
        block_cos, block_sin = self.rope.cos_sin(keys.block_start)
        block_keys = self.rope.apply(pooled, block_cos, block_sin)
        scores = torch.relu(torch.einsum("thd,bd->thb", q, block_keys.float())).sum(1)
        scores = (scores / self.head_dim**0.5).gather(1, keys.block_cols)
        return top_blocks(scores, keys.block_visible, keys.num_blocks, self.block_topk)

    def forward_uniform(
        self,
        x: torch.Tensor,
        ctx: ForwardContext,
        cos: torch.Tensor,
        sin: torch.Tensor,
        index_cache: torch.Tensor,
        keys: UniformKeys,
        rows_per_req: int,
    ) -> torch.Tensor:
        """Uniform rows: writes this forward's raw index keys, then scores every block of
        the request's keys (laid out by position, so pooling is a reshape). Returns the
        selected-block mask `[N, B]`."""
        q = self.queries(self.write_keys(x, ctx, index_cache), cos, sin)
        bs, num_blocks = keys.key_slots.shape[:2]
        raw = index_cache[keys.key_slots].float().sum(2)  # [bs, B, d]
        pooled = self.k_layernorm((raw / self.ratio).to(x.dtype))
        block_cos, block_sin = self.rope.cos_sin(keys.block_start)
        # [B, bs, d]: one rotation per block, shared by the requests
        block_keys = self.rope.apply(pooled.transpose(0, 1), block_cos, block_sin)
        q = q.view(bs, rows_per_req * self.num_heads, self.head_dim)
        scores = torch.bmm(q, block_keys.float().permute(1, 2, 0))  # [bs, q * heads, B]
        scores = torch.relu(scores).view(-1, self.num_heads, num_blocks).sum(1)
        return top_blocks(
            scores / self.head_dim**0.5, keys.block_visible, keys.num_blocks, self.block_topk
        )


def local_kv_heads(config, tp_size: int) -> int:
    """KV heads one rank holds (at least one: replicated when fewer than ranks)."""
    return max(1, config.num_key_value_heads // tp_size)


class QSAAttention(nn.Module):
    def __init__(
        self, config, cache_layer: int, rope: RotaryEmbedding, tp: ParallelGroup | None = None
    ):
        super().__init__()
        tp = tp or ParallelGroup()
        self.cache_layer, self.rope = cache_layer, rope
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            2 * self.head_dim,  # each query head carries its output gate
            config.num_attention_heads,
            self.head_dim,
            config.num_key_value_heads,
            tp=tp,
        )
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, tp=tp
        )
        self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.indexer = (
            QSAIndexer(config, rope) if getattr(config, "indexer_n_heads", None) else None
        )
        self.ratio = self.indexer.ratio if self.indexer is not None else 1

    def forward(
        self,
        x: torch.Tensor,
        ctx: ForwardContext,
        cos: torch.Tensor,
        sin: torch.Tensor,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        pool, layer = ctx.kv_pool, self.cache_layer
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.local_sizes, dim=-1)
        q, gate = q.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # split per head
        q = self.rope.apply(self.q_norm(q), cos, sin)
        k = self.rope.apply(self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim)), cos, sin)
        pool.k_cache[layer][ctx.out_cache_loc] = k.to(pool.dtype)
        pool.v_cache[layer][ctx.out_cache_loc] = v.view(-1, self.num_kv_heads, self.head_dim).to(
            pool.dtype
        )

        meta = ctx.attn_metadata
        if isinstance(meta, Qwen4ExpUniformMetadata):
            out = self._attend_uniform(x, q, ctx, cos, sin, meta, spec_step_idx)
        else:
            out = self._attend_ragged(x, q, ctx, cos, sin, meta, spec_step_idx)
        return self.o_proj((out * torch.sigmoid(gate.float()).to(out.dtype)).flatten(1))

    def _attend_ragged(
        self, x, q, ctx: ForwardContext, cos, sin, meta: Qwen4ExpRaggedMetadata, spec_step_idx
    ) -> torch.Tensor:
        """Prefill chunks: every key of the batch, masked to the row's request (`[T, L]`)."""
        pool, layer, keys = ctx.kv_pool, self.cache_layer, meta.keys
        allowed = keys.allowed
        if self.indexer is not None:
            if spec_step_idx > 0 and pool.reuses_qsa_selection:
                raise ValueError("chained draft steps run one row per request (uniform rows)")
            selected = self.indexer(x, ctx, cos, sin, pool.index_cache[layer], keys)
            self._remember(ctx, selected, keys.tail_start)
            in_block = selected[:, keys.key_block]  # [T, L]
            in_tail = keys.positions.unsqueeze(0) >= keys.tail_start.unsqueeze(1)
            allowed = allowed & (in_block | in_tail)
        k, v = pool.k_cache[layer][keys.slots], pool.v_cache[layer][keys.slots]  # [L, KV, d]
        # one fused attention over the chunk's rows (PyTorch's SDPA: on CPU its flash
        # kernel, which never writes the [T, heads, L] scores); query head h reads key
        # head h // (heads / kv_heads), and every row sees at least its own key
        out = F.scaled_dot_product_attention(
            q.float().transpose(0, 1).unsqueeze(0),
            k.float().transpose(0, 1).unsqueeze(0),
            v.float().transpose(0, 1).unsqueeze(0),
            attn_mask=allowed.view(1, 1, *allowed.shape),
            scale=self.head_dim**-0.5,
            enable_gqa=True,
        )  # [1, heads, T, d]
        return out[0].transpose(0, 1).reshape(q.shape).to(q.dtype)

    def _attend_uniform(
        self, x, q, ctx: ForwardContext, cos, sin, meta: Qwen4ExpUniformMetadata, spec_step_idx
    ) -> torch.Tensor:
        """Uniform rows: each request's keys laid out by position (`[bs, K]`, shared by its
        `q` rows), the QSA selection a mask over them; fixed shapes throughout."""
        pool, layer, keys = ctx.kv_pool, self.cache_layer, meta.keys
        bs, rows = meta.num_reqs, meta.rows_per_req
        allowed = keys.key_visible  # [N, B, ratio]
        if self.indexer is not None:
            if spec_step_idx > 0 and pool.reuses_qsa_selection:
                # later chained draft steps keep the selection the first step made
                self.indexer.write_keys(x, ctx, pool.index_cache[layer])
                kept = pool.recall_selection(layer, ctx, keys.key_pos)  # [bs, B, ratio]
                kept = kept.unsqueeze(1).expand(bs, rows, *kept.shape[1:]).flatten(0, 1)
                allowed = allowed & kept
            else:
                selected = self.indexer.forward_uniform(
                    x, ctx, cos, sin, pool.index_cache[layer], keys, rows
                )
                self._remember(ctx, selected, keys.tail_start)
                # a selected block is complete and visible, so all of its keys are
                allowed = selected.unsqueeze(-1) | keys.tail_keys
        slots = keys.key_slots.flatten(1)  # [bs, K]
        k, v = pool.k_cache[layer][slots], pool.v_cache[layer][slots]  # [bs, K, KV, d]
        groups = self.num_heads // self.num_kv_heads
        qg = q.view(bs, rows, self.num_kv_heads, groups, self.head_dim)
        scores = torch.einsum("bqkgd,blkd->bqkgl", qg.float(), k.float()) * self.head_dim**-0.5
        mask = allowed.view(bs, rows, 1, 1, -1)
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.einsum("bqkgl,blkd->bqkgd", torch.softmax(scores, dim=-1), v.float())
        return out.reshape(q.shape).to(q.dtype)

    def _remember(self, ctx: ForwardContext, selected: torch.Tensor, tail_start) -> None:
        """The draft's first step keeps its selection for the chained steps after it."""
        if ctx.kv_pool.reuses_qsa_selection and ctx.logits_row_indices is not None:
            ctx.kv_pool.remember_selection(self.cache_layer, ctx, selected, tail_start)
