# SPDX-License-Identifier: Apache-2.0
"""Routed experts in fused layout, computed grouped by expert (no per-token loop).

`w13_weight [E_local, 2I, H]` holds each expert's gate (rows `:I`) and up (rows `I:`)
projections; `w2_weight [E_local, H, I]` its down projection. Experts split over the
expert-parallel group `ep` in contiguous blocks and each expert's intermediate width over
`tp` (`I` is this rank's share); each rank computes its piece of every routed pair and the
pieces are summed over `combine` (SGLang's MoE all-reduce over the TP group).

Three formulations of a rank's piece give the same sums: sorted (one grouped GEMM per
projection, `nextn::grouped_gemm`; eager at every size, captured from `SORTED_MIN_PAIRS`
pairs), gathered (captured steps with fewer pairs: a batched GEMM of fixed shape `[T * k]`)
and narrow (captured CPU steps up to `KERNEL_MAX_PAIRS` / `KERNEL_MAX_PAIRS_BESIDE_TILES`
pairs, `runtime.kernels.narrow_product`). Eagerly, pairs routed to another rank's experts
are dropped; in a captured step they weigh zero (shapes stay fixed). Why each form wins
where it is used: docs/architecture.md, "Module notes".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from runtime.core.capture import in_capture
from runtime.distributed import ParallelGroup, all_reduce
from runtime.kernels.narrow_product import narrow_product
from runtime.kernels.quantized_product import grouped_quantized
from runtime.kernels.swiglu import swiglu
from runtime.layers.narrow_weights import (
    experts_kernel_ready,
    grouped_product,
    has_tiles,
    weight_for_product,
)
from runtime.layers.quantized import quantized_format, scale_name, store_weight
from runtime.layers.weight_utils import (
    WeightShapeError,
    expect_loads,
    make_param,
    shard_of,
)

_SINGLE = ParallelGroup()
# Captured steps on CPU sort the pairs from this many on, where the sorted form (each
# expert's weights read once) overtakes the gathered one (docs/captured_decode.md section 3).
SORTED_MIN_PAIRS = 64
# Up to this many pairs a captured step on CPU goes through the narrow-weight kernel where
# it is loaded (`forward_narrow`): below it the kernel beats the sorted form over fp32.
KERNEL_MAX_PAIRS = 128
# Where the weights are packed for AMX tiles, the sorted form multiplies on them
# (`grouped_product`) and overtakes the kernel sooner.
KERNEL_MAX_PAIRS_BESIDE_TILES = 64


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


class FusedMoEExperts(nn.Module):
    # captured steps may read bf16 copies (narrow_weights), gathered per pair then widened
    # inside the product's own kernel, so no fp32 temporary bounds their size
    narrow_weight_names = ("w13_weight", "w2_weight")
    # and products of many pairs their copies packed for AMX tiles (narrow_weights.grouped_product)
    tile_weight_names = ("w13_weight", "w2_weight")
    narrow_max_numel = None

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        ep: ParallelGroup = _SINGLE,
        swiglu_limit: float | None = None,
        params_dtype=None,
        tp: ParallelGroup = _SINGLE,
        combine: ParallelGroup | None = None,
        reduce_results: bool = True,
    ):
        super().__init__()
        if num_experts % ep.size:
            raise ValueError(
                f"{num_experts} experts do not split over {ep.size} expert-parallel ranks"
            )
        if intermediate_size % tp.size:
            raise ValueError(
                f"expert width {intermediate_size} does not split over {tp.size} ranks"
            )
        self.num_experts, self.ep, self.swiglu_limit = num_experts, ep, swiglu_limit
        self.tp, self.combine = tp, combine if combine is not None else ep
        self.reduce_results = reduce_results
        self.num_local_experts = num_experts // ep.size
        self.first_local_expert = ep.rank * self.num_local_experts
        self.full_intermediate_size = intermediate_size
        intermediate_size //= tp.size
        self.intermediate_size = intermediate_size
        e = self.num_local_experts
        self.w13_weight = make_param(
            (e, 2 * intermediate_size, hidden_size), params_dtype, self.weight_loader
        )
        self.w2_weight = make_param(
            (e, hidden_size, intermediate_size), params_dtype, self.weight_loader
        )
        local_ids = range(self.first_local_expert, self.first_local_expert + e)
        for name in ("w13_weight", "w2_weight"):
            getattr(self, name).expert_param_name = name
        expect_loads(self.w13_weight, {(s, i) for s in ("w1", "w3") for i in local_ids})
        expect_loads(self.w2_weight, {("w2", i) for i in local_ids})

    def local_expert(self, expert_id: int) -> int | None:
        local = expert_id - self.first_local_expert
        return local if 0 <= local < self.num_local_experts else None

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None, expert_id: int | None = None
    ) -> None:
        """Load one expert's `w1`/`w3`/`w2` (shard id + expert id), or the whole fused tensor
        for all experts (`shard_id=None, expert_id=None`, HF `gate_up_proj`/`down_proj`).
        Windows the loader keeps quantized are stored as codes and scales
        (`runtime.layers.quantized`)."""
        name = param.expert_param_name  # set at construction; survives quantization
        if expert_id is None:
            if loaded.shape[0] != self.num_experts:
                raise WeightShapeError(
                    (self.num_experts, *loaded.shape[1:]), tuple(loaded.shape), "fused experts"
                )
            mine = loaded.narrow(0, self.first_local_expert, self.num_local_experts)
            if name == "w2_weight":
                self._load_down(name, _whole, mine, "fused experts")
            else:
                full = self.full_intermediate_size
                if mine.shape[1] != 2 * full:
                    raise WeightShapeError(
                        (self.num_local_experts, 2 * full, *mine.shape[2:]),
                        tuple(mine.shape),
                        "fused experts",
                    )
                i = self.intermediate_size
                gate, up = mine.narrow(1, 0, full), mine.narrow(1, full, full)
                self._load_up(name, lambda t: t[:, :i], gate, 1, "fused gate")
                self._load_up(name, lambda t: t[:, i:], up, 1, "fused up")
            return
        local = self.local_expert(expert_id)
        if local is None:
            return
        i = self.intermediate_size
        if shard_id == "w1":
            self._load_up(name, lambda t: t[local, :i], loaded, 0, f"expert {expert_id} w1")
        elif shard_id == "w3":
            self._load_up(name, lambda t: t[local, i:], loaded, 0, f"expert {expert_id} w3")
        elif shard_id == "w2":
            self._load_down(name, lambda t: t[local], loaded, f"expert {expert_id} w2")
        else:
            raise ValueError(f"expert shard id must be w1, w2 or w3, got {shard_id!r}")

    def _load_up(self, name: str, select, loaded, dim: int, what: str) -> None:
        """Gate or up rows: this rank's share of the intermediate width (`dim`)."""
        full = self.full_intermediate_size
        piece = shard_of(loaded, dim, self.tp.rank, self.tp.size, full, what)
        store_weight(self, name, piece, select, what)

    def _load_down(self, name: str, select, loaded, what: str) -> None:
        """Down projection: this rank's share of its input columns (the last dim)."""
        full, dim = self.full_intermediate_size, loaded.dim() - 1
        piece = shard_of(loaded, dim, self.tp.rank, self.tp.size, full, what)
        store_weight(self, name, piece, select, what)

    @property
    def quantized(self) -> bool:
        """Whether a projection holds checkpoint codes (`--quantization`)."""
        return any(quantized_format(self, n) for n in ("w13_weight", "w2_weight"))

    def _grouped(self, rows: torch.Tensor, name: str, group_ends: torch.Tensor) -> torch.Tensor:
        """Sorted rows times their experts' projection `name`, float or quantized."""
        quant = quantized_format(self, name)
        if quant is None:
            return grouped_product(rows, self, name, group_ends)
        fmt, block_k = quant
        scales = getattr(self, scale_name(name, fmt))
        return grouped_quantized(rows, getattr(self, name), scales, group_ends, fmt, block_k)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """`x [T, H]`, `topk_weights/ids [T, k]` -> `sum_k w_k * expert_{id_k}(x)`, `[T, H]`."""
        if not in_capture() or self.quantized:
            # quantized experts: one grouped operator per projection (opaque in a capture)
            piece = self.forward_sorted(x, topk_weights, topk_ids, fixed_shape=in_capture())
        elif topk_ids.numel() <= self.kernel_max_pairs() and self.kernel_ready(x):
            piece = self.forward_narrow(x, topk_weights, topk_ids)
        elif x.device.type == "cpu" and topk_ids.numel() >= SORTED_MIN_PAIRS:
            piece = self.forward_sorted(x, topk_weights, topk_ids, fixed_shape=True)
        else:
            piece = self.forward_gathered(x, topk_weights, topk_ids)
        return self._reduce(piece)

    def _local_pairs(
        self, topk_weights: torch.Tensor, topk_ids: torch.Tensor, fixed_shape: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each (token, expert) pair's local expert, weight and token, flattened. Pairs
        routed to another rank's experts are dropped, or with `fixed_shape` kept at a
        clamped expert with weight zero, so no shape depends on the routing."""
        local = topk_ids.flatten() - self.first_local_expert
        weights = topk_weights.flatten()
        token_of = torch.arange(topk_ids.numel(), device=topk_ids.device) // topk_ids.shape[1]
        if self.ep.size > 1:
            mine = (local >= 0) & (local < self.num_local_experts)
            if fixed_shape:
                weights, local = weights * mine, local.clamp(0, self.num_local_experts - 1)
            else:
                local, token_of, weights = local[mine], token_of[mine], weights[mine]
        return local, weights, token_of

    def forward_sorted(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        fixed_shape: bool,
    ) -> torch.Tensor:
        """This rank's piece with the pairs sorted by expert (`fixed_shape`: as in
        `_local_pairs`)."""
        local, weights, token_of = self._local_pairs(topk_weights, topk_ids, fixed_shape)
        order = torch.argsort(local, stable=True)
        counts = torch.zeros(self.num_local_experts, dtype=torch.long, device=x.device)
        group_ends = torch.cumsum(counts.scatter_add_(0, local, torch.ones_like(local)), 0)
        group_ends = group_ends.to(torch.int32)
        rows = token_of[order]
        gate_up = self._grouped(x.index_select(0, rows), "w13_weight", group_ends)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        hidden = swiglu(gate, up, self.swiglu_limit)
        down = self._grouped(hidden, "w2_weight", group_ends)
        down = down * weights[order].unsqueeze(-1).to(down.dtype)
        return torch.zeros_like(x).index_add_(0, rows, down)

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' pieces (`combine`), unless the caller sums them itself."""
        return all_reduce(out, self.combine) if self.reduce_results else out

    def forward_gathered(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The fixed-shape formulation of this rank's piece (its experts, its share of their
        width; pairs routed to other ranks' experts contribute zero)."""

        def gathered(rows: torch.Tensor, name: str, local: torch.Tensor) -> torch.Tensor:
            weight = weight_for_product(self, name)[local].to(rows.dtype)  # widened per pair
            return torch.bmm(rows, weight.transpose(1, 2))

        return self._per_pair(x, topk_weights, topk_ids, gathered)

    def kernel_max_pairs(self) -> int:
        """The most pairs a captured step sends through the narrow-weight kernel: fewer where
        the sorted form multiplies on AMX tiles."""
        if all(has_tiles(self, name) for name in self.tile_weight_names):
            return min(KERNEL_MAX_PAIRS, KERNEL_MAX_PAIRS_BESIDE_TILES)
        return KERNEL_MAX_PAIRS

    def kernel_ready(self, x: torch.Tensor) -> bool:
        """Whether this step's products can go through the narrow-weight kernel (inside a
        captured step, over the bf16 copies)."""
        return all(
            experts_kernel_ready(weight_for_product(self, name), x)
            for name in ("w13_weight", "w2_weight")
        )

    def forward_narrow(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The gathered formulation through the narrow-weight kernel (`kernel_ready`), which
        serves every pair routed to an expert together: each chosen expert's copy is read
        once per step, not once per pair."""

        def narrow(rows: torch.Tensor, name: str, local: torch.Tensor) -> torch.Tensor:
            return narrow_product(rows, weight_for_product(self, name), local)

        return self._per_pair(x, topk_weights, topk_ids, narrow)

    def _per_pair(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        product: Callable[[torch.Tensor, str, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The fixed-shape piece with one row per (token, expert) pair: `product(rows [P, 1,
        in], weight name, local expert [P]) -> [P, 1, out]` multiplies each pair's row by
        its expert's projection."""
        num_tokens, top_k = topk_ids.shape
        local, weights, _ = self._local_pairs(topk_weights, topk_ids, fixed_shape=True)
        rows = x.unsqueeze(1).expand(num_tokens, top_k, x.shape[-1]).reshape(-1, 1, x.shape[-1])
        gate, up = product(rows, "w13_weight", local).split(self.intermediate_size, dim=-1)
        hidden = swiglu(gate, up, self.swiglu_limit)
        down = product(hidden, "w2_weight", local).view(num_tokens, top_k, -1)
        return (down * weights.view(num_tokens, top_k, 1).to(down.dtype)).sum(dim=1)
