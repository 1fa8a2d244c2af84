# SPDX-License-Identifier: Apache-2.0
"""RMSNorm, weighted and weightless. Statistics are taken in fp32."""

from __future__ import annotations

import torch
from torch import nn

from runtime.kernels.rms_norm import rms_norm, uses_kernel
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
        if uses_kernel(x):
            return rms_norm(x, self.weight, self.eps)  # one pass (same math)
        return (rms_normalize(x, self.eps) * self.weight.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class WeightlessRMSNorm(nn.Module):
    """RMSNorm without a learned scale (DeepSeek-V4's per-head query norm)."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if uses_kernel(x):
            return rms_norm(x, None, self.eps)  # one pass (same math)
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps).to(x.dtype)


class OffsetRMSNorm(nn.Module):
    """Zero-centred RMSNorm: `rms_normalize(x) * (1 + weight)` (Gemma / Qwen3.5 convention).

    With `group_size`, statistics are taken per group of that many channels (one group per
    hyper-connection stream) while the weight stays per channel.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, group_size: int | None = None, params_dtype=None
    ):
        super().__init__()
        if group_size is not None and hidden_size % group_size:
            raise ValueError(f"{hidden_size} channels do not split into groups of {group_size}")
        self.eps, self.group_size = eps, group_size
        self.weight = make_param((hidden_size,), params_dtype)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group_size is None:
            normed = rms_normalize(x, self.eps)
        else:
            normed = rms_normalize(x.unflatten(-1, (-1, self.group_size)), self.eps).flatten(-2)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """`(weight * rms_normalize(x)) * act(gate)` with a ones-centred weight (the Gated DeltaNet
    output norm); the normalised x is cast to the input dtype before the weight, as in
    transformers' Qwen3.5 `RMSNormGated`."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, activation: str = "silu", params_dtype=None
    ):
        super().__init__()
        if activation not in ("silu", "sigmoid"):
            raise ValueError(
                f"unsupported gated-norm activation {activation!r}; use silu or sigmoid"
            )
        self.eps, self.activation = eps, activation
        self.weight = make_param((hidden_size,), params_dtype)
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        normed = self.weight * rms_normalize(x, self.eps).to(dtype)
        gate = gate.float()
        act = (
            torch.sigmoid(gate) if self.activation == "sigmoid" else torch.nn.functional.silu(gate)
        )
        return (normed * act).to(dtype)
