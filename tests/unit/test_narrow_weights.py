# SPDX-License-Identifier: Apache-2.0
"""Narrow (bf16) copies of fp32 weights for captured steps: made only where lossless, read
only inside a compiled graph, and the products there equal the wide ones (to rounding:
products of few rows sum in the compiler's order, not the GEMM's)."""

from __future__ import annotations

import pytest
import torch

from runtime.configs.capture import default_cache_dir
from runtime.kernels import cpu_extension
from runtime.layers.embedding import ParallelLMHead
from runtime.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from runtime.layers.moe.experts import FusedMoEExperts
from runtime.layers.narrow_weights import (
    FUSED_MAX_ROWS,
    KERNEL_MAX_ROWS,
    MIN_NUMEL,
    WIDENED_MAX_NUMEL,
    ProductPath,
    attach_narrow_copies,
    product_weight,
    widening_product,
)

KERNEL = cpu_extension.load(default_cache_dir())


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
    made = attach_narrow_copies([exact, lossy, tiny, head, draft_head], tiles=False)
    assert made == (128 * 256 + 512 * 64) * 2  # one copy of the shared head
    assert exact.weight_narrow.dtype == torch.bfloat16
    assert torch.equal(exact.weight_narrow.float(), exact.weight)
    assert not hasattr(lossy, "weight_narrow") and not hasattr(tiny, "weight_narrow")
    assert draft_head.weight_narrow is head.weight_narrow
    assert tiny.weight.numel() < MIN_NUMEL <= exact.weight.numel()


@pytest.mark.parametrize(
    "num_rows,kernel",
    [
        (FUSED_MAX_ROWS, True),  # the compiler's reduction
        (FUSED_MAX_ROWS + 2, True),  # the narrow-weight kernel
        (FUSED_MAX_ROWS + 2, False),  # no kernel: widened before GEMMs
        (KERNEL_MAX_ROWS + 1, True),  # widened before GEMMs, the experts in the kernel
    ],
)
def test_compiled_products_read_the_copies_and_equal_the_wide_ones(num_rows, kernel, monkeypatch):
    if kernel and not KERNEL:
        pytest.skip("the narrow-weight kernel cannot be built")
    monkeypatch.setitem(cpu_extension._state, "available", kernel)
    # every product a GEMM (the routed experts take the kernel at any row count)
    gemm = num_rows > FUSED_MAX_ROWS and not kernel
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
        # captured over copies with the kernel loaded the experts take it, else gathered
        experts = moe.forward_narrow if moe.kernel_ready(x) else moe.forward_gathered
        y = y + experts(x, topk_weights, topk_ids)
        return head.compute_logits(y)

    seen_dtypes, kernel_calls = set(), []

    def recording_backend(gm, example_inputs):
        seen_dtypes.update(t.dtype for t in example_inputs if isinstance(t, torch.Tensor))
        kernel_calls.extend(n for n in gm.graph.nodes if "narrow_product" in str(n.target))
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
    # the kernel: both expert products, and within its row range the column layer and the
    # head (the row layer's 8K elements are below `MIN_NUMEL`: no copy)
    assert not hasattr(row, "weight_narrow")
    linears = 2 if FUSED_MAX_ROWS < num_rows <= KERNEL_MAX_ROWS else 0
    assert len(kernel_calls) == ((2 + linears) if kernel else 0)
    if gemm:  # widened before the same GEMMs: the same math, bit for bit
        torch.testing.assert_close(traced, eager, rtol=0, atol=0)
    torch.testing.assert_close(traced, eager)
    # the compiler may fuse the widening into its own loops: rounding-level differences
    torch.testing.assert_close(narrow, wide)
    torch.testing.assert_close(narrow, eager)


@pytest.mark.parametrize("kernel", [True, False])
def test_products_pick_their_path_by_rows_and_size(kernel, monkeypatch):
    """Up to `FUSED_MAX_ROWS` rows a product reads its copy in the compiler's reduction, up
    to `KERNEL_MAX_ROWS` through the narrow-weight kernel where it is loaded. A GEMM over
    more rows widens its whole copy into an fp32 temporary first, which pays only while that
    temporary fits a core's cache: above `WIDENED_MAX_NUMEL` (the default model's 4096 x
    256 head) it reads the wide weight. Products that widen inside their own kernel (the
    routed experts') read a copy of any size, so every size gets one."""
    if kernel and not KERNEL:
        pytest.skip("the narrow-weight kernel cannot be built")
    monkeypatch.setitem(cpu_extension._state, "available", kernel)
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
    row_counts = (FUSED_MAX_ROWS, FUSED_MAX_ROWS + 1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1)

    def pick(x):
        for module in (at_limit, head):
            for num_rows in row_counts:
                weight, path = product_weight(module, "weight", num_rows)
                picked[module, num_rows] = (weight.dtype, path)
        return x + 1

    torch.compile(pick, backend="eager", fullgraph=True)(torch.zeros(1))
    for module in (at_limit, head):
        assert picked[module, FUSED_MAX_ROWS] == (torch.bfloat16, ProductPath.REDUCTION)
    for num_rows in (FUSED_MAX_ROWS + 1, KERNEL_MAX_ROWS):
        if kernel:
            assert picked[at_limit, num_rows] == (torch.bfloat16, ProductPath.KERNEL)
            assert picked[head, num_rows] == (torch.bfloat16, ProductPath.KERNEL)
        else:
            assert picked[at_limit, num_rows] == (torch.bfloat16, ProductPath.GEMM)
            assert picked[head, num_rows] == (torch.float32, ProductPath.GEMM)
    gemm = KERNEL_MAX_ROWS + 1
    assert picked[at_limit, gemm] == (torch.bfloat16, ProductPath.GEMM)  # widened, in cache
    assert picked[head, gemm] == (torch.float32, ProductPath.GEMM)  # too large to widen
    eager_weight, eager_path = product_weight(head, "weight", 1)  # outside a captured step
    assert eager_weight is head.weight and eager_path is ProductPath.GEMM


@pytest.mark.parametrize("shape", [((3, 40), (24, 40)), ((4, 2, 16), (4, 8, 16))])
def test_the_widening_product_is_a_matrix_product(shape):
    """`widening_product` against `matmul` on the widened weight: plain and batched."""
    x_shape, w_shape = shape
    x = torch.randn(x_shape, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(w_shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected = x @ weight.float().transpose(-1, -2)
    torch.testing.assert_close(widening_product(x, weight), expected)
