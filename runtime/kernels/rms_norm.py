# SPDX-License-Identifier: Apache-2.0
"""RMSNorm of fp32 rows for eager steps on CPU:

    out = x * rsqrt(mean(x^2, -1) + eps)          (times `weight` [D] where there is one)

The torch form (`runtime.layers.norm`) makes four passes over `x` (square, mean, scale,
weight), each writing a temporary; at prefill sizes a norm costs what its passes cost, and
a DeepSeek-V4 layer has many norms (queries per head, the query latent, keys, both
sub-block inputs, the compressors' entries; their share of a prefill step is in
docs/benchmark_history.md). The C++ kernel
(`nextn_cpu::rms_norm` in `csrc/nextn_cpu.cpp`) reads each row once and writes it once,
the products in the torch form's order; only the order of the sum of squares differs.
Captured CPU steps call it too (issue 54: one node instead of the torch form's chain, about
50 norms a step of the default model, and the same values as eager steps).
"""

from __future__ import annotations

import torch

from runtime.kernels import cpu_extension


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The torch form in fp32 (the test oracle)."""
    x = x.float()
    out = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight.float()


def uses_kernel(x: torch.Tensor) -> bool:
    """Whether `rms_norm` takes the kernel for `x`: fp32, where the kernels serve it
    (`cpu_extension.serves`: CPU, no grad, loaded), eagerly and in captured steps."""
    return x.dtype == torch.float32 and cpu_extension.serves(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`rms_norm_reference` by the kernel (callers check `uses_kernel` first)."""
    return torch.ops.nextn_cpu.rms_norm(x, None if weight is None else weight.float(), eps)
