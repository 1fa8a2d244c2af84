# SPDX-License-Identifier: Apache-2.0
"""Products of a few fp32 rows with bf16 weights, each weight read once (CPU).

`x [G, M, K]` fp32, `weight [E, N, K]` bf16 (linear layout, out x in), `index [G]`: group
`g` multiplies its `M` rows by `weight[index[g]]`; without `index`, `weight[g]` (`E == G`)
or `weight[0]` for every group (`E == 1`). Returns `[G, M, N]` fp32, the bf16 weights
widened exactly, so only the order of the sums differs from `x @ weight.float().T`.

Why: a captured decode or verify step of a small batch multiplies one to eight rows by each
weight, where a GEMM library or the compiler's reduction reads (or widens) the weight once
per row. The kernel (`nextn_cpu::narrow_product`, `csrc/nextn_cpu.cpp`) loads each block of
weight rows once, widens it in registers and feeds every row that reads it, so a routed
expert chosen by several rows is read once too (written like SGLang's CPU kernels,
`sgl-kernel/csrc/cpu`). It lives in the project's extension
(`runtime.kernels.cpu_extension`); where that cannot be built the products keep their
other paths. The reference defines correctness.
"""

from __future__ import annotations

import torch


def narrow_product_reference(
    x: torch.Tensor, weight: torch.Tensor, index: torch.Tensor | None = None
) -> torch.Tensor:
    """The product in plain torch (the test oracle)."""
    if index is not None:
        weight = weight[index]
    elif weight.shape[0] == 1:
        weight = weight.expand(x.shape[0], *weight.shape[1:])
    return torch.bmm(x, weight.to(x.dtype).transpose(1, 2))


def narrow_product(
    x: torch.Tensor, weight: torch.Tensor, index: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel (`cpu_extension.load` first; see the module docstring for the shapes)."""
    return torch.ops.nextn_cpu.narrow_product(x, weight, index)
