# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V4's compressor pooling as one operator (transformers'
`DeepseekV4CSACompressor` / `DeepseekV4HCACompressor`):

    entry[b, c] = sum_j softmax_j(gate[b, j, c]) kv[b, j, c]      (rows not valid at -inf)

`rows [B, L, 2 W]` fp32 (`[kv | gate]` state rows of each block, `W = overlap * dim`,
`L = overlap * ratio`), `valid [B, L]` -> `[B, dim]` fp32; for `overlap` 2 (CSA) the first
`ratio` rows give their first channel half, the others their second.

The torch form slices, concatenates, masks, takes the softmax, multiplies and sums: about
a dozen operators for each compressor (two per CSA layer) of a captured step. The C++
kernel (`nextn_cpu::compressor_pool`, `csrc/compressor_pool.cpp`) on CPU and the custom op
`nextn::compressor_pool` with a Triton kernel (`runtime.kernels.triton.compressor_pool`)
on CUDA make it one node, eagerly and in captured steps, the softmax as torch's; only the
order of the sums differs. The reference defines correctness.
"""

from __future__ import annotations

import torch

from runtime.kernels import cpu_extension
from runtime.kernels import triton as triton_kernels


def compressor_pool_reference(
    rows: torch.Tensor, valid: torch.Tensor, dim: int, ratio: int, overlap: int
) -> torch.Tensor:
    """The pooling in plain torch (the test oracle)."""
    width = overlap * dim
    kv, gate = rows[..., :width], rows[..., width:]
    if overlap == 2:
        kv = torch.cat([kv[:, :ratio, :dim], kv[:, ratio:, dim:]], dim=1)
        gate = torch.cat([gate[:, :ratio, :dim], gate[:, ratio:, dim:]], dim=1)
    gate = gate.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    return (torch.softmax(gate, dim=1) * kv).sum(dim=1)


def uses_kernel(rows: torch.Tensor, valid: torch.Tensor) -> bool:
    """Whether `compressor_pool` has a kernel for these rows, eagerly and in captured
    steps: fp32 `[B, L, 2 W]` rows and a bool `[B, L]` mask, no grad wanted, and on CPU the
    C++ kernels loaded, on CUDA Triton importable."""
    if rows.dtype != torch.float32 or rows.dim() != 3 or valid.dtype != torch.bool:
        return False
    if valid.shape != rows.shape[:2] or torch.is_grad_enabled():
        return False
    if rows.device.type == "cpu":
        return cpu_extension.serves(rows)
    return rows.device.type == "cuda" and triton_kernels.available()


def compressor_pool(
    rows: torch.Tensor, valid: torch.Tensor, dim: int, ratio: int, overlap: int
) -> torch.Tensor:
    """The pooling as one operator (callers check `uses_kernel` first)."""
    if rows.device.type == "cpu":
        return torch.ops.nextn_cpu.compressor_pool(rows, valid, dim, ratio, overlap)
    return compressor_pool_op(rows, valid, dim, ratio, overlap)


@torch.library.custom_op("nextn::compressor_pool", mutates_args=())
def compressor_pool_op(
    rows: torch.Tensor, valid: torch.Tensor, dim: int, ratio: int, overlap: int
) -> torch.Tensor:
    return compressor_pool_reference(rows, valid, dim, ratio, overlap).contiguous()


@compressor_pool_op.register_kernel("cuda")
def _(rows, valid, dim, ratio, overlap):
    from runtime.kernels.triton import compressor_pool as triton_pool

    return triton_pool.compressor_pool(rows, valid, dim, ratio, overlap)


@compressor_pool_op.register_fake
def _(rows, valid, dim, ratio, overlap):
    return rows.new_empty((rows.shape[0], dim))
