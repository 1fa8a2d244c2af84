# SPDX-License-Identifier: Apache-2.0
"""SwiGLU with DeepSeek-V4's clamp on CPU:

    out = silu(min(gate, limit)) * clamp(up, -limit, limit)      (no clamp without a limit)

The torch form makes four passes over the experts' `[pairs, intermediate]` activations
(two clamps, silu, product), each writing a temporary; the C++ kernel
(`nextn_cpu::swiglu` in `csrc/nextn_cpu.cpp`) reads the gate and up halves once and writes
the product once, silu as `g / (1 + exp(-g))` as torch's CPU kernel computes it (its
exponential within an ulp or two of torch's). Captured CPU steps call it too (issue 54: one
node instead of the torch form's clamps, silu and product, and the same values as eager
steps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels import cpu_extension


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """The torch form (the test oracle)."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def uses_kernel(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether `swiglu` takes the kernel: fp32 `[..., P, I]` halves whose rows are contiguous,
    where the kernels serve them (`cpu_extension.serves`: CPU, no grad, loaded), eagerly and
    in captured steps."""
    return (
        gate.dim() >= 2
        and gate.shape == up.shape
        and gate.dtype == up.dtype == torch.float32
        and gate.stride(-1) == up.stride(-1) == 1
        and cpu_extension.serves(gate)
    )


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """`swiglu_reference`, by the kernel where `uses_kernel` allows."""
    if uses_kernel(gate, up):
        if gate.dim() == 2:
            return torch.ops.nextn_cpu.swiglu(gate, up, limit)
        rows = (gate.flatten(0, -2), up.flatten(0, -2))  # views where the layout allows
        return torch.ops.nextn_cpu.swiglu(*rows, limit).view(gate.shape)
    return swiglu_reference(gate, up, limit)
