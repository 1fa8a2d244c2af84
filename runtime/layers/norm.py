# SPDX-License-Identifier: Apache-2.0
"""RMSNorm, weighted and weightless. Statistics are taken in fp32."""

from __future__ import annotations

import torch
from torch import nn

from runtime.layers.weight_utils import make_param


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps)` over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """`rms_normalize(x) * weight`, cast back to the input dtype.

    The weight multiplies in fp32 before the cast (DeepSeek-V4 keeps norm weights in fp32).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = make_param((hidden_size,), params_dtype)
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * self.weight.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class WeightlessRMSNorm(nn.Module):
    """RMSNorm without a learned scale (DeepSeek-V4's per-head query norm)."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps).to(x.dtype)
