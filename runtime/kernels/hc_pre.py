# SPDX-License-Identifier: Apache-2.0
"""mHC's collapse of the streams before a sub-block (DeepSeek-V4's hyper-connections) as one
operator:

    mixes = fn @ rms_normalize(flatten(x))                      fp32, [T, S (2 + S)]
    pre   = sigmoid(mixes[:, :S] * scale[0] + base[:S]) + hc_eps
    post  = 2 sigmoid(mixes[:, S:2S] * scale[1] + base[S:2S])
    comb  = sinkhorn(mixes[:, 2S:] * scale[2] + base[2S:])     [T, S, S]
    y[t]  = sum_i pre[t, i] x[t, i]                             x's dtype

`x [T, S, H]` (fp32 or bf16), `fn [S (2 + S), S H]`, `scale [3]`, `base [S (2 + S)]`
-> `(y [T, H], post [T, S], comb [T, S, S])`. Spelled out in torch this is ~100 operators
(Sinkhorn's 20 iterations are 80 of them), twice per layer: what makes a captured step
launch-bound on a GPU and its compile slow on a CPU. Here it is one call: on CPU the C++
kernel `nextn_cpu::hc_pre` (`csrc/nextn_cpu.cpp`, a fake registered by `cpu_extension`, so
inductor's C++ wrapper calls it without Python), on CUDA the custom op `nextn::hc_pre`
whose CUDA kernel is Triton's (`runtime.kernels.triton.hyper_connection`). Both agree with
`hc_pre_reference` (the oracle) to within a few ulps: only the order of the sums and the
exponential's last bit differ. Callers check `uses_kernel` and keep the torch form otherwise.
"""

from __future__ import annotations

import torch

from runtime.kernels import cpu_extension
from runtime.kernels import triton as triton_kernels
from runtime.kernels.sinkhorn import sinkhorn_reference

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def hc_pre_reference(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The collapse in plain torch (the test oracle; the op's body on devices without a
    kernel)."""
    streams = x.shape[1]
    flat = x.flatten(1).float()
    normed = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = torch.nn.functional.linear(normed, fn.float())
    pre_w, post_w, comb_w = mixes.split([streams, streams, streams * streams], dim=-1)
    pre_b, post_b, comb_b = base.float().split([streams, streams, streams * streams])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    logits = (comb_w * scale[2] + comb_b).view(-1, streams, streams)
    comb = sinkhorn_reference(logits, sinkhorn_iters, hc_eps)
    y = (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)
    return y, post, comb


def uses_kernel(x: torch.Tensor) -> bool:
    """Whether `hc_pre` has a kernel for `x`, eagerly and in captured steps: fp32 or bf16
    streams, no grad wanted (the kernels have no backward), and on CPU the C++ kernels
    loaded, on CUDA Triton importable."""
    if x.dtype not in KERNEL_DTYPES or x.dim() != 3 or torch.is_grad_enabled():
        return False
    if x.device.type == "cpu":
        return cpu_extension.serves(x)
    return x.device.type == "cuda" and triton_kernels.available()


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_pre_reference` as one operator (callers check `uses_kernel` first)."""
    args = (x, fn.float(), scale.float(), base.float(), norm_eps, hc_eps, sinkhorn_iters)
    if x.device.type == "cpu":
        return torch.ops.nextn_cpu.hc_pre(*args)
    return hc_pre_op(*args)


@torch.library.custom_op("nextn::hc_pre", mutates_args=())
def hc_pre_op(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return hc_pre_reference(x, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters)


@hc_pre_op.register_kernel("cuda")
def _(x, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters):
    from runtime.kernels.triton import hyper_connection

    return hyper_connection.hc_pre(x, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters)


@hc_pre_op.register_fake
def _(x, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters):
    tokens, streams, hidden = x.shape
    fp32 = torch.float32
    return (
        x.new_empty((tokens, hidden)),
        x.new_empty((tokens, streams), dtype=fp32),
        x.new_empty((tokens, streams, streams), dtype=fp32),
    )
