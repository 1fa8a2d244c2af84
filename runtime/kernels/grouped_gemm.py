# SPDX-License-Identifier: Apache-2.0
"""Grouped GEMM: rows of `x` sorted by group, each group times its own weight matrix.

`x [A, K]`, `weight [G, N, K]` (linear layout, out x in), `group_ends [G]` int32 running
row counts: rows `group_ends[g-1]:group_ends[g]` use `weight[g]`. Returns `[A, N]`.
The fast path is `torch.nn.functional.grouped_mm` (CPU and CUDA); it needs 16-byte
aligned strides, otherwise the reference runs.

`grouped_gemm_op` is the same product as one opaque operator (`torch.library.custom_op`
with a fake implementation), so a captured step keeps it as a single node: the output's
shape depends only on the input's, while the group sizes are data. (The compiler's own
meta function for `grouped_mm` accepts bf16 inputs only.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_gemm_reference(
    x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor
) -> torch.Tensor:
    out = x.new_empty((x.shape[0], weight.shape[1]))
    start = 0
    for g, end in enumerate(group_ends.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ weight[g].T
        start = end
    return out


def _aligned(x: torch.Tensor, weight: torch.Tensor) -> bool:
    size = x.element_size()
    return (x.shape[1] * size) % 16 == 0 and (weight.shape[1] * size) % 16 == 0


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 0:
        return x.new_empty((0, weight.shape[1]))
    if not hasattr(F, "grouped_mm") or x.dtype != weight.dtype or not _aligned(x, weight):
        return grouped_gemm_reference(x, weight, group_ends)
    return F.grouped_mm(x.contiguous(), weight.transpose(1, 2), offs=group_ends.to(torch.int32))


@torch.library.custom_op("nextn::grouped_gemm", mutates_args=())
def grouped_gemm_op(
    x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor
) -> torch.Tensor:
    return grouped_gemm(x, weight, group_ends)


@grouped_gemm_op.register_fake
def _(x, weight, group_ends):
    return x.new_empty((x.shape[0], weight.shape[1]))
