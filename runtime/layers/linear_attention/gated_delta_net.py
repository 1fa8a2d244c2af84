# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet linear attention (Qwen3.5 / Qwen4Exp; transformers'
`Qwen4ExpTextGatedDeltaNet`).

    [qkv | z | b | a] = in_proj(x)
    qkv = silu(causal_conv_4(qkv))             depthwise, over this request's positions
    q, k (repeated to the value heads), l2-normalised; q /= sqrt(dk)
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
    o = gated_delta_rule(q, k, v, g, beta)     recurrent state per request, fp32
    y = out_proj(GatedRMSNorm(o, z))           act(z) with act = sigmoid (Qwen4Exp) or silu

Conv inputs live in a position-keyed ring, the recurrent state in one row per request. A
TARGET_VERIFY pass leaves the state alone and records the state after every verify row;
`commit_verified` keeps the one matching the accepted length. Under tensor parallelism the
key and value heads split over `tp` (vLLM's `qwen3_next.py`) and `out_proj` reduces.
Addressing: `runtime.cache.qwen4_exp_metadata`; details: docs/architecture.md, "Module notes".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.cache.qwen4_exp_metadata import Qwen4ExpUniformMetadata
from runtime.core.forward_context import ForwardContext
from runtime.distributed import ParallelGroup
from runtime.kernels.gated_delta_rule import chunked_gated_delta_rule
from runtime.layers.causal_conv import causal_conv, causal_conv_uniform
from runtime.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from runtime.layers.norm import GatedRMSNorm
from runtime.layers.weight_utils import (
    WeightShapeError,
    copy_stacked_shards,
    make_param,
    sharded_param,
)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def local_head_counts(config, tp_size: int) -> tuple[int, int]:
    """(key heads, value heads) of one rank."""
    k, v = config.linear_num_key_heads, config.linear_num_value_heads
    if k % tp_size or v % tp_size:
        raise ValueError(
            f"Gated DeltaNet's {k} key / {v} value heads do not split over {tp_size} ranks"
        )
    return k // tp_size, v // tp_size


class GatedDeltaNet(nn.Module):
    def __init__(self, config, cache_layer: int, tp: ParallelGroup | None = None):
        super().__init__()
        tp = tp or ParallelGroup()
        self.cache_layer, self.tp = cache_layer, tp
        self.num_k_heads, self.num_v_heads = local_head_counts(config, tp.size)
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = config.linear_conv_kernel_dim
        full_key = config.linear_num_key_heads * self.head_k_dim
        full_value = config.linear_num_value_heads * self.head_v_dim
        full_v_heads = config.linear_num_value_heads
        self.full_qkv_sizes = [full_key, full_key, full_value]
        # checkpoint tensors: in_proj_qkv (q, k and v stacked), in_proj_z, in_proj_b, in_proj_a
        self.in_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [full_key, full_key, full_value, full_value, full_v_heads, full_v_heads],
            tp=tp,
            checkpoint_shards=[[0, 1, 2], [3], [4], [5]],
        )
        self.in_proj_sizes = [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        self.conv1d = nn.Module()
        self.conv1d.weight = make_param((self.conv_dim, 1, self.kernel), loader=self._conv_loader)
        self.A_log = sharded_param((full_v_heads,), 0, tp.rank, tp.size, torch.float32)
        self.dt_bias = sharded_param((full_v_heads,), 0, tp.rank, tp.size, torch.float32)
        activation = getattr(config, "output_gate_type", None) or config.hidden_act
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, activation)
        self.out_proj = RowParallelLinear(full_value, config.hidden_size, tp=tp)

    def _conv_loader(self, param, loaded, shard_id=None):
        """The depthwise filter `[conv_dim, 1, K]` (or `[conv_dim, K]`): this rank's rows of
        the q, k and v parts."""
        full = sum(self.full_qkv_sizes)
        if loaded.dim() == 2:
            loaded = _Unsqueezed(loaded)
        if tuple(loaded.shape) != (full, 1, self.kernel):
            raise WeightShapeError((full, 1, self.kernel), tuple(loaded.shape), "conv1d")
        copy_stacked_shards(param.data, loaded, self.full_qkv_sizes, self.tp.rank, self.tp.size)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        pool = ctx.kv_pool
        layer = self.cache_layer
        meta = ctx.attn_metadata
        uniform = isinstance(meta, Qwen4ExpUniformMetadata)
        qkv, z, b, a = self.in_proj(x).split(self.in_proj_sizes, dim=-1)
        conv = causal_conv_uniform if uniform else causal_conv
        qkv = F.silu(conv(qkv, self.conv1d.weight.squeeze(1), pool.conv_state[layer], meta.conv))
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        repeat = self.num_v_heads // self.num_k_heads
        q = l2_normalize(q.view(-1, self.num_k_heads, self.head_k_dim).float()).repeat_interleave(
            repeat, 1
        )
        k = l2_normalize(k.view(-1, self.num_k_heads, self.head_k_dim).float()).repeat_interleave(
            repeat, 1
        )
        q = q * self.head_k_dim**-0.5
        v = v.view(-1, self.num_v_heads, self.head_v_dim).float()
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        recurrence = self._recurrence_uniform if uniform else self._recurrence
        out = recurrence(q, k, v, g, beta, ctx)
        out = self.norm(out.to(x.dtype), z.view(-1, self.num_v_heads, self.head_v_dim))
        return self.out_proj(out.flatten(1))

    def _recurrence(self, q, k, v, g, beta, ctx: ForwardContext) -> torch.Tensor:
        """Ragged rows: each request's rows padded to the longest (`g = beta = 0` there)."""
        pool, layer = ctx.kv_pool, self.cache_layer
        index, valid = ctx.attn_metadata.rows.index, ctx.attn_metadata.rows.valid
        mask = valid.unsqueeze(-1)
        padded = [
            t[index] * (mask.unsqueeze(-1) if t.dim() == 3 else mask) for t in (q, k, v, g, beta)
        ]
        slots = ctx.req_pool_indices
        start = pool.ssm_state[layer][slots]
        start = start * (ctx.prefix_lens > 0).view(-1, 1, 1, 1)  # a new request starts from zero
        verify = ctx.forward_mode.is_target_verify()
        out, final, states = chunked_gated_delta_rule(*padded, start, return_states=verify)
        if verify:
            pool.ssm_snapshots[layer][slots, : states.shape[1]] = states
        else:
            pool.ssm_state[layer][slots] = final
        return out[valid]

    def _recurrence_uniform(self, q, k, v, g, beta, ctx: ForwardContext) -> torch.Tensor:
        """Uniform rows are `[bs, q]` already: no gather, no padding."""
        pool, layer, meta = ctx.kv_pool, self.cache_layer, ctx.attn_metadata
        bs, rows = meta.num_reqs, meta.rows_per_req
        shaped = [t.view(bs, rows, *t.shape[1:]) for t in (q, k, v, g, beta)]
        slots = ctx.req_pool_indices
        start = pool.ssm_state[layer][slots] * meta.state_kept.view(-1, 1, 1, 1)
        verify = ctx.forward_mode.is_target_verify()
        out, final, states = chunked_gated_delta_rule(*shaped, start, return_states=verify)
        if verify:
            pool.ssm_snapshots[layer][slots, :rows] = states
        else:
            pool.ssm_state[layer][slots] = final
        return out.flatten(0, 1)


class _Unsqueezed:
    """A `[C, K]` filter seen as `[C, 1, K]` (lazy slices stay lazy)."""

    def __init__(self, loaded):
        self.loaded = loaded
        self.shape = torch.Size((loaded.shape[0], 1, loaded.shape[1]))

    def narrow(self, dim: int, start: int, length: int):
        if dim != 0:
            raise ValueError("only the channel dim of a conv filter is split")
        return _Unsqueezed(self.loaded.narrow(0, start, length))

    def materialize(self) -> torch.Tensor:
        loaded = self.loaded
        tensor = loaded if isinstance(loaded, torch.Tensor) else loaded.materialize()
        return tensor.unsqueeze(1)
