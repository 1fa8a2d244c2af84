# SPDX-License-Identifier: Apache-2.0
"""mHC's stream expansion after a sub-block (DeepSeek-V4's hyper-connections):

    out[t, o] = post[t, o] * block[t] + sum_i comb[t, i, o] * residual[t, i]

`block [T, H]`, `residual [T, S, H]` (one dtype), `post [T, S]`, `comb [T, S, S]` (fp32)
-> `[T, S, H]` in the residual's dtype.

In eager prefill this is one small matrix per token: as a batched product (`S x S` times
`S x H` for each of thousands of tokens) it costs several times its memory traffic. The C++
kernel (`nextn_cpu::hc_post` in `csrc/nextn_cpu.cpp`) reads each token's streams once and
writes the expanded streams once, the sum in fp32 in the order `i = 0, 1, ...`, the block's
term last (the batched product's order, then `addcmul`'s). Compiled steps keep the
element-wise form, which the compiler fuses itself. The reference defines correctness.
"""

from __future__ import annotations

import torch


def expand_streams_reference(
    block: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The expansion in plain torch, in fp32 (the test oracle)."""
    mixed = torch.bmm(comb.float().transpose(1, 2), residual.float())
    expanded = post.float().unsqueeze(-1) * block.float().unsqueeze(1)
    return (mixed + expanded).to(residual.dtype)


def expand_streams(
    block: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The kernel (`cpu_extension.load` first; fp32 or bf16 streams, CPU)."""
    return torch.ops.nextn_cpu.hc_post(block, residual, post.float(), comb.float())
