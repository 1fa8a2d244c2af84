# SPDX-License-Identifier: Apache-2.0
"""Causal depthwise convolution over position-keyed rings (no per-request loop).

Output at position p: `sum_j w[:, j] * x[p - (K - 1 - j) * dilation]`, reading inputs of
earlier forwards from the request's ring and this forward's from the fresh rows; positions
before 0 are zero (a fresh conv state).
"""

from __future__ import annotations

import torch

from runtime.cache.ring_access import RingAccess, ring_access
from runtime.core.forward_context import ForwardContext
from runtime.layers.position_ring import gather_ring


def conv_window_access(
    ctx: ForwardContext, kernel: int, dilation: int, ring: int, num_ring_rows: int, key: str
) -> RingAccess:
    """Ring reads of every row's `kernel` taps, built once per forward for all layers alike."""

    def build() -> RingAccess:
        offsets = (torch.arange(kernel, device=ctx.device) - (kernel - 1)) * dilation
        rows = torch.arange(ctx.num_tokens, device=ctx.device)
        return ring_access(ctx, rows, ctx.positions.unsqueeze(1) + offsets, ring, num_ring_rows)

    return ctx.memo(key, build)


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, ring_buf: torch.Tensor, access: RingAccess
) -> torch.Tensor:
    """`x [T, C]` this forward's inputs, `weight [C, K]`; writes the ring and returns `[T, C]`."""
    window = gather_ring(ring_buf, x, access.read_idx)  # [T, K, C]
    window = window.masked_fill(~access.read_valid.unsqueeze(-1), 0)
    out = (window.to(weight.dtype) * weight.t().unsqueeze(0)).sum(1)
    ring_buf[access.write_loc] = x[access.write_rows].to(ring_buf.dtype)
    return out
