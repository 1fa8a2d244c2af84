# SPDX-License-Identifier: Apache-2.0
"""Linear layers whose parameters load their own tensor-parallel shard.

`y = x W^T (+ b)` with `W` stored `[out, in]`. Column-parallel layers split `out`,
row-parallel layers split `in` and all-reduce the partial sums. Merged layers hold
several checkpoint matrices stacked along `out` and load each by shard id.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.distributed import ParallelGroup, all_gather_last_dim, all_reduce
from runtime.layers.weight_utils import copy_checked, expect_loads, make_param, shard_range

_SINGLE = ParallelGroup()


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, params_dtype=None):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = make_param((output_size, input_size), params_dtype, self.weight_loader)
        self.bias = make_param((output_size,), params_dtype, self.bias_loader) if bias else None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        copy_checked(param.data, loaded)

    def bias_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole matrix."""


class ColumnParallelLinear(LinearBase):
    """Output rows split over `tp`; `gather_output` concatenates the shards back."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: ParallelGroup = _SINGLE,
        gather_output: bool = False,
        params_dtype=None,
    ):
        self.tp, self.gather_output, self.full_output_size = tp, gather_output, output_size
        start, end = shard_range(output_size, tp.rank, tp.size)
        super().__init__(input_size, end - start, bias, params_dtype)

    def _rank_rows(self, loaded: torch.Tensor) -> torch.Tensor:
        start, end = shard_range(loaded.shape[0], self.tp.rank, self.tp.size)
        return loaded[start:end]

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        copy_checked(param.data, self._rank_rows(loaded) if self.tp.size > 1 else loaded)

    bias_loader = weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return all_gather_last_dim(y, self.tp) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several `[out_i, in]` checkpoint matrices stacked along `out`, loaded by shard id.

    Shard ids are positions in `output_sizes` (e.g. 0 = gate, 1 = up for a SwiGLU MLP).
    Each rank keeps its own slice of every stacked matrix, back to back.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: ParallelGroup = _SINGLE,
        gather_output: bool = False,
        params_dtype=None,
    ):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp, gather_output, params_dtype)
        shards = {(i,) for i in range(len(self.output_sizes))}
        for param in (self.weight, self.bias):
            if param is not None:
                expect_loads(param, shards)

    def _shard_rows(self, shard_id: int) -> tuple[int, int]:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard id {shard_id!r} not in 0..{len(self.output_sizes) - 1}")
        sizes = [s // self.tp.size for s in self.output_sizes]
        start = sum(sizes[:shard_id])
        return start, start + sizes[shard_id]

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if shard_id is None:  # an already-stacked tensor (e.g. HF `gate_up_proj`)
            parts = loaded.split(self.output_sizes, dim=0)
            for i, part in enumerate(parts):
                self.weight_loader(param, part, i)
            return
        start, end = self._shard_rows(shard_id)
        copy_checked(
            param.data[start:end],
            self._rank_rows(loaded) if self.tp.size > 1 else loaded,
            f"shard {shard_id}",
        )

    bias_loader = weight_loader


class RowParallelLinear(LinearBase):
    """Input columns split over `tp`; partial products are all-reduced."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: ParallelGroup = _SINGLE,
        reduce_results: bool = True,
        params_dtype=None,
    ):
        self.tp, self.reduce_results = tp, reduce_results
        start, end = shard_range(input_size, tp.rank, tp.size)
        super().__init__(end - start, output_size, bias, params_dtype)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if self.tp.size > 1:
            start, end = shard_range(loaded.shape[1], self.tp.rank, self.tp.size)
            loaded = loaded[:, start:end]
        copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce_results:
            y = all_reduce(y, self.tp)
        # The bias is added once, after the reduction, not once per rank.
        return y if self.bias is None else y + self.bias
