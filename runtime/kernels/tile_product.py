# SPDX-License-Identifier: Apache-2.0
"""fp32 rows times a bf16 weight on a CPU's AMX tiles, as exact as an fp32 product.

`x [M, K]` fp32 times `weight [N, K]` whose values bf16 holds exactly (a bf16 checkpoint
served in fp32; `narrow_weights` keeps its bf16 copy) -> `[M, N]` fp32, differing from an
fp32 product only in the order of its sums. Each row is split by truncation into three bf16
parts, `x = hi + mid + lo` exactly, and every part multiplied by the weight; a bf16 x bf16
product is exact in fp32 and the tiles sum in fp32 (the split NVIDIA's 3xTF32 uses to get
fp32 accuracy from TF32 tensor cores). Why: prefill GEMMs are compute-bound and AMX
multiplies bf16 much faster than AVX-512 multiplies fp32, but rounding rows to bf16 would
change the model's numbers.

`pack` lays the weight out once for the kernel (`nextn_cpu::tile_product`,
`csrc/nextn_cpu.cpp`), which needs the project's extension (`runtime.kernels.cpu_extension`),
AMX-BF16 and the kernel's permission for tile registers (`cpu_extension.tiles_granted`).
The reference defines correctness. Layout details: docs/architecture.md, "Module notes".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels import cpu_extension
from runtime.kernels.grouped_gemm import grouped_gemm_reference

TILE_MULTIPLE = 32


def tile_product_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The product in plain torch (the test oracle)."""
    return F.linear(x, weight.to(x.dtype))


def host_has_tiles() -> bool:
    """Whether this CPU has AMX tiles (what a weight's packed layout is for)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


def ready() -> bool:
    """The kernel is loaded, the CPU has AMX-BF16 and the process may use its tiles."""
    return cpu_extension.available() and cpu_extension.tiles_granted()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight [..., N, K]` bf16 -> `[..., Kp / 2, Np, 2]` bf16, the layout `tile_product`
    reads (a leading dim: one weight per group)."""
    *lead, n, k = weight.shape
    np_, kp = (-(-size // TILE_MULTIPLE) * TILE_MULTIPLE for size in (n, k))
    padded = weight.new_zeros((*lead, np_, kp))
    padded[..., :n, :k] = weight
    return padded.view(*lead, np_, kp // 2, 2).transpose(-3, -2).contiguous()


def tile_product(
    x: torch.Tensor, packed: torch.Tensor, n: int, group_ends: torch.Tensor | None = None
) -> torch.Tensor:
    """`x [M, K]` fp32 times the `[n, K]` weight `pack` made `packed` of, or with
    `group_ends [E]` (running row counts) rows `group_ends[e-1]:group_ends[e]` times the
    weight `e` of `pack` of `[E, n, K]` weights (rows past the last group: zeros).
    `ready()` first."""
    return torch.ops.nextn_cpu.tile_product(x, packed, n, group_ends)


def tile_product_grouped_reference(
    x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor
) -> torch.Tensor:
    """The grouped product in plain torch (the test oracle), rows past the last group zero."""
    out = grouped_gemm_reference(x, weight.to(x.dtype), group_ends)
    out[int(group_ends[-1]) :] = 0
    return out
