# SPDX-License-Identifier: Apache-2.0
"""Rotary position embedding as a Triton kernel (the CUDA kernel of `nextn::rotary`;
`runtime.kernels.rotary` defines it and its torch reference).

One program per row (token and head): it copies the channels outside the rotated slice and
writes each pair `(x1, x2)` of the slice as `(x1 cos - x2 sin, x2 cos + x1 sin)` in fp32,
rounded once to the row's dtype. The two sets of channels are disjoint, so no channel is
written twice. Inputs are made contiguous by the launcher. Under `TRITON_INTERPRET=1` (set
before this module is imported) the kernel runs on CPU tensors through Triton's
interpreter, which is how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 256  # channels per chunk of the copy


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    heads,
    D,
    lo,
    half,
    sign,
    INTERLEAVED: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    t = r // heads
    x_row = x_ptr + r * D
    o_row = out_ptr + r * D
    d = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + d
        keep = (dd < D) & ((dd < lo) | (dd >= lo + 2 * half))
        tl.store(o_row + dd, tl.load(x_row + dd, mask=keep), mask=keep)
    k = tl.arange(0, BLOCK_HALF)
    km = k < half
    if INTERLEAVED:
        i1 = lo + 2 * k
        i2 = i1 + 1
    else:
        i1 = lo + k
        i2 = i1 + half
    x1 = tl.load(x_row + i1, mask=km, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + i2, mask=km, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * half + k, mask=km, other=0.0)
    s = tl.load(sin_ptr + t * half + k, mask=km, other=0.0) * sign
    tl.store(o_row + i1, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=km)
    tl.store(o_row + i2, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=km)


def rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lo: int,
    interleaved: bool,
    inverse: bool,
) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    half = cos.shape[1]
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if rows == 0:
        return out
    heads = x.shape[1] if x.dim() == 3 else 1
    _rotary_kernel[(rows,)](
        x,
        cos.float().contiguous(),
        sin.float().contiguous(),
        out,
        heads,
        x.shape[-1],
        lo,
        half,
        -1.0 if inverse else 1.0,
        INTERLEAVED=interleaved,
        BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        BLOCK_D=BLOCK_D,
    )
    return out
