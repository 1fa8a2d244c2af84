# SPDX-License-Identifier: Apache-2.0
"""Gated residual hyper-connections (Qwen4Exp "GR"; transformers'
`Qwen4ExpTextGatedResidual`).

The residual is `n` streams stored flat, `R [T, n*H]` (stream-major). Around a block:

    R^ = OffsetRMSNorm_per_stream(R)
    G  = sigmoid(W_u silu(W_d R^ / n))          elementwise gate, [T, n, H]
    x  = mean_i(G_i * R^_i)                     the block input, [T, H]
    s  = 2 sigmoid(W_w R^ / n)                  one injection weight per stream, [T, n]
    R' = R + s (x) block(x)                     the skip path uses the un-normalised R

`W_d` and `W_w` read the same input and run as one merged GEMM. The final mixer has no
`W_w` (`use_combine=False`): it only reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from runtime.layers.norm import OffsetRMSNorm


class GatedResidual(nn.Module):
    def __init__(
        self, hc_count: int, hidden_size: int, lowrank: int, eps: float, use_combine: bool = True
    ):
        super().__init__()
        self.hc_count, self.hidden_size, self.lowrank = hc_count, hidden_size, lowrank
        width = hc_count * hidden_size
        self.hc_norm = OffsetRMSNorm(width, eps, group_size=hidden_size)
        self.use_combine = use_combine
        if use_combine:  # W_d and W_w share their input: one GEMM
            self.input_mix_weight_down_block_inject = MergedColumnParallelLinear(
                width, [lowrank, hc_count]
            )
        else:
            self.input_mix_weight_down = ReplicatedLinear(width, lowrank)
        self.input_mix_weight_up = ReplicatedLinear(lowrank, width)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`streams [T, n*H]` -> (block input `[T, H]`, injection weights `[T, n]` or None)."""
        n = self.hc_count
        normed = self.hc_norm(streams)
        if self.use_combine:
            down, inject = self.input_mix_weight_down_block_inject(normed).split(
                [self.lowrank, n], dim=-1
            )
        else:
            down, inject = self.input_mix_weight_down(normed), None
        gate = torch.sigmoid(self.input_mix_weight_up(F.silu(down / n)))
        mixed = (
            gate.unflatten(-1, (n, self.hidden_size)) * normed.unflatten(-1, (n, self.hidden_size))
        ).mean(dim=-2)
        weights = None if inject is None else 2 * torch.sigmoid(inject / n)
        return mixed, weights

    @staticmethod
    def combine(
        streams: torch.Tensor, block_out: torch.Tensor, weights: torch.Tensor | None
    ) -> torch.Tensor:
        """`R + s (x) y` (unit weights when `weights` is None): `[T, n*H]`."""
        n = streams.shape[-1] // block_out.shape[-1]
        injection = (
            block_out.unsqueeze(-2)
            if weights is None
            else block_out.unsqueeze(-2) * weights.unsqueeze(-1)
        )
        return streams + injection.expand(-1, n, -1).flatten(-2)
