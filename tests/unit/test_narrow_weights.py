# SPDX-License-Identifier: Apache-2.0
"""Narrow (bf16) copies of fp32 weights for captured steps: made only where lossless, read
only inside a compiled graph, and the products there equal the wide ones (exactly when
traced, to rounding once the compiler fuses the widening into its loops)."""

from __future__ import annotations

import torch

from runtime.layers.embedding import ParallelLMHead
from runtime.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from runtime.layers.moe.experts import FusedMoEExperts
from runtime.layers.narrow_weights import MIN_NUMEL, WIDENED_MAX_NUMEL, attach_narrow_copies


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


def test_compiled_products_read_the_copies_and_equal_the_wide_ones():
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

    x = bf16_valued((3, hidden), seed=7)
    topk_ids = torch.tensor([[0, 5], [5, 2], [7, 0]])
    topk_weights = torch.rand(3, 2)
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
    torch.testing.assert_close(traced, eager, rtol=0, atol=0)  # widened values: the same math
    # the compiler may fuse the widening into its own loops: rounding-level differences
    torch.testing.assert_close(narrow, wide)
    torch.testing.assert_close(narrow, eager)


def test_products_widened_before_a_gemm_keep_large_weights_wide():
    """A linear layer or LM head widens its whole copy into an fp32 temporary before an
    external GEMM, which pays only while that temporary fits a core's cache: above
    `WIDENED_MAX_NUMEL` (the default model's 4096 x 256 head) the weight stays wide. Routed
    experts widen inside the gathered product's own kernel, so any size gets a copy."""
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
    assert hasattr(at_limit, "weight_narrow")
    assert not hasattr(head, "weight_narrow")
    assert hasattr(moe, "w13_weight_narrow") and hasattr(moe, "w2_weight_narrow")
