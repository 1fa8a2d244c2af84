# SPDX-License-Identifier: Apache-2.0
"""Qwen4Exp PLE: hashed n-gram per-layer embedding (transformers'
`Qwen4ExpTextNGramEmbedding` and `Qwen4ExpTextPLELayer`).

For each token, the bigram (t_{p-1}, t_p) and trigram (t_{p-2}, t_{p-1}, t_p) are hashed
(`t_s * m_s`, XOR-combined) into `heads_per_ngram` prime-sized tables each; the looked-up
rows form `e`. Then, with the residual streams `R`:

    k = norm_key(W_k e) [n, H];  q = norm_query(R) [n, H];  g = sum(k * q) / sqrt(H)
    g = sign(g) sqrt(max(|g|, 1e-6));  v = sigmoid(g) W_v e        (broadcast to the n streams)
    out = v + silu(dilated_depthwise_conv(norm_conv(v)))            taps p-9, p-6, p-3, p

An EOS starts a new segment: a token right after EOS sees no older context. The previous
tokens and conv inputs live in position-keyed rings (positions before 0 read as EOS / 0).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runtime.cache.qwen4_exp_metadata import Qwen4ExpUniformMetadata
from runtime.core.forward_context import ForwardContext
from runtime.layers.causal_conv import causal_conv, causal_conv_uniform
from runtime.layers.linear import MergedColumnParallelLinear
from runtime.layers.norm import OffsetRMSNorm
from runtime.layers.position_ring import gather_ring
from runtime.layers.weight_utils import copy_checked, expect_loads, make_param

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def hash_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """One odd multiplier per n-gram position, below 2^63 / vocab so products cannot wrap twice."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + 10007 * ple_index
    return [
        2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half_bound) + 1
        for i in range(ngram_size)
    ]


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def head_vocab_sizes(base: int, first_head: int, count: int) -> list[int]:
    """Head h's table size is the (first_head + h + 1)-th prime after `base - 1`."""
    sizes, prime, index = [], base - 1, 0
    while len(sizes) < count:
        prime += 1
        while not _is_prime(prime):
            prime += 1
        if index >= first_head:
            sizes.append(prime)
        index += 1
    return sizes


