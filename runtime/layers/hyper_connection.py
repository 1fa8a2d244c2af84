# SPDX-License-Identifier: Apache-2.0
"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4).

The residual is `hc` parallel streams `X [T, hc, H]`. Around each sub-block:
    y, post, comb = hc_pre(X)            collapse the streams into the block input
    X' = post * block(y) + comb^T X      expand the output and mix the old streams
All mixing weights are computed per token in fp32 from the flattened streams.

`hc_pre` and `hc_post` are one operator each where a kernel serves the streams, eagerly
and in captured steps alike (`runtime.kernels.hc_pre`, `runtime.kernels.stream_expand`:
C++ on CPU with the project's kernels loaded, Triton on CUDA): a captured step then holds
two nodes per sub-block instead of ~100. Otherwise (no kernels, `NEXTN_DISABLE_CPU_KERNELS=1`,
grad wanted, other dtypes) they run their torch forms below, and when compiled `hc_pre` is
a nested compile region (`COMPILE_HC_PRE_ONCE`): a captured step calls it twice per layer,
and the compiler traces and compiles its ~140 operators (mostly Sinkhorn's 20 iterations)
once for all call sites instead of once per site, which halves the compile time of a
decode step. Inductor's C++ wrapper cannot call such a region yet, so the graph runner
turns it off when it compiles with `cpp_wrapper`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.core.capture import compiling
from runtime.kernels import hc_pre as hc_pre_kernel
from runtime.kernels import stream_expand
from runtime.kernels.sinkhorn import sinkhorn
from runtime.kernels.stream_expand import expand_streams
from runtime.layers.norm import rms_normalize


def _mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """`fn @ rms_normalize(flatten(x))` in fp32: [T, hc, H] -> [T, fn_rows].

    Eagerly the per-row scale is applied after the product (`fn @ (r x) = r (fn @ x)`),
    and `mean(x^2)` comes from one norm: two passes over the streams instead of five
    (squares, mean, scaling, product), which at prefill sizes is what this costs; compiled
    steps keep the normalisation the compiler fuses."""
    flat = x.flatten(1).float()
    if compiling():
        return F.linear(rms_normalize(flat, norm_eps), fn.float())
    mean_square = torch.linalg.vector_norm(flat, dim=-1, keepdim=True).square_() / flat.shape[1]
    return F.linear(flat, fn.float()).mul_(torch.rsqrt(mean_square.add_(norm_eps)))


COMPILE_HC_PRE_ONCE = True


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse `x [T, hc, H]` into a block input.

    Returns `y [T, H]` (x's dtype), `post [T, hc]` and `comb [T, hc, hc]` (fp32), where
    `comb[t, i, o]` weighs input stream i into output stream o.
    """
    if hc_pre_kernel.uses_kernel(x):
        return hc_pre_kernel.hc_pre(x, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters)
    compute = _hc_pre_region if COMPILE_HC_PRE_ONCE and compiling() else _hc_pre
    return compute(x, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters)


def _hc_pre(x, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters):
    hc = x.shape[1]
    mixes = _mixes(x, fn, norm_eps)
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = sinkhorn((comb_w * scale[2] + comb_b).view(-1, hc, hc), sinkhorn_iters, hc_eps)
    return _collapse(pre, x), post, comb


def _collapse(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`sum_i weights[t, i] * x[t, i]` -> [T, H] in x's dtype. Eagerly as one batched
    product (same values, faster on CPU than a product and a sum over `[T, hc, H]`);
    compiled steps keep the element-wise form, which the compiler fuses."""
    if compiling():
        return (weights.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
    return torch.bmm(weights.unsqueeze(1), x.float()).squeeze(1).to(x.dtype)


_hc_pre_region = torch.compiler.nested_compile_region(_hc_pre)


def hc_post(
    block_out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """`X'[o] = post[o] * block_out + sum_i comb[i, o] * residual[i]` -> [T, hc, H].

    Where a kernel serves the streams, its one pass over them, eagerly and in captured steps
    (`runtime.kernels.stream_expand`); otherwise eagerly the mixed streams are written by
    the product and the expanded block output is added onto them in place by `addcmul_`
    (same values; at prefill sizes this step is bound by its passes over `[T, hc, H]`, and
    a separate product, expansion and addition make twice as many), and compiled steps keep
    the form the compiler fuses."""
    dtype = residual.dtype
    if stream_expand.uses_kernel(block_out, residual):
        return expand_streams(block_out, residual, post, comb)
    if compiling():
        # the 4 x 4 mix as products and a sum the compiler fuses with the addition: a batched
        # product of `hc x hc` matrices is a library call per use, slower than the fused loop
        mixed = (comb.to(dtype).unsqueeze(-1) * residual.unsqueeze(2)).sum(1)
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(1) + mixed
    mixed = torch.bmm(comb.to(dtype).transpose(1, 2), residual)
    return mixed.addcmul_(post.to(dtype).unsqueeze(-1), block_out.unsqueeze(1))


def hc_head(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
) -> torch.Tensor:
    """Final collapse of the streams (sigmoid weights, no Sinkhorn): [T, hc, H] -> [T, H]."""
    pre = torch.sigmoid(_mixes(x, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    return _collapse(pre, x)
