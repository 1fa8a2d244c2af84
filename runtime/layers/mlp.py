# SPDX-License-Identifier: Apache-2.0
"""Dense SwiGLU MLP (also DeepSeek-V4's shared expert, with its clamp)."""

from __future__ import annotations

import torch
from torch import nn

from runtime.distributed import ParallelGroup
from runtime.kernels.swiglu import swiglu
from runtime.layers.linear import MergedColumnParallelLinear, RowParallelLinear

_SINGLE = ParallelGroup()


class SwiGLUMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: ParallelGroup = _SINGLE,
        swiglu_limit: float | None = None,
        reduce_results: bool = True,
    ):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp=tp)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, tp=tp, reduce_results=reduce_results
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(swiglu(gate, up, self.swiglu_limit))
