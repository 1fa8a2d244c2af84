# SPDX-License-Identifier: Apache-2.0
"""The MoE router as one operator (`runtime.kernels.moe_route`) and SwiGLU's kernel in
captured steps: `nextn_cpu::moe_route` against the torch reference bit for bit (the same
ATen calls) for every scoring function, with and without a correction bias, hash-table
ids, renormalised or not, fp32 and bf16 logits; the reference against a dense
restatement; the fakes against the real outputs; and compiled steps holding the router and
SwiGLU as one node each.
"""

from __future__ import annotations

import pytest
import torch

from runtime.configs.capture import default_cache_dir
from runtime.kernels import cpu_extension
from runtime.kernels.moe_route import moe_route, moe_route_op, moe_route_reference

SCORING = ["sqrtsoftplus", "sigmoid", "softmax"]


def make_logits(tokens=7, experts=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, experts, generator=g) * 2).to(dtype)
    bias = torch.randn(experts, generator=g) * 0.1
    table = torch.randint(0, experts, (tokens, 3), generator=g, dtype=torch.int32)
    return logits, bias, table


def test_reference_selects_the_best_biased_scores():
    """Dense restatement: the chosen set is the k largest of score + bias, each weighed by
    its unbiased score over the chosen scores' sum, times the scale."""
    logits, bias, _ = make_logits(seed=1)
    weights, ids = moe_route_reference(logits, bias, None, 4, "sigmoid", True, 2.5)
    scores = logits.sigmoid()
    for t in range(logits.shape[0]):
        ranked = (scores[t] + bias).tolist()
        best = sorted(range(len(ranked)), key=lambda e: -ranked[e])[:4]
        assert sorted(ids[t].tolist()) == sorted(best)
        chosen = scores[t, ids[t]]
        torch.testing.assert_close(weights[t], chosen / chosen.sum() * 2.5)


@pytest.fixture(scope="module")
def kernels():
    if not cpu_extension.load(default_cache_dir()):
        pytest.skip("the C++ CPU kernels cannot be built here")


@pytest.mark.parametrize("scoring", SCORING)
@pytest.mark.parametrize("source", ["topk", "biased", "hash"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_kernel_equals_reference(kernels, scoring, source, renormalize, dtype):
    logits, bias, table = make_logits(dtype=dtype, seed=len(scoring))
    args = (
        logits,
        bias if source == "biased" else None,
        table if source == "hash" else None,
        4,
        scoring,
        renormalize,
        1.5,
    )
    with torch.no_grad():
        weights, ids = torch.ops.nextn_cpu.moe_route(*args)
    expected = moe_route_reference(*args)
    assert torch.equal(weights, expected[0]) and torch.equal(ids, expected[1])
    assert (weights.dtype, ids.dtype) == (torch.float32, torch.long)


def test_outputs_never_alias_the_hash_ids(kernels):
    """int64 hash ids come back as a new tensor (a compiled step assumes an op's outputs
    are not its inputs)."""
    logits, _, table = make_logits()
    table = table.long()
    for op in (torch.ops.nextn_cpu.moe_route, moe_route_op):
        _, ids = op(logits, None, table, 3, "sqrtsoftplus", True, 1.0)
        assert torch.equal(ids, table) and ids.data_ptr() != table.data_ptr()


def test_cpu_kernel_rejects_an_unknown_scoring_function(kernels):
    logits, _, _ = make_logits()
    with pytest.raises(RuntimeError, match="moe_route"):
        torch.ops.nextn_cpu.moe_route(logits, None, None, 2, "tanh", True, 1.0)


def test_fakes_give_the_real_shapes(kernels):
    from torch._subclasses.fake_tensor import FakeTensorMode

    logits, bias, table = make_logits()
    for hash_ids in (None, table):
        args = (logits, bias, hash_ids, 4, "sqrtsoftplus", True, 1.5)
        for op in (torch.ops.nextn_cpu.moe_route.default, moe_route_op):
            real = op(*args)
            with FakeTensorMode() as mode:
                fake = op(
                    *[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
                )
            assert [(f.shape, f.dtype) for f in fake] == [(r.shape, r.dtype) for r in real]
        torch.library.opcheck(moe_route_op, args, test_utils=("test_schema", "test_faketensor"))


def traced_targets(fn, *args) -> list[str]:
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=record, fullgraph=True, dynamic=False)(*args)
    assert len(graphs) == 1
    return [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]


def test_compiled_router_and_swiglu_are_one_node_each(kernels, monkeypatch):
    from runtime.kernels.swiglu import swiglu
    from runtime.layers.moe import select_experts

    logits, bias, _ = make_logits()
    gate_up = torch.randn(5, 24)

    def step(logits, bias, gate_up):
        weights, ids = select_experts(logits, 4, "sqrtsoftplus", correction_bias=bias)
        gate, up = gate_up.split(12, dim=-1)
        return weights, ids, swiglu(gate, up, 7.0)

    targets = [t for t in traced_targets(step, logits, bias, gate_up) if "getitem" not in t]
    assert targets == ["nextn_cpu.moe_route", "nextn_cpu.swiglu"], targets  # split: a method
    assert not any("topk" in t or "softplus" in t or "silu" in t for t in targets), targets
    with torch.no_grad():
        compiled = torch.compile(step, backend="eager")(logits, bias, gate_up)
        for a, b in zip(compiled, step(logits, bias, gate_up)):
            assert torch.equal(a, b)
    monkeypatch.setitem(cpu_extension._state, "available", False)
    targets = traced_targets(step, logits, bias, gate_up)
    assert "nextn_cpu.moe_route" not in targets and any("topk" in t for t in targets)


@pytest.mark.gpu
def test_custom_op_on_cuda_equals_the_reference():
    logits, bias, _ = make_logits(tokens=33, experts=64)
    args = (logits.cuda(), bias.cuda(), None, 6, "sqrtsoftplus", True, 1.5)
    with torch.no_grad():
        weights, ids = moe_route(*args)
        expected = moe_route_reference(*args)
    assert torch.equal(weights, expected[0]) and torch.equal(ids, expected[1])


def test_swiglu_of_per_pair_halves_takes_the_kernel(kernels):
    """The routed experts' `[P, 1, 2 I]` products split into halves: one kernel node in a
    compiled step, the reference's values (the kernel's exponential within an ulp or two)."""
    from runtime.kernels.swiglu import swiglu, swiglu_reference

    gate_up = torch.randn(6, 1, 40) * 4

    def step(gate_up):
        return swiglu(*gate_up.split(20, dim=-1), 5.0)

    targets = [t for t in traced_targets(step, gate_up) if "getitem" not in t]  # split's
    assert targets == ["nextn_cpu.swiglu"]
    with torch.no_grad():
        got = step(gate_up)
    assert got.shape == (6, 1, 20)
    expected = swiglu_reference(*gate_up.split(20, dim=-1), 5.0)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
