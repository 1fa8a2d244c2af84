# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V4's compressed entries from their blocks' state rows as one operator:

    entry = rotate(rms_norm(pool(rows, valid)) * weight, at position)

the compressor's pooling (`runtime.kernels.compressor_pool`), its RMSNorm, the rotary
table at each entry's first position and the rotation of the entry's trailing channels
(`runtime.kernels.rotary`), for fp32 entries. Taken one by one these are about a dozen
operators for each compressor of a captured step (the rotary table's among them); as one
operator one node. On CPU `nextn_cpu::compressor_entries` (`csrc/compressor_entries.cpp`)
calls the three C++ kernels and the rotary table's ATen operators in turn (the values of
the steps one by one, bit for bit); on CUDA the custom op `nextn::compressor_entries` calls
the Triton kernels of the pooling and the rotation around torch's norm. The reference
defines correctness.
"""

from __future__ import annotations

import torch

from runtime.kernels import cpu_extension
from runtime.kernels import triton as triton_kernels
from runtime.kernels.compressor_pool import compressor_pool_op, compressor_pool_reference
from runtime.kernels.rms_norm import rms_norm_reference
from runtime.kernels.rotary import rotary_op, rotary_reference


def compressor_entries_reference(
    rows,
    valid,
    norm_weight,
    eps,
    positions,
    inv_freq,
    scaling,
    dim,
    ratio,
    overlap,
    lo,
    interleaved,
) -> torch.Tensor:
    """The entries in plain torch (the test oracle)."""
    normed = rms_norm_reference(
        compressor_pool_reference(rows, valid, dim, ratio, overlap), norm_weight, eps
    )
    freqs = positions.float().unsqueeze(-1) * inv_freq
    cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
    return rotary_reference(normed, cos, sin, lo, interleaved, False)


def uses_kernel(rows: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether `compressor_entries` is one operator for these rows, eagerly and in captured
    steps: fp32 `[B, L, 2 W]` rows, a bool `[B, L]` mask, `[B]` positions, no grad wanted,
    and on CPU the C++ kernels loaded, on CUDA Triton importable."""
    if rows.dtype != torch.float32 or rows.dim() != 3 or valid.dtype != torch.bool:
        return False
    if valid.shape != rows.shape[:2] or positions.shape != rows.shape[:1]:
        return False
    if torch.is_grad_enabled():
        return False
    if rows.device.type == "cpu":
        return cpu_extension.serves(rows)
    return rows.device.type == "cuda" and triton_kernels.available()


def compressor_entries(*args) -> torch.Tensor:
    """The entries as one operator (callers check `uses_kernel` first); arguments as the
    reference's."""
    if args[0].device.type == "cpu":
        return torch.ops.nextn_cpu.compressor_entries(*args)
    return compressor_entries_op(*args)


@torch.library.custom_op("nextn::compressor_entries", mutates_args=())
def compressor_entries_op(
    rows: torch.Tensor,
    valid: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    dim: int,
    ratio: int,
    overlap: int,
    lo: int,
    interleaved: bool,
) -> torch.Tensor:
    pooled = compressor_pool_op(rows, valid, dim, ratio, overlap)
    normed = rms_norm_reference(pooled, norm_weight, eps)
    freqs = positions.float().unsqueeze(-1) * inv_freq
    cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
    return rotary_op(normed.contiguous(), cos, sin, lo, interleaved, False)


@compressor_entries_op.register_fake
def _(
    rows,
    valid,
    norm_weight,
    eps,
    positions,
    inv_freq,
    scaling,
    dim,
    ratio,
    overlap,
    lo,
    interleaved,
):
    return rows.new_empty((rows.shape[0], dim))
