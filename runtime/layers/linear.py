# SPDX-License-Identifier: Apache-2.0
"""Linear layers whose parameters load their own tensor-parallel shard (vLLM's
`layers/linear.py` names and sharding rules).

`y = x W^T (+ b)` with `W` stored `[out, in]`. Column-parallel layers split `out`,
row-parallel layers split `in` and all-reduce the partial sums. Merged layers hold
several checkpoint matrices stacked along `out`; each is split over the ranks on its own
and the rank's pieces sit back to back. Loaders take a checkpoint tensor or a lazy slice
and read only this rank's rows / columns.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.distributed import ParallelGroup, all_gather_last_dim, all_reduce
from runtime.kernels.quantized_product import fp8_linear
from runtime.layers.narrow_weights import linear_product
from runtime.layers.quantized import quantized_format, store_weight
from runtime.layers.weight_utils import (
    WeightShapeError,
    copy_checked,
    expect_loads,
    make_param,
    shard_of,
    shard_range,
)

_SINGLE = ParallelGroup()


class LinearBase(nn.Module):
    # captured steps may read a bf16 copy (narrow_weights.linear_product), products of many
    # rows a copy packed for AMX tiles where the CPU has them
    narrow_weight_names = ("weight",)
    tile_weight_names = ("weight",)

    def __init__(self, input_size: int, output_size: int, bias: bool = False, params_dtype=None):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = make_param((output_size, input_size), params_dtype, self.weight_loader)
        self.bias = make_param((output_size,), params_dtype, self.bias_loader) if bias else None

    def weight_loader(self, param: torch.Tensor, loaded, shard_id=None) -> None:
        self._store(param, loaded)

    def bias_loader(self, param: torch.Tensor, loaded, shard_id=None) -> None:
        copy_checked(param.data, loaded)

    def _store(self, param: torch.Tensor, loaded, rows: slice | None = None) -> None:
        """Copy a checkpoint piece into `param` (or its `rows`); the weight may keep a
        quantized piece in its format (`runtime.layers.quantized`)."""
        if param is self.bias:
            copy_checked(param.data if rows is None else param.data[rows], loaded)
            return
        select = (lambda t: t) if rows is None else (lambda t: t[rows])
        store_weight(self, "weight", loaded, select, formats=("fp8",))

    def product(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x W^T (+ bias)` over the float weight or its quantized codes and scales."""
        quant = quantized_format(self, "weight")
        if quant is None:
            return linear_product(x, self, "weight", bias)
        _, block_k = quant  # FP8 is the one format linear layers keep
        y = fp8_linear(x, self.weight, self.weight_scale_inv, [1, block_k])
        return y if bias is None else y + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

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

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if self.tp.size > 1:
            loaded = shard_of(loaded, 0, self.tp.rank, self.tp.size, self.full_output_size)
        self._store(param, loaded)

    bias_loader = weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x, self.bias)
        return all_gather_last_dim(y, self.tp) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several `[out_i, in]` matrices stacked along `out`, each split over `tp` on its own.

    `output_sizes` are the full sizes of the stacked parts. A checkpoint tensor is loaded by
    shard id: by default shard i is part i (e.g. 0 = gate, 1 = up of a SwiGLU MLP);
    `checkpoint_shards[i]` lists the parts that checkpoint tensor i stacks when one tensor
    holds several (Gated DeltaNet's `in_proj_qkv` is the q, k and v parts). With no shard id
    the tensor stacks every part (HF's fused `gate_up_proj`).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: ParallelGroup = _SINGLE,
        gather_output: bool = False,
        params_dtype=None,
        checkpoint_shards: list[list[int]] | None = None,
    ):
        if gather_output and tp.size > 1:
            raise ValueError("a merged layer's shards do not concatenate back in order")
        self.output_sizes = list(output_sizes)
        self.checkpoint_shards = checkpoint_shards or [[i] for i in range(len(output_sizes))]
        self.tp, self.gather_output = tp, gather_output
        self.full_output_size = sum(output_sizes)
        self.local_sizes = [self.local_rows(i)[1] for i in range(len(self.output_sizes))]
        LinearBase.__init__(self, input_size, sum(self.local_sizes), bias, params_dtype)
        shards = {(i,) for i in range(len(self.checkpoint_shards))}
        for param in (self.weight, self.bias):
            if param is not None:
                expect_loads(param, shards)

    def local_rows(self, part: int) -> tuple[int, int]:
        """(first row, rows) of this rank's share of part `part`, within that part."""
        start, end = shard_range(self.output_sizes[part], self.tp.rank, self.tp.size)
        return start, end - start

    def _part_offset(self, part: int) -> int:
        return sum(self.local_sizes[:part])

    def _load_part(self, param, loaded, part: int) -> None:
        if loaded.shape[0] != self.output_sizes[part]:
            raise WeightShapeError(
                (self.output_sizes[part], *param.shape[1:]), tuple(loaded.shape), f"part {part}"
            )
        first, rows = self.local_rows(part)
        offset = self._part_offset(part)
        self._store(param, loaded.narrow(0, first, rows), slice(offset, offset + rows))

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if shard_id is None:  # an already-stacked tensor (e.g. HF `gate_up_proj`)
            parts = list(range(len(self.output_sizes)))
        elif isinstance(shard_id, int) and 0 <= shard_id < len(self.checkpoint_shards):
            parts = self.checkpoint_shards[shard_id]
        else:
            raise ValueError(f"shard id {shard_id!r} not in 0..{len(self.checkpoint_shards) - 1}")
        total = sum(self.output_sizes[p] for p in parts)
        if loaded.shape[0] != total:
            expected = (total, *param.shape[1:])
            raise WeightShapeError(expected, tuple(loaded.shape), f"shard {shard_id}")
        row = 0
        for part in parts:
            size = self.output_sizes[part]
            self._load_part(param, loaded.narrow(0, row, size), part)
            row += size

    bias_loader = weight_loader


class QKVParallelLinear(MergedColumnParallelLinear):
    """Query (and whatever rides along with each query head, e.g. Qwen's output gate), key
    and value projections stacked; heads split over `tp`. With fewer KV heads than ranks
    each KV head is replicated on `tp / num_kv_heads` ranks (vLLM's `QKVParallelLinear`)."""

    def __init__(
        self,
        input_size: int,
        q_head_width: int,
        num_heads: int,
        kv_head_width: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: ParallelGroup = _SINGLE,
        params_dtype=None,
    ):
        if num_heads % tp.size:
            raise ValueError(f"{num_heads} attention heads do not split over {tp.size} ranks")
        if num_kv_heads % tp.size and tp.size % num_kv_heads:
            raise ValueError(
                f"{num_kv_heads} KV heads neither split over nor replicate onto {tp.size} ranks"
            )
        self.kv_head_width, self.num_kv_heads = kv_head_width, num_kv_heads
        self.num_local_kv_heads = max(1, num_kv_heads // tp.size)
        sizes = [q_head_width * num_heads, kv_head_width * num_kv_heads] + [
            kv_head_width * num_kv_heads
        ]
        super().__init__(input_size, sizes, bias, tp, False, params_dtype)

    def local_rows(self, part: int) -> tuple[int, int]:
        if part == 0 or self.num_kv_heads >= self.tp.size:
            return super().local_rows(part)
        head = self.tp.rank * self.num_kv_heads // self.tp.size
        return head * self.kv_head_width, self.kv_head_width


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
        self.tp, self.reduce_results, self.full_input_size = tp, reduce_results, input_size
        start, end = shard_range(input_size, tp.rank, tp.size)
        super().__init__(end - start, output_size, bias, params_dtype)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if self.tp.size > 1:
            loaded = shard_of(loaded, 1, self.tp.rank, self.tp.size, self.full_input_size)
        self._store(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x)
        if self.reduce_results:
            y = all_reduce(y, self.tp)
        # The bias is added once, after the reduction, not once per rank.
        return y if self.bias is None else y + self.bias
