# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V4's compressor as Triton kernels: its pooling (the CUDA kernel of
`nextn::compressor_pool`; `runtime.kernels.compressor_pool` defines it and its torch
reference) and its state rows (`nextn::compressor_rows`, `runtime.kernels.compressor_rows`).

One program per entry and block of channels: it loads the block's `L` gate and kv rows of
those channels as `[L, BLOCK_C]` tiles (for overlap 2 the rows past `ratio` shifted to the
second channel half), takes the softmax over the rows (rows not valid at -inf) and the
weighted sum, all in fp32. Inputs are made contiguous by the launcher. Under
`TRITON_INTERPRET=1` (set before this module is imported) the kernel runs on CPU tensors
through Triton's interpreter, which is how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 64  # channels per program


@triton.jit
def _pool_kernel(
    rows_ptr,
    valid_ptr,
    out_ptr,
    dim,
    ratio,
    L,
    OVERLAP: tl.constexpr,
    L_PAD: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, L_PAD)
    width = OVERLAP * dim
    cm = c < dim
    jm = j < L
    ok = tl.load(valid_ptr + b * L + j, mask=jm, other=0) != 0
    if OVERLAP == 2:
        shift = tl.where(j >= ratio, dim, 0)
    else:
        shift = j * 0
    offs = b * L * 2 * width + j[:, None] * 2 * width + shift[:, None] + c[None, :]
    m = jm[:, None] & cm[None, :]
    kv = tl.load(rows_ptr + offs, mask=m, other=0.0)
    gate = tl.load(rows_ptr + offs + width, mask=m, other=0.0)
    gate = tl.where(ok[:, None] & m, gate, float("-inf"))
    top = tl.max(gate, axis=0)
    e = tl.exp(gate - top[None, :])
    e = tl.where(jm[:, None], e, 0.0)  # padded rows out of the sums (valid rows give NaN as torch)
    total = tl.sum(e, axis=0)
    acc = tl.sum((e / total[None, :]) * kv, axis=0)
    tl.store(out_ptr + b * dim + c, acc, mask=cm)


def compressor_pool(
    rows: torch.Tensor, valid: torch.Tensor, dim: int, ratio: int, overlap: int
) -> torch.Tensor:
    rows, valid = rows.contiguous(), valid.contiguous()
    batch, length = rows.shape[0], rows.shape[1]
    out = torch.empty((batch, dim), dtype=torch.float32, device=rows.device)
    if out.numel() == 0:
        return out
    grid = (batch, triton.cdiv(dim, BLOCK_C))
    _pool_kernel[grid](
        rows,
        valid.view(torch.uint8),
        out,
        dim,
        ratio,
        length,
        OVERLAP=overlap,
        L_PAD=triton.next_power_of_2(length),
        BLOCK_C=BLOCK_C,
    )
    return out


@triton.jit
def _rows_kernel(x_ptr, ape_ptr, pos_ptr, out_ptr, W, ratio, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = d < W
    slot = tl.load(pos_ptr + t) % ratio
    slot = tl.where(slot < 0, slot + ratio, slot)  # Python's modulo, as the torch form's
    kv = tl.load(x_ptr + t * 2 * W + d, mask=m).to(tl.float32)
    gate = tl.load(x_ptr + t * 2 * W + W + d, mask=m).to(tl.float32)
    bias = tl.load(ape_ptr + slot * W + d, mask=m)
    tl.store(out_ptr + t * 2 * W + d, kv, mask=m)
    tl.store(out_ptr + t * 2 * W + W + d, gate + bias, mask=m)


def compressor_rows(kv_gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor):
    """The CUDA kernel of `nextn::compressor_rows`: one program per row and block of
    channels, `[kv | gate + ape[position mod ratio]]` in fp32."""
    kv_gate, ape, positions = kv_gate.contiguous(), ape.contiguous(), positions.contiguous()
    tokens, width = kv_gate.shape[0], ape.shape[1]
    out = torch.empty((tokens, 2 * width), dtype=torch.float32, device=kv_gate.device)
    if out.numel() == 0:
        return out
    grid = (tokens, triton.cdiv(width, BLOCK_C))
    _rows_kernel[grid](kv_gate, ape, positions, out, width, ape.shape[0], BLOCK=BLOCK_C)
    return out
