# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V4's compressor state rows as one operator (transformers'
`DeepseekV4CSACompressor` / `DeepseekV4HCACompressor` before their pooling):

    rows[t] = [kv[t] | gate[t] + ape[position[t] mod ratio]]         (fp32)

`kv_gate [T, 2 W]` (the fused `wkv | wgate` projection, any float dtype), `ape [ratio, W]`
fp32, `positions [T]` int64 -> `[T, 2 W]` fp32. The torch form (widen, split, modulo,
gather, add, concatenate) is about six operators for each compressor of a captured step;
the C++ kernel (`nextn_cpu::compressor_rows`, `csrc/compressor_rows.cpp`) on CPU and the
custom op `nextn::compressor_rows` with a Triton kernel
(`runtime.kernels.triton.compressor_rows`) on CUDA make it one node, with the same values
(one fp32 addition per gate channel). The reference defines correctness.
"""

from __future__ import annotations

import torch

from runtime.kernels import cpu_extension
from runtime.kernels import triton as triton_kernels

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def compressor_rows_reference(
    kv_gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The state rows in plain torch (the test oracle)."""
    kv, gate = kv_gate.float().chunk(2, dim=-1)
    return torch.cat([kv, gate + ape[positions % ape.shape[0]]], dim=-1)


def uses_kernel(kv_gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether `compressor_rows` has a kernel for these operands, eagerly and in captured
    steps: `kv_gate [T, 2 W]` in fp32, bf16 or fp16, `ape [ratio, W]` fp32, `positions [T]`
    int64, no grad wanted, and on CPU the C++ kernels loaded, on CUDA Triton importable."""
    if kv_gate.dtype not in KERNEL_DTYPES or kv_gate.dim() != 2 or ape.dim() != 2:
        return False
    if ape.dtype != torch.float32 or kv_gate.shape[1] != 2 * ape.shape[1]:
        return False
    if positions.dtype != torch.long or positions.shape != kv_gate.shape[:1]:
        return False
    if torch.is_grad_enabled():
        return False
    if kv_gate.device.type == "cpu":
        return cpu_extension.serves(kv_gate)
    return kv_gate.device.type == "cuda" and triton_kernels.available()


def compressor_rows(
    kv_gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The state rows as one operator (callers check `uses_kernel` first)."""
    if kv_gate.device.type == "cpu":
        return torch.ops.nextn_cpu.compressor_rows(kv_gate, ape, positions)
    return compressor_rows_op(kv_gate, ape, positions)


@torch.library.custom_op("nextn::compressor_rows", mutates_args=())
def compressor_rows_op(
    kv_gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    return compressor_rows_reference(kv_gate, ape, positions).contiguous()


@compressor_rows_op.register_kernel("cuda")
def _(kv_gate, ape, positions):
    from runtime.kernels.triton import compressor_pool as triton_compressor

    return triton_compressor.compressor_rows(kv_gate, ape, positions)


@compressor_rows_op.register_fake
def _(kv_gate, ape, positions):
    return kv_gate.new_empty(kv_gate.shape, dtype=torch.float32)
