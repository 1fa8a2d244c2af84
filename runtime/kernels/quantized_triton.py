# SPDX-License-Identifier: Apache-2.0
"""Triton kernel for the FP8-block product on GPUs (`quantized_product.fp8_block_linear`).

`x [M, K]` times `codes [N, K]` e4m3 (passed as their uint8 bytes) with `scale [ceil(N/b0),
ceil(K/b1)]` float32 -> `[M, N]` float32. Each program computes a `BLOCK_M x BLOCK_N` tile
of the output; each `BLOCK_K` slice of its weight rows is decoded in registers (the e4m3
bits moved into an fp16's, which widens exactly: the formats differ only in exponent bias,
so the value is `fp16 * 2^8`), multiplied by its scales and accumulated with `tl.dot` in
IEEE fp32, so only the order of the sums differs from the reference. Tested on CPU under
`TRITON_INTERPRET=1`; `available()` is False without triton.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the reference serves
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _fp8_block_linear_kernel(
        x_ptr,
        codes_ptr,
        scale_ptr,
        out_ptr,
        M,
        N,
        K,
        KB,
        b0,
        b1,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x_mask = (rm[:, None] < M) & (rk[None, :] < K)
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=x_mask, other=0.0)
            w_mask = (rn[:, None] < N) & (rk[None, :] < K)
            b = tl.load(codes_ptr + rn[:, None] * K + rk[None, :], mask=w_mask, other=0)
            b = b.to(tl.int32)
            bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
            w = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
            s_ptrs = scale_ptr + (rn[:, None] // b0) * KB + rk[None, :] // b1
            w = w * tl.load(s_ptrs, mask=w_mask, other=0.0)
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        out_mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=out_mask)


def fp8_block_linear_triton(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block: list[int]
) -> torch.Tensor:
    """`x [..., K]` (any float dtype) -> `[..., N]` in `x.dtype`."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = flat.shape
    n = codes.shape[0]
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    block_m, block_n, block_k = 16, 32, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_linear_kernel[grid](
        flat,
        codes.contiguous().view(torch.uint8),
        scale.contiguous(),
        out,
        m,
        n,
        k,
        scale.shape[1],
        block[0],
        block[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out.to(x.dtype).view(*x.shape[:-1], n)
