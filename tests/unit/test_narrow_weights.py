# SPDX-License-Identifier: Apache-2.0
"""Narrow (bf16) copies of fp32 weights for captured steps: made only where lossless, read
only inside a compiled graph, and the products there equal the wide ones (to rounding:
products of few rows sum in the compiler's order, not the GEMM's)."""

from __future__ import annotations

import pytest
import torch

from runtime.layers.embedding import ParallelLMHead
from runtime.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from runtime.layers.moe.experts import FusedMoEExperts
from runtime.layers.narrow_weights import (
    FUSED_MAX_ROWS,
    MIN_NUMEL,
    WIDENED_MAX_NUMEL,
    attach_narrow_copies,
    product_weight,
    widening_product,
)


def bf16_valued(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).bfloat16().float()


def test_copies_only_where_lossless_large_and_once_per_shared_tensor():
    exact = ReplicatedLinear(256, 128)
    exact.weight.data = bf16_valued((128, 256))
    lossy = ReplicatedLinear(256, 128)
    lossy.weight.data = torch.randn(128, 256)  # fp32 values bf16 cannot hold
    tiny = ReplicatedLinear(8, 8)
    tiny.weight.data = bf16_valued((8, 8))
    head = ParallelLMHead(512, 64)
    head.weight.data = bf16_valued((512, 64), seed=1)
    draft_head = ParallelLMHead(512, 64)
    draft_head.weight = head.weight  # a draft shares the target's head
    made = attach_narrow_copies([exact, lossy, tiny, head, draft_head])
    assert made == (128 * 256 + 512 * 64) * 2  # one copy of the shared head
    assert exact.weight_narrow.dtype == torch.bfloat16
    assert torch.equal(exact.weight_narrow.float(), exact.weight)
    assert not hasattr(lossy, "weight_narrow") and not hasattr(tiny, "weight_narrow")
    assert draft_head.weight_narrow is head.weight_narrow
    assert tiny.weight.numel() < MIN_NUMEL <= exact.weight.numel()


@pytest.mark.parametrize("num_rows", [FUSED_MAX_ROWS, FUSED_MAX_ROWS + 2])
def test_compiled_products_read_the_copies_and_equal_the_wide_ones(num_rows):
    torch.manual_seed(0)
    hidden, inter, experts = 64, 128, 8
    column = ColumnParallelLinear(hidden, 2 * inter)
    row = RowParallelLinear(inter, hidden)
    head = ParallelLMHead(1024, hidden)
    moe = FusedMoEExperts(experts, hidden, inter)
    for module in (column, row, head, moe):
        for param in module.parameters():  # bf16 values (a power-of-two scale keeps them so)
            param.data = bf16_valued(param.shape, seed=param.numel()) / 16

    def step(x, topk_weights, topk_ids):
        gate_up = column(x)
        y = row(torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        y = y + moe.forward_gathered(x, topk_weights, topk_ids)
        return head.compute_logits(y)

    seen_dtypes = set()

    def recording_backend(gm, example_inputs):
        seen_dtypes.update(t.dtype for t in example_inputs if isinstance(t, torch.Tensor))
        return gm.forward

    x = bf16_valued((num_rows, hidden), seed=7)
    topk_ids = torch.randint(0, experts, (num_rows, 2), generator=torch.Generator().manual_seed(3))
    topk_weights = torch.rand(num_rows, 2)
    with torch.inference_mode():
        eager = step(x, topk_weights, topk_ids)
        wide = torch.compile(step, dynamic=False)(x, topk_weights, topk_ids)
        assert attach_narrow_copies([column, row, head, moe]) > 0
        assert torch.equal(step(x, topk_weights, topk_ids), eager)  # eager keeps the wide path
        torch._dynamo.reset()
        traced = torch.compile(step, backend=recording_backend, fullgraph=True)(
            x, topk_weights, topk_ids
        )
        torch._dynamo.reset()
        narrow = torch.compile(step, dynamic=False)(x, topk_weights, topk_ids)
    assert torch.bfloat16 in seen_dtypes  # the graph's weight inputs are the narrow copies
    if num_rows > FUSED_MAX_ROWS:  # widened before the same GEMMs: the same math, bit for bit
        torch.testing.assert_close(traced, eager, rtol=0, atol=0)
    torch.testing.assert_close(traced, eager)
    # the compiler may fuse the widening into its own loops: rounding-level differences
    torch.testing.assert_close(narrow, wide)
    torch.testing.assert_close(narrow, eager)


def test_products_widened_before_a_gemm_keep_large_weights_wide():
    """A GEMM over more than `FUSED_MAX_ROWS` rows widens its whole copy into an fp32
    temporary first, which pays only while that temporary fits a core's cache: above
    `WIDENED_MAX_NUMEL` (the default model's 4096 x 256 head) it reads the wide weight.
    Products of fewer rows, and the routed experts' at any size, widen inside their own
    kernel, so every size gets a copy and they read it."""
    rows = WIDENED_MAX_NUMEL // 64
    at_limit = ReplicatedLinear(64, rows)
    at_limit.weight.data = bf16_valued((rows, 64))
    head = ParallelLMHead(2 * rows, 64)
    head.weight.data = bf16_valued((2 * rows, 64), seed=1)
    moe = FusedMoEExperts(8, 256, 512)  # 8 x 1024 x 256 gate-up: 8x the limit
    for param in moe.parameters():
        param.data = bf16_valued(param.shape, seed=param.numel())
    assert moe.w13_weight.numel() > WIDENED_MAX_NUMEL
    attach_narrow_copies([at_limit, head, moe])
    assert hasattr(at_limit, "weight_narrow") and hasattr(head, "weight_narrow")
    assert hasattr(moe, "w13_weight_narrow") and hasattr(moe, "w2_weight_narrow")

    picked = {}

    def pick(x):
        for module in (at_limit, head):
            for num_rows in (FUSED_MAX_ROWS, FUSED_MAX_ROWS + 1):
                weight, fused = product_weight(module, "weight", num_rows)
                picked[module, num_rows] = (weight.dtype, fused)
        return x + 1

    torch.compile(pick, backend="eager", fullgraph=True)(torch.zeros(1))
    gemm = FUSED_MAX_ROWS + 1
    assert (
        picked[at_limit, FUSED_MAX_ROWS]
        == picked[head, FUSED_MAX_ROWS]
        == (
            torch.bfloat16,
            True,
        )
    )
    assert picked[at_limit, gemm] == (torch.bfloat16, False)  # widened whole, in cache
    assert picked[head, gemm] == (torch.float32, False)  # too large to widen: the wide weight
    eager_weight, eager_fused = product_weight(head, "weight", 1)  # outside a captured step
    assert eager_weight is head.weight and not eager_fused


@pytest.mark.parametrize("shape", [((3, 40), (24, 40)), ((4, 2, 16), (4, 8, 16))])
def test_the_widening_product_is_a_matrix_product(shape):
    """`widening_product` against `matmul` on the widened weight: plain and batched."""
    x_shape, w_shape = shape
    x = torch.randn(x_shape, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(w_shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected = x @ weight.float().transpose(-1, -2)
    torch.testing.assert_close(widening_product(x, weight), expected)
