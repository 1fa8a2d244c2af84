# SPDX-License-Identifier: Apache-2.0
"""Products with weights held in a checkpoint's quantized format (FP8 block, MXFP4).

Formats are those of the DeepSeek-V3/V4 releases and the OCP Microscaling spec (MXFP4);
their layouts are in docs/quantization.md, "Operator notes". Each product is one
`torch.library.custom_op` with a fake implementation, so a captured step holds it as one
opaque node whose output shape follows its input's: `nextn::fp8_block_linear` (optionally
batched over groups, e.g. DeepSeek-V4's `wo_a`) and `nextn::quantized_grouped_product`
(rows sorted by group, `runtime.kernels.grouped_gemm`'s contract, `fmt` "fp8" or "mxfp4").

The references dequantize the whole weight to `x.dtype` (in float32 first, exactly as the
loader's dequantize-on-load does) and multiply: they define correctness and are the ops'
bodies where no kernel serves. Layers call `fp8_linear` and `grouped_quantized`, which go
to the C++ kernels on CPU once the extension is loaded (`csrc/quant_cpu.cpp`, decoding the
weight tile by tile inside the product) and to `runtime.kernels.quantized_triton` on CUDA
where triton is installed: one opaque node either way, no Python inside a compiled step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels import cpu_extension, quantized_triton
from runtime.kernels.grouped_gemm import grouped_gemm

FP8_DTYPE = torch.float8_e4m3fn
MXFP4_GROUP = 32
_E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
_E2M1_VALUES = torch.tensor(_E2M1_MAGNITUDES + [-m for m in _E2M1_MAGNITUDES])


def e8m0_values(scale: torch.Tensor) -> torch.Tensor:
    """float32 values of E8M0 scale bytes (uint8)."""
    return torch.where(scale == 255, torch.nan, torch.exp2(scale.float() - 127))


def dequant_fp8(
    codes: torch.Tensor, scale_inv: torch.Tensor, block: list[int] | tuple[int, int], dtype
) -> torch.Tensor:
    """`codes [..., N, K]` with `scale_inv [..., ceil(N/b0), ceil(K/b1)]` -> `dtype`."""
    b0, b1 = block
    n, k = codes.shape[-2:]
    s = scale_inv.float().repeat_interleave(b0, dim=-2).repeat_interleave(b1, dim=-1)
    return (codes.float() * s[..., :n, :k]).to(dtype)


def dequant_mxfp4(codes: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """`codes [..., K/2]` uint8 with E8M0 `scale [..., K/32]` -> `[..., K]` `dtype`."""
    lead, k = tuple(codes.shape[:-1]), 2 * codes.shape[-1]
    nibbles = torch.stack((codes & 0x0F, codes >> 4), dim=-1).to(torch.int32)
    values = _E2M1_VALUES.to(codes.device)[nibbles].reshape(*lead, k // MXFP4_GROUP, MXFP4_GROUP)
    return (values * e8m0_values(scale).unsqueeze(-1)).reshape(*lead, k).to(dtype)


def dequant(codes: torch.Tensor, scale: torch.Tensor, fmt: str, block_k: int, dtype):
    """A weight of either format in `dtype` (FP8 with one scale row per weight row)."""
    if fmt == "fp8":
        return dequant_fp8(codes, scale, (1, block_k), dtype)
    if fmt == "mxfp4":
        return dequant_mxfp4(codes, scale, dtype)
    raise ValueError(f"unknown quantized format {fmt!r}: expected 'fp8' or 'mxfp4'")


def fp8_block_linear_reference(
    x: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor, block: list[int]
) -> torch.Tensor:
    """Dequantize, then multiply (the oracle)."""
    weight = dequant_fp8(codes, scale_inv, block, x.dtype)
    return F.linear(x, weight) if codes.dim() == 2 else torch.bmm(x, weight.transpose(1, 2))


def _kernel_serves(x: torch.Tensor) -> bool:
    return cpu_extension.serves(x) and x.dtype in (torch.float32, torch.bfloat16)


def fp8_linear(
    x: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor, block: list[int]
) -> torch.Tensor:
    """What layers call: on CPU the C++ kernel (an operator with a fake, which a compiled
    step calls without Python), elsewhere the custom op."""
    if not _kernel_serves(x):
        return fp8_block_linear(x, codes, scale_inv, block)
    kernel = torch.ops.nextn_cpu.fp8_block_linear
    if codes.dim() == 3:
        return kernel(x, codes, scale_inv, block[0], block[1])
    out = kernel(x.reshape(-1, x.shape[-1]), codes, scale_inv, block[0], block[1])
    return out.view(*x.shape[:-1], codes.shape[0])


@torch.library.custom_op("nextn::fp8_block_linear", mutates_args=())
def fp8_block_linear(
    x: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor, block: list[int]
) -> torch.Tensor:
    if x.device.type == "cuda" and codes.dim() == 2 and quantized_triton.available():
        return quantized_triton.fp8_block_linear_triton(x, codes, scale_inv, block)
    return fp8_block_linear_reference(x, codes, scale_inv, block)


@fp8_block_linear.register_fake
def _(x, codes, scale_inv, block):
    return x.new_empty((*x.shape[:-1], codes.shape[-2]))


def quantized_grouped_reference(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    group_ends: torch.Tensor,
    fmt: str,
    block_k: int,
) -> torch.Tensor:
    """Dequantize every group's weight, then the grouped product (the oracle)."""
    return grouped_gemm(x, dequant(codes, scale, fmt, block_k, x.dtype), group_ends)


@torch.library.custom_op("nextn::quantized_grouped_product", mutates_args=())
def quantized_grouped_product(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    group_ends: torch.Tensor,
    fmt: str,
    block_k: int,
) -> torch.Tensor:
    return quantized_grouped_reference(x, codes, scale, group_ends, fmt, block_k)


def grouped_quantized(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    group_ends: torch.Tensor,
    fmt: str,
    block_k: int,
) -> torch.Tensor:
    """What the experts call: on CPU the C++ kernel, elsewhere the custom op."""
    if _kernel_serves(x):
        op = torch.ops.nextn_cpu.quantized_grouped_product
        return op(x, codes, scale, group_ends, fmt, block_k)
    return quantized_grouped_product(x, codes, scale, group_ends, fmt, block_k)


@quantized_grouped_product.register_fake
def _(x, codes, scale, group_ends, fmt, block_k):
    return x.new_empty((x.shape[0], codes.shape[1]))
