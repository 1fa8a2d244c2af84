# SPDX-License-Identifier: Apache-2.0
"""Causal depthwise convolution over position-keyed rings (no per-request loop).

Output at position p: `sum_j w[:, j] * x[p - (K - 1 - j) * dilation]`, reading inputs of
earlier forwards from the request's ring and this forward's from the fresh rows; positions
before 0 are zero (a fresh conv state). The addressing comes prepared with the forward's
metadata (`runtime.cache.qwen4_exp_metadata`): ragged rows read `[ring | fresh rows]`,
uniform rows write theirs into the ring first and read every tap from it.
"""

from __future__ import annotations

import torch

from runtime.cache.qwen4_exp_metadata import UniformRing
from runtime.cache.ring_access import RingAccess
from runtime.layers.position_ring import gather_ring


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, ring_buf: torch.Tensor, access: RingAccess
) -> torch.Tensor:
    """`x [T, C]` this forward's inputs, `weight [C, K]`; writes the ring and returns `[T, C]`."""
    window = gather_ring(ring_buf, x, access)  # [T, K, C]
    window = window.masked_fill(~access.read_valid.unsqueeze(-1), 0)
    out = (window.to(weight.dtype) * weight.t().unsqueeze(0)).sum(1)
    ring_buf[access.write_loc] = x[access.write_rows].to(ring_buf.dtype)
    return out


def causal_conv_uniform(
    x: torch.Tensor, weight: torch.Tensor, ring_buf: torch.Tensor, ring: UniformRing
) -> torch.Tensor:
    """The same on uniform rows: write the ring, then read every tap from it."""
    ring_buf[ring.write] = x.to(ring_buf.dtype)
    window = ring_buf[ring.read].masked_fill(~ring.valid.unsqueeze(-1), 0)  # [T, K, C]
    return (window.to(weight.dtype) * weight.t().unsqueeze(0)).sum(1)