class NGramEmbedding(nn.Module):
    def __init__(self, config, embed_dim: int, ple_index: int):
        super().__init__()
        self.ngram_size, self.heads_per_ngram = config.ngram_size, config.heads_per_ngram
        self.num_heads = (self.ngram_size - 1) * self.heads_per_ngram
        eos = config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        sizes = head_vocab_sizes(
            config.ngram_vocab_size_base, ple_index * self.num_heads, self.num_heads
        )
        offsets = [sum(sizes[:h]) for h in range(self.num_heads)]
        divisor = config.make_ngram_vocab_size_divisible_by
        rows = -(-sum(sizes) // divisor) * divisor
        self.register_buffer(
            "multipliers",
            torch.tensor(
                hash_multipliers(config.vocab_size, self.ngram_size, ple_index, config.seed)
            ),
            persistent=False,
        )
        self.register_buffer("sizes", torch.tensor(sizes), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets), persistent=False)
        self.split_parts = getattr(config, "split_ngram_parts", 1)
        self.weight = make_param((rows, embed_dim // self.num_heads), loader=self._table_loader)
        # released checkpoints store the table as `shard_0..shard_{parts-1}` row blocks
        expect_loads(self.weight, {(shard,) for shard in range(self.split_parts)})

    def _table_loader(self, param, loaded, shard_id=None):
        """Whole table, or shard `shard_id` of `split_ngram_parts` row blocks (checkpoint order)."""
        if shard_id is None:
            copy_checked(param.data, loaded)
            return
        rows = -(-param.shape[0] // self.split_parts)
        copy_checked(
            param.data[shard_id * rows : shard_id * rows + loaded.shape[0]],
            loaded,
            f"shard {shard_id}",
        )

    def forward(self, history: torch.Tensor) -> torch.Tensor:
        """`history [T, ngram_size]` = (t_p, t_{p-1}, t_{p-2}) -> `[T, embed_dim]`."""
        mixed = history[:, 0] * self.multipliers[0]
        ids = []
        for order in range(1, self.ngram_size):  # bigram heads, then trigram heads
            mixed = torch.bitwise_xor(mixed, history[:, order] * self.multipliers[order])
            heads = slice((order - 1) * self.heads_per_ngram, order * self.heads_per_ngram)
            ids.append(
                torch.remainder(mixed.unsqueeze(-1), self.sizes[heads]) + self.offsets[heads]
            )
        return F.embedding(torch.cat(ids, dim=-1), self.weight).flatten(1)


class PLELayer(nn.Module):
    def __init__(self, config, ple_index: int, cache_layer: int):
        super().__init__()
        self.cache_layer = cache_layer
        self.hc_count, self.hidden_size = config.hc_count, config.hidden_size
        width = self.hc_count * self.hidden_size
        self.ple_embedding = NGramEmbedding(config, config.ple_embed_dim, ple_index)
        self.kv_proj = MergedColumnParallelLinear(config.ple_embed_dim, [width, self.hidden_size])
        eps = config.rms_norm_eps
        self.norm_key = OffsetRMSNorm(width, eps, group_size=self.hidden_size)
        self.norm_query = OffsetRMSNorm(width, eps, group_size=self.hidden_size)
        self.norm_conv = OffsetRMSNorm(width, eps, group_size=self.hidden_size)
        self.kernel, self.dilation = config.ple_conv_kernel_size, config.ngram_size
        self.conv1d = nn.Module()
        self.conv1d.weight = make_param((width, 1, self.kernel))

    def token_history(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """`[T, ngram_size]`: each row's token and its predecessors (EOS before position 0 and
        across an EOS boundary), from this forward's rows and the token ring."""
        pool, eos, meta = ctx.kv_pool, self.ple_embedding.eos_token_id, ctx.attn_metadata
        ring_buf = pool.ple_tokens[self.cache_layer]
        span = self.ple_embedding.ngram_size
        if isinstance(meta, Qwen4ExpUniformMetadata):  # write first, then read the ring
            ring = meta.ple_tokens
            ring_buf[ring.write] = input_ids
            history, valid = ring_buf[ring.read], ring.valid
        else:
            access = meta.ple_tokens
            history = gather_ring(ring_buf.unsqueeze(1), input_ids.unsqueeze(1), access).squeeze(-1)
            valid = access.read_valid
            ring_buf[access.write_loc] = input_ids[access.write_rows]
        history = history.masked_fill(~valid, eos).flip(1)  # (t_p, t_{p-1}, t_{p-2}, ...)
        for shift in range(2, span):  # older tokens do not reach across an EOS
            history[:, shift] = torch.where(
                (history[:, 1:shift] == eos).any(1), eos, history[:, shift]
            )
        return history

    def forward(
        self, streams: torch.Tensor, input_ids: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """`streams [T, n*H]` -> the PLE term added to them, `[T, n*H]`."""
        n, hidden = self.hc_count, self.hidden_size
        embeds = self.ple_embedding(self.token_history(input_ids, ctx))
        key, value = self.kv_proj(embeds).split([n * hidden, hidden], dim=-1)
        key = self.norm_key(key).unflatten(-1, (n, hidden))
        query = self.norm_query(streams).unflatten(-1, (n, hidden))
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
        meta = ctx.attn_metadata
        conv = causal_conv_uniform if isinstance(meta, Qwen4ExpUniformMetadata) else causal_conv
        conv = conv(
            self.norm_conv(gated),
            self.conv1d.weight.squeeze(1),
            ctx.kv_pool.ple_conv[self.cache_layer],
            meta.ple_conv,
        )
        return gated + F.silu(conv)
