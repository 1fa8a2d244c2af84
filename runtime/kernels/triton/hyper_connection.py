# SPDX-License-Identifier: Apache-2.0
"""mHC's two stream operators as Triton kernels (the CUDA kernels of `nextn::hc_pre` and
`nextn::hc_post`; `runtime.kernels.hc_pre` and `runtime.kernels.stream_expand` define them
and their torch references).

`hc_pre`: one program per token. It reads the token's flattened streams `[S H]` in chunks,
accumulating the sum of squares and the `S (2 + S)` mixes (the `fn` rows of the pre, post
and comb weights as three tiles, so no mix has to be picked out of a register vector), then
takes the sigmoids, runs Sinkhorn on the `S x S` matrix in registers (padded to a power of
two: padded columns enter the softmax as -inf, padded entries stay 0 in every later pass)
and writes `y = sum_i pre[i] x[i]` in a second pass over the streams.

`hc_post`: one program per token and block of the hidden dimension; the `S x S` mix is a
broadcast product summed over the input streams, plus `post * block`.

Sums are in fp32; only their order (and the exponential's last bit) differs from the
references. Inputs are made contiguous by the launchers. Under `TRITON_INTERPRET=1` (set
before this module is imported) the same kernels run on CPU tensors through Triton's
interpreter, which is how the tests check them on machines without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 256  # flattened stream elements per chunk of the mixes' pass
BLOCK_H = 256  # hidden elements per chunk of the collapse / expansion


@triton.jit
def _hc_pre_kernel(
    x_ptr,
    fn_ptr,
    scale_ptr,
    base_ptr,
    y_ptr,
    post_ptr,
    comb_ptr,
    H,
    norm_eps,
    hc_eps,
    iters,
    S: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    K = S * H
    x_row = x_ptr + t * K
    i = tl.arange(0, S_PAD)
    j = tl.arange(0, S_PAD)
    k = tl.arange(0, BLOCK_K)
    si = i < S
    sj = j < S
    square = tl.zeros([BLOCK_K], dtype=tl.float32)
    acc_pre = tl.zeros([S_PAD, BLOCK_K], dtype=tl.float32)
    acc_post = tl.zeros([S_PAD, BLOCK_K], dtype=tl.float32)
    acc_comb = tl.zeros([S_PAD, S_PAD, BLOCK_K], dtype=tl.float32)
    comb_rows = 2 * S + i[:, None] * S + j[None, :]  # fn's row of comb[i, j]
    comb_valid = si[:, None] & sj[None, :]
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        km = kk < K
        xv = tl.load(x_row + kk, mask=km, other=0.0).to(tl.float32)
        square += xv * xv
        wm = si[:, None] & km[None, :]
        w_pre = tl.load(fn_ptr + i[:, None] * K + kk[None, :], mask=wm, other=0.0)
        acc_pre += w_pre * xv[None, :]
        w_post = tl.load(fn_ptr + (S + i)[:, None] * K + kk[None, :], mask=wm, other=0.0)
        acc_post += w_post * xv[None, :]
        w_comb = tl.load(
            fn_ptr + comb_rows[:, :, None] * K + kk[None, None, :],
            mask=comb_valid[:, :, None] & km[None, None, :],
            other=0.0,
        )
        acc_comb += w_comb * xv[None, None, :]
    r = 1.0 / tl.sqrt(tl.sum(square, axis=0) / K + norm_eps)
    scale_pre = tl.load(scale_ptr)
    scale_post = tl.load(scale_ptr + 1)
    scale_comb = tl.load(scale_ptr + 2)
    base_pre = tl.load(base_ptr + i, mask=si, other=0.0)
    base_post = tl.load(base_ptr + S + i, mask=si, other=0.0)
    base_comb = tl.load(base_ptr + comb_rows, mask=comb_valid, other=0.0)
    pre = tl.sigmoid(tl.sum(acc_pre, axis=1) * r * scale_pre + base_pre) + hc_eps
    post = 2.0 * tl.sigmoid(tl.sum(acc_post, axis=1) * r * scale_post + base_post)
    tl.store(post_ptr + t * S + i, post, mask=si)

    logits = tl.sum(acc_comb, axis=2) * r * scale_comb + base_comb
    logits = tl.where(sj[None, :], logits, float("-inf"))
    shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = shifted / tl.sum(shifted, axis=1)[:, None] + hc_eps
    comb = tl.where(comb_valid, comb, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(1, iters):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(comb_ptr + t * S * S + i[:, None] * S + j[None, :], comb, mask=comb_valid)

    h = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + h
        hm = hh < H
        xm = si[:, None] & hm[None, :]
        xs = tl.load(x_row + i[:, None] * H + hh[None, :], mask=xm, other=0.0)
        y = tl.sum(pre[:, None] * xs.to(tl.float32), axis=0)
        tl.store(y_ptr + t * H + hh, y.to(y_ptr.dtype.element_ty), mask=hm)


@triton.jit
def _hc_post_kernel(
    block_ptr,
    residual_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    H,
    S: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = hh < H
    i = tl.arange(0, S_PAD)  # input stream
    o = tl.arange(0, S_PAD)  # output stream
    si = i < S
    so = o < S
    streams = t * S * H
    residual = tl.load(
        residual_ptr + streams + i[:, None] * H + hh[None, :],
        mask=si[:, None] & hm[None, :],
        other=0.0,
    ).to(tl.float32)
    comb = tl.load(
        comb_ptr + t * S * S + i[:, None] * S + o[None, :],
        mask=si[:, None] & so[None, :],
        other=0.0,
    )
    mixed = tl.sum(comb[:, :, None] * residual[:, None, :], axis=0)  # [o, h]
    post = tl.load(post_ptr + t * S + o, mask=so, other=0.0)
    block = tl.load(block_ptr + t * H + hh, mask=hm, other=0.0).to(tl.float32)
    out = mixed + post[:, None] * block[None, :]
    tl.store(
        out_ptr + streams + o[:, None] * H + hh[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=so[:, None] & hm[None, :],
    )


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`runtime.kernels.hc_pre.hc_pre_reference` in one launch."""
    tokens, streams, hidden = x.shape
    y = x.new_empty((tokens, hidden))
    post = x.new_empty((tokens, streams), dtype=torch.float32)
    comb = x.new_empty((tokens, streams, streams), dtype=torch.float32)
    if tokens == 0 or hidden == 0:
        return y, post, comb
    _hc_pre_kernel[(tokens,)](
        x.contiguous(),
        fn.float().contiguous(),
        scale.float().contiguous(),
        base.float().contiguous(),
        y,
        post,
        comb,
        hidden,
        float(norm_eps),
        float(hc_eps),
        int(sinkhorn_iters),
        S=streams,
        S_PAD=triton.next_power_of_2(streams),
        BLOCK_K=BLOCK_K,
        BLOCK_H=min(BLOCK_H, triton.next_power_of_2(hidden)),
    )
    return y, post, comb


def hc_post(
    block: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """`runtime.kernels.stream_expand.expand_streams_reference` in one launch."""
    tokens, streams, hidden = residual.shape
    out = residual.new_empty((tokens, streams, hidden))
    if out.numel() == 0:
        return out
    block_h = min(BLOCK_H, triton.next_power_of_2(hidden))
    _hc_post_kernel[(tokens, triton.cdiv(hidden, block_h))](
        block.contiguous(),
        residual.contiguous(),
        post.float().contiguous(),
        comb.float().contiguous(),
        out,
        hidden,
        S=streams,
        S_PAD=triton.next_power_of_2(streams),
        BLOCK_H=block_h,
    )
    return out
