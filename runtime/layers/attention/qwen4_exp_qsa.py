# SPDX-License-Identifier: Apache-2.0
"""Qwen4Exp gated attention with the QSA (Qwen Sparse Attention) token indexer.

    [q | gate] per head = q_proj(x);  v = v_proj(x)
    q = rope(q_norm(q));  k = rope(k_norm(k_proj(x)))
    o = o_proj(attention(q, k, v) * sigmoid(gate))       GQA, causal, restricted by QSA

QSA (transformers' `Qwen4ExpTextQSAIndexer` in `models/qwen4_exp/modeling_qwen4_exp.py`):
the visible keys of a query at p are grouped into complete blocks of `ratio` positions; a
block's key is `rope(k_layernorm(mean of its raw index keys), block start)`; blocks are
scored `sum_h relu(q_h . k_b) / sqrt(d)` and the top `budget / ratio` are kept, together
with the incomplete tail block. Until a query sees more
than `budget + ratio - 1` keys the selection keeps everything (dense attention).

Keys and values live at full-history token slots (`out_cache_loc`); raw index keys beside
them. Both are keyed by position, so rejected speculative rows are rewritten, not undone.
The MTP draft selects on its first step and reuses that selection on later chained steps.

Under tensor parallelism the query heads (with their gates) and the KV heads split over
`tp` (a KV head is replicated when there are fewer than ranks, as vLLM does), `o_proj`
reduces, and the indexer (one key head) is replicated so every rank selects the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.core.forward_context import ForwardContext
from runtime.distributed import ParallelGroup
from runtime.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from runtime.layers.norm import OffsetRMSNorm
from runtime.layers.rotary import RotaryEmbedding


@dataclass
class VisibleKeys:
    """Every key position any row of the forward may see, request by request."""

    slots: torch.Tensor  # [L] token slot of each key
    positions: torch.Tensor  # [L]
    key_req: torch.Tensor  # [L] batch index of the key's request
    allowed: torch.Tensor  # [T, L] same request and causal
    block_of_key: torch.Tensor  # [L] index into the block list; B for keys of a partial block
    block_start: torch.Tensor  # [B] first position of each complete block
    block_visible: torch.Tensor  # [T, B] complete and visible to the row
    tail_start: torch.Tensor  # [T] first position of each row's incomplete tail block
    num_blocks: torch.Tensor  # [T] complete visible blocks per row


def visible_keys(ctx: ForwardContext, ratio: int) -> VisibleKeys:
    def build() -> VisibleKeys:
        device = ctx.device
        lens = ctx.seq_lens
        key_req = torch.repeat_interleave(torch.arange(ctx.batch_size, device=device), lens)
        key_start = torch.cumsum(lens, 0) - lens
        positions = torch.arange(int(lens.sum()), device=device) - key_start[key_req]
        slots = ctx.req_to_token[ctx.req_pool_indices[key_req], positions]
        row_req, row_pos = ctx.token_to_req, ctx.positions
        allowed = (key_req.unsqueeze(0) == row_req.unsqueeze(1)) & (
            positions.unsqueeze(0) <= row_pos.unsqueeze(1)
        )
        blocks = lens // ratio
        block_req = torch.repeat_interleave(torch.arange(ctx.batch_size, device=device), blocks)
        block_first = torch.cumsum(blocks, 0) - blocks
        block_start = (
            torch.arange(int(blocks.sum()), device=device) - block_first[block_req]
        ) * ratio
        in_complete = positions < (blocks * ratio)[key_req]
        block_of_key = torch.where(
            in_complete, block_first[key_req] + positions // ratio, int(blocks.sum())
        )
        num_blocks = (row_pos + 1) // ratio
        block_visible = (block_req.unsqueeze(0) == row_req.unsqueeze(1)) & (
            block_start.unsqueeze(0) + ratio - 1 <= row_pos.unsqueeze(1)
        )
        return VisibleKeys(
            slots,
            positions,
            key_req,
            allowed,
            block_of_key,
            block_start,
            block_visible,
            num_blocks * ratio,
            num_blocks,
        )

    return ctx.memo(f"qsa.keys.{ratio}", build)


def tokens_of_blocks(selected: torch.Tensor, keys: VisibleKeys) -> torch.Tensor:
    """Block selection `[T, B]` -> token mask `[T, L]`: keys of selected blocks plus each row's
    incomplete tail block."""
    padded = torch.cat([selected, selected.new_zeros((selected.shape[0], 1))], dim=1)
    in_block = padded[:, keys.block_of_key]
    in_tail = keys.positions.unsqueeze(0) >= keys.tail_start.unsqueeze(1)
    return in_block | in_tail


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

    def forward(
        self,
        x: torch.Tensor,
        ctx: ForwardContext,
        cos: torch.Tensor,
        sin: torch.Tensor,
        index_cache: torch.Tensor,
        keys: VisibleKeys,
    ) -> torch.Tensor | None:
        """Writes this forward's raw index keys; returns the selected-block mask `[T, B]`, or
        None when every row still keeps all of its blocks."""
        q, raw_k = self.index_qk_proj(x).split(
            [self.num_heads * self.head_dim, self.head_dim], dim=-1
        )
        index_cache[ctx.out_cache_loc] = raw_k.to(index_cache.dtype)
        if int(keys.num_blocks.max()) <= self.block_topk:
            return None
        q = self.rope.apply(self.q_layernorm(q.view(-1, self.num_heads, self.head_dim)), cos, sin)
        raw = index_cache[keys.slots].float()  # [L, d]
        num_blocks = keys.block_start.shape[0]
        complete = keys.block_of_key < num_blocks
        sums = torch.zeros(num_blocks, self.head_dim, device=x.device).index_add_(
            0, keys.block_of_key[complete], raw[complete]
        )
        pooled = self.k_layernorm((sums / self.ratio).to(raw_k.dtype))
        block_cos, block_sin = self.rope.cos_sin(keys.block_start)
        block_keys = self.rope.apply(pooled, block_cos, block_sin)
        scores = torch.relu(torch.einsum("thd,bd->thb", q.float(), block_keys.float())).sum(1)
        return top_blocks_per_row(scores / self.head_dim**0.5, keys, self.block_topk)


def top_blocks_per_row(scores: torch.Tensor, keys: VisibleKeys, k: int) -> torch.Tensor:
    """The `k` best visible blocks of each row as a mask `[T, B]` (all of them for rows that
    see at most `k`).

    Relu zeroes whole scores, so exact ties are common. Where no tie straddles the k-th place
    the set is the same under any tie rule: every block scoring at least the k-th score. Where
    one does, the reference (HF) has `topk` on that row's visible blocks alone decide; such rows
    are grouped by how many blocks they see and each group goes through one `topk` over exactly
    those blocks, so ties break as they do there, and a row's choice never depends on what else
    shares the batch (which speculative verify, batched differently from plain decode, relies on).
    """
    selected = keys.block_visible.clone()
    num_blocks = keys.num_blocks
    over = num_blocks > k
    if not bool(over.any()):
        return selected
    visible = scores.masked_fill(~keys.block_visible, float("-inf"))
    kth, next_best = visible.topk(k + 1, dim=1).values.unbind(1)[k - 1 :]
    selected[over] &= visible[over] >= kth[over].unsqueeze(1)
    tied = over & (kth == next_best)
    if not bool(tied.any()):
        return selected
    first = keys.block_visible.int().argmax(dim=1)  # a row's visible blocks are contiguous
    for count in torch.unique(num_blocks[tied]).tolist():
        rows = (tied & (num_blocks == count)).nonzero().squeeze(1)
        cols = first[rows].unsqueeze(1) + torch.arange(count, device=scores.device)
        best = cols.gather(1, scores[rows].gather(1, cols).topk(k, dim=1).indices)
        selected[rows] = False
        selected[rows.unsqueeze(1), best] = True
    return selected


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

        keys = visible_keys(ctx, self.ratio)
        allowed = keys.allowed
        if self.indexer is not None:
            kept = self._selection(x, ctx, cos, sin, keys, spec_step_idx)
            if kept is not None:
                allowed = allowed & kept
        out = self._attend(
            q, pool.k_cache[layer][keys.slots], pool.v_cache[layer][keys.slots], allowed
        )
        return self.o_proj((out * torch.sigmoid(gate.float()).to(out.dtype)).flatten(1))

    def _selection(
        self, x, ctx, cos, sin, keys: VisibleKeys, spec_step_idx: int
    ) -> torch.Tensor | None:
        """Token-level QSA mask `[T, L]` (None: keep everything)."""
        pool, layer = ctx.kv_pool, self.cache_layer
        if spec_step_idx > 0 and pool.reuses_qsa_selection:
            # later chained draft steps keep the selection the first step made
            raw_k = self.indexer.index_qk_proj(x)[
                :, self.indexer.num_heads * self.indexer.head_dim :
            ]
            pool.index_cache[layer][ctx.out_cache_loc] = raw_k.to(pool.index_cache[layer].dtype)
            return pool.recall_selection(layer, ctx, keys)
        selected = self.indexer(x, ctx, cos, sin, pool.index_cache[layer], keys)
        kept = None if selected is None else tokens_of_blocks(selected, keys)
        if pool.reuses_qsa_selection and ctx.logits_row_indices is not None:
            pool.remember_selection(layer, ctx, keys, selected)
        return kept

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """`q [T, H, d]`, `k/v [L, KV, d]`, `allowed [T, L]` -> `[T, H, d]` (softmax in fp32)."""
        groups = self.num_heads // self.num_kv_heads
        qg = q.view(q.shape[0], self.num_kv_heads, groups, self.head_dim)
        scores = torch.einsum("tkgd,lkd->tkgl", qg.float(), k.float()) * self.head_dim**-0.5
        scores = scores.masked_fill(~allowed.view(allowed.shape[0], 1, 1, -1), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("tkgl,lkd->tkgd", probs, v.float())
        return out.reshape(q.shape).to(q.dtype)
