# SPDX-License-Identifier: Apache-2.0
"""Rotary position embedding of a slice of each head's channels as one operator:

    out[..., lo + i1] = x1 cos - x2 sin,   out[..., lo + i2] = x2 cos + x1 sin

for each pair `(i1, i2)` of the `R = 2 * cos.shape[1]` rotated channels (`(2k, 2k + 1)`
interleaved, as GPT-J and DeepSeek-V4 pair them, else `(k, k + R / 2)`, NeoX's halves),
`sin` negated for the inverse rotation; the other channels copied. `x [T, D]` or
`[T, H, D]`, `cos`, `sin` `[T, R / 2]` fp32 -> `x`'s shape and dtype, the rotation in fp32.

The torch form slices, widens, multiplies, stacks and concatenates: about a dozen
operators per call and five calls per DeepSeek-V4 layer (queries, keys, the compressor's
entries, the indexer's queries, the inverse rotation of the output), the largest share of a
captured decode step's operators. The C++ kernel (`nextn_cpu::rotary`, `csrc/rotary.cpp`)
on CPU and the custom op `nextn::rotary` with a Triton kernel
(`runtime.kernels.triton.rotary`) on CUDA make it one node, eagerly and in captured steps,
each pair's products in the torch form's order. The reference defines correctness.
"""

from __future__ import annotations

import torch

from runtime.kernels import cpu_extension
from runtime.kernels import triton as triton_kernels

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rotary_reference(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lo: int,
    interleaved: bool,
    inverse: bool,
) -> torch.Tensor:
    """The rotation in plain torch (the test oracle, and the compiled form where no kernel
    serves)."""
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if inverse:
        sin = -sin
    rd, dim = 2 * cos.shape[-1], x.shape[-1]
    rot = x[..., lo : lo + rd].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., : rd // 2], rot[..., rd // 2 :]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    out = out.to(x.dtype)
    if rd == dim:
        return out
    return torch.cat((x[..., :lo], out, x[..., lo + rd :]), dim=-1)


def uses_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rotary` has a kernel for these operands, eagerly and in captured steps:
    `x [T, D]` or `[T, H, D]` in fp32, bf16 or fp16, `cos` and `sin` `[T, R / 2]` fp32, no
    grad wanted, and on CPU the C++ kernels loaded, on CUDA Triton importable."""
    if x.dtype not in KERNEL_DTYPES or x.dim() not in (2, 3) or torch.is_grad_enabled():
        return False
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[0]:
        return False
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        return False
    if x.device.type == "cpu":
        return cpu_extension.serves(x)
    return x.device.type == "cuda" and triton_kernels.available()


def rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lo: int,
    interleaved: bool,
    inverse: bool,
) -> torch.Tensor:
    """The rotation as one operator (callers check `uses_kernel` first)."""
    if x.device.type == "cpu":
        return torch.ops.nextn_cpu.rotary(x, cos, sin, lo, interleaved, inverse)
    return rotary_op(x, cos, sin, lo, interleaved, inverse)


@torch.library.custom_op("nextn::rotary", mutates_args=())
def rotary_op(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lo: int,
    interleaved: bool,
    inverse: bool,
) -> torch.Tensor:
    return rotary_reference(x, cos, sin, lo, interleaved, inverse).contiguous()


@rotary_op.register_kernel("cuda")
def _(x, cos, sin, lo, interleaved, inverse):
    from runtime.kernels.triton import rotary as triton_rotary

    return triton_rotary.rotary(x, cos, sin, lo, interleaved, inverse)


@rotary_op.register_fake
def _(x, cos, sin, lo, interleaved, inverse):
    return x.new_empty(x.shape)
