# SPDX-License-Identifier: Apache-2.0
"""Rotary position embedding: default and YaRN frequencies; NeoX-halves or interleaved
pairs; full or partial (leading or trailing slice); forward or inverse rotation."""

from __future__ import annotations

import math

import torch
from torch import nn

from runtime.core.capture import compiling
from runtime.kernels import rotary as rotary_kernel


def _yarn_inv_freq(base: float, dim: int, params: dict) -> tuple[torch.Tensor, float]:
    factor = float(params["factor"])
    original_max = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 - ramp  # 1 keeps the original frequency, 0 divides it by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = (
            get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            if mscale and mscale_all_dim
            else get_mscale(factor)
        )
    return inv_freq, float(attention_factor)


def rope_inv_freq(params: dict, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[rotary_dim // 2]` and the cos/sin magnitude factor."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params["rope_theta"])
    if rope_type == "default":
        return 1.0 / (
            base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
        ), 1.0
    if rope_type == "linear":
        inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        return inv / float(params["factor"]), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, rotary_dim, params)
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, linear, yarn")


class RotaryEmbedding(nn.Module):
    """Rotates `rotary_dim` channels of each head by `position * inv_freq`.

    interleaved: pairs are `(2k, 2k+1)` (GPT-J / DeepSeek-V4); otherwise `(k, k + half)` (NeoX).
    rotate_tail: the rotated slice is the last `rotary_dim` channels, else the first.
    """

    def __init__(
        self,
        rotary_dim: int,
        rope_params: dict,
        interleaved: bool = False,
        rotate_tail: bool = False,
    ):
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
        self.rotary_dim, self.interleaved, self.rotate_tail = rotary_dim, interleaved, rotate_tail
        inv_freq, self.attention_scaling = rope_inv_freq(rope_params, rotary_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos, sin` of shape `[T, rotary_dim // 2]` in fp32."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling

    def apply(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
    ) -> torch.Tensor:
        """Rotate `x` of shape `[T, D]` or `[T, heads, D]`; `inverse` undoes the rotation.
        One operator where a kernel serves (`runtime.kernels.rotary`), else the torch
        form."""
        rd, dim = self.rotary_dim, x.shape[-1]
        lo = dim - rd if self.rotate_tail else 0
        if rotary_kernel.uses_kernel(x, cos, sin):
            return rotary_kernel.rotary(x, cos, sin, lo, self.interleaved, inverse)
        if self.interleaved and not compiling():
            if x.dim() == 3:
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            return self._rotate_pairs_eagerly(x, cos, -sin if inverse else sin, lo)
        return rotary_kernel.rotary_reference(x, cos, sin, lo, self.interleaved, inverse)

    def _rotate_pairs_eagerly(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lo: int
    ) -> torch.Tensor:
        """Interleaved pairs rotated in place in a copy of `x`, with no stack of the halves
        and no concatenation with the channels that are not rotated (a compiled step keeps
        the functional form of `apply`, which the compiler fuses).

        In fp32/fp64 each pair `(x1, x2)` is one complex number and the rotation one
        complex product by `cos + i sin`, as DeepSeek's reference `apply_rotary_emb` writes
        it: `x1 cos - x2 sin, x2 cos + x1 sin` in one contiguous pass instead of six strided
        ones. The complex kernel may fuse a product into its sum,
        so a value can differ from the real form's by an ulp."""
        rd = self.rotary_dim
        out = x.clone(memory_format=torch.contiguous_format)
        if x.dtype in (torch.float32, torch.float64):
            pairs = torch.view_as_complex(out[..., lo : lo + rd].unflatten(-1, (rd // 2, 2)))
            pairs.mul_(torch.complex(cos.to(x.dtype), sin.to(x.dtype)))
            return out
        rot = x[..., lo : lo + rd].float()
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out[..., lo : lo + rd : 2] = x1 * cos - x2 * sin
        out[..., lo + 1 : lo + rd : 2] = x2 * cos + x1 * sin
        return out
