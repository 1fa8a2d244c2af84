# SPDX-License-Identifier: Apache-2.0
"""mHC's stream expansion after a sub-block (DeepSeek-V4's hyper-connections):

    out[t, o] = post[t, o] * block[t] + sum_i comb[t, i, o] * residual[t, i]

`block [T, H]`, `residual [T, S, H]` (one dtype), `post [T, S]`, `comb [T, S, S]` (fp32)
-> `[T, S, H]` in the residual's dtype.

In eager prefill this is one small matrix per token: as a batched product (`S x S` times
`S x H` for each of thousands of tokens) it costs several times its memory traffic. The C++
kernel (`nextn_cpu::hc_post` in `csrc/nextn_cpu.cpp`) reads each token's streams once and
writes the expanded streams once, the sum in fp32 in the order `i = 0, 1, ...`, the block's
term last (the batched product's order, then `addcmul`'s). Captured CPU steps call it too
(one node instead of the element-wise form's ten, and the same values as eager steps). On
CUDA it is the custom op `nextn::hc_post`, whose CUDA kernel is Triton's
(`runtime.kernels.triton.hyper_connection`). The reference defines correctness.
"""

from __future__ import annotations

import torch

from runtime.kernels import cpu_extension
from runtime.kernels import triton as triton_kernels

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def expand_streams_reference(
    block: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The expansion in plain torch, in fp32 (the test oracle)."""
    mixed = torch.bmm(comb.float().transpose(1, 2), residual.float())
    expanded = post.float().unsqueeze(-1) * block.float().unsqueeze(1)
    return (mixed + expanded).to(residual.dtype)


def uses_kernel(block: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether `expand_streams` has a kernel for these streams, eagerly and in captured
    steps: fp32 or bf16 (block and residual alike), no grad wanted, and on CPU the C++
    kernels loaded, on CUDA Triton importable."""
    if residual.dtype not in KERNEL_DTYPES or block.dtype != residual.dtype:
        return False
    if torch.is_grad_enabled():
        return False
    if residual.device.type == "cpu":
        return cpu_extension.serves(residual)
    return residual.device.type == "cuda" and triton_kernels.available()


def expand_streams(
    block: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The expansion as one operator (callers check `uses_kernel` first)."""
    if residual.device.type == "cpu":
        return torch.ops.nextn_cpu.hc_post(block, residual, post.float(), comb.float())
    return hc_post_op(block, residual, post.float(), comb.float())


@torch.library.custom_op("nextn::hc_post", mutates_args=())
def hc_post_op(
    block: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    return expand_streams_reference(block, residual, post, comb)


@hc_post_op.register_kernel("cuda")
def _(block, residual, post, comb):
    from runtime.kernels.triton import hyper_connection

    return hyper_connection.hc_post(block, residual, post, comb)


@hc_post_op.register_fake
def _(block, residual, post, comb):
    return residual.new_empty(residual.shape)
