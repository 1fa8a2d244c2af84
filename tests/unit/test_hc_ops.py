# SPDX-License-Identifier: Apache-2.0
"""mHC's fused stream operators (`runtime.kernels.hc_pre`, `runtime.kernels.stream_expand`)
against their torch references: the C++ kernel `nextn_cpu::hc_pre` over token counts around
its tiles of four, one to four streams, hidden sizes off the vector width, fp32 and bf16
streams, one and twenty Sinkhorn iterations; the Triton kernels of `nextn::hc_pre` and
`nextn::hc_post` the same way, on CPU tensors through Triton's interpreter (in a child
process: `TRITON_INTERPRET` must be set before the kernels are defined) or on a GPU where
there is one; the fake implementations against the real outputs; and a compiled step
holding each operator as one node (its torch form not traced), RMSNorm's kernel too.

Tolerances are the Sinkhorn kernel's test's (only the order of sums and the exponential's
last bit differ); bf16 results are the fp32 result rounded once (within one bf16 step).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.configs.capture import default_cache_dir
from runtime.kernels import cpu_extension
from runtime.kernels.hc_pre import hc_pre, hc_pre_op, hc_pre_reference
from runtime.kernels.stream_expand import expand_streams_reference, hc_post_op

ROOT = Path(__file__).resolve().parents[2]
NORM_EPS, HC_EPS = 1e-6, 1e-6


def make_case(tokens, streams, hidden, dtype, iters, seed=0):
    """Streams, mHC weights with mixes of a few units (the Sinkhorn logits scaled to span
    tens: its softmax's shift matters), and a block output for the expansion."""
    g = torch.Generator().manual_seed(seed)
    mixes = streams * (2 + streams)
    return {
        "x": torch.randn(tokens, streams, hidden, generator=g).to(dtype),
        "fn": torch.randn(mixes, streams * hidden, generator=g) * 2 / (streams * hidden) ** 0.5,
        "scale": torch.tensor([1.0, 0.7, 5.0]) + 0.1 * torch.rand(3, generator=g),
        "base": torch.randn(mixes, generator=g) * 0.5,
        "block": torch.randn(tokens, hidden, generator=g).to(dtype),
        "iters": iters,
    }


def pre_args(case):
    return (case["x"], case["fn"], case["scale"], case["base"], NORM_EPS, HC_EPS, case["iters"])


def assert_pre_matches(got, case, bf16_rtol=2**-8):
    """`got` (y, post, comb) against the reference; bf16 `y` against the fp32 collapse
    (rounded once: within half a bf16 step of it, `bf16_rtol`)."""
    x = case["x"]
    exact = hc_pre_reference(x.float(), *pre_args(case)[1:])
    y, post, comb = got
    assert (y.dtype, post.dtype, comb.dtype) == (x.dtype, torch.float32, torch.float32)
    tokens, streams, hidden = x.shape
    assert y.shape == (tokens, hidden) and post.shape == (tokens, streams)
    assert comb.shape == (tokens, streams, streams)
    rtol = 1e-5 if x.dtype == torch.float32 else bf16_rtol
    torch.testing.assert_close(y.float(), exact[0], rtol=rtol, atol=1e-6)
    torch.testing.assert_close(post, exact[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, exact[2], rtol=1e-5, atol=1e-6)


def assert_post_matches(got, case, post, comb, bf16_rtol=2**-8):
    block, x = case["block"], case["x"]
    exact = expand_streams_reference(block.float(), x.float(), post, comb)
    assert got.dtype == x.dtype and got.shape == x.shape
    rtol = 1e-6 if x.dtype == torch.float32 else bf16_rtol
    torch.testing.assert_close(got.float(), exact, rtol=rtol, atol=1e-6)


# the C++ kernel ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernels():
    if not cpu_extension.load(default_cache_dir()):
        pytest.skip("the C++ CPU kernels cannot be built here")


@pytest.mark.parametrize("tokens", [1, 3, 16, 17])
@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize("hidden", [33, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("iters", [1, 20])
def test_cpu_kernel_matches_reference(kernels, tokens, streams, hidden, dtype, iters):
    case = make_case(tokens, streams, hidden, dtype, iters, seed=tokens * 7 + streams + hidden)
    with torch.no_grad():
        got = torch.ops.nextn_cpu.hc_pre(*pre_args(case))
    assert_pre_matches(got, case)


def test_cpu_kernel_results_do_not_depend_on_the_tokens_beside_them(kernels):
    """Tokens go through the kernel four at a time: each token's results are the same
    alone as in any batch (a verify step and a decode step of one token must agree)."""
    case = make_case(11, 4, 300, torch.float32, 20, seed=3)
    batched = torch.ops.nextn_cpu.hc_pre(*pre_args(case))
    for t in (0, 5, 10):
        alone = torch.ops.nextn_cpu.hc_pre(case["x"][t : t + 1], *pre_args(case)[1:])
        for a, b in zip(alone, batched):
            assert torch.equal(a[0], b[t])


def test_cpu_kernel_of_no_tokens_and_non_contiguous_streams(kernels):
    case = make_case(6, 4, 40, torch.float32, 20, seed=5)
    empty = torch.ops.nextn_cpu.hc_pre(case["x"][:0], *pre_args(case)[1:])
    assert [tuple(t.shape) for t in empty] == [(0, 40), (0, 4), (0, 4, 4)]
    wide = torch.randn(6, 4, 80)
    wide[..., ::2] = case["x"]
    got = torch.ops.nextn_cpu.hc_pre(wide[..., ::2], *pre_args(case)[1:])
    assert_pre_matches(got, case)


def test_cpu_kernel_rejects_mismatched_weights(kernels):
    case = make_case(4, 4, 16, torch.float32, 20)
    x, fn, scale, base = pre_args(case)[:4]
    for bad in ((x, fn[:-1], scale, base), (x, fn, scale[:2], base), (x, fn, scale, base[:-1])):
        with pytest.raises(RuntimeError, match="hc_pre"):
            torch.ops.nextn_cpu.hc_pre(*bad, NORM_EPS, HC_EPS, 20)
    with pytest.raises(RuntimeError, match="hc_pre"):
        torch.ops.nextn_cpu.hc_pre(x.half(), fn, scale, base, NORM_EPS, HC_EPS, 20)


# fakes and compiled graphs -------------------------------------------------------------


def fake_outputs(op, args):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = op(*fake_args)
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fakes_give_the_real_shapes_and_dtypes(kernels, dtype):
    case = make_case(5, 4, 24, dtype, 20)
    x = case["x"]
    post, comb = torch.rand(5, 4), torch.rand(5, 4, 4)
    ops = [
        (torch.ops.nextn_cpu.hc_pre.default, pre_args(case)),
        (hc_pre_op, pre_args(case)),
        (torch.ops.nextn_cpu.hc_post.default, (case["block"], x, post, comb)),
        (hc_post_op, (case["block"], x, post, comb)),
    ]
    for op, args in ops:
        real = op(*args)
        real = real if isinstance(real, tuple) else (real,)
        fake = fake_outputs(op, args)
        assert [(f.shape, f.dtype) for f in fake] == [(r.shape, r.dtype) for r in real], op
        assert all(f.is_contiguous() for f in fake)
    torch.library.opcheck(hc_pre_op, pre_args(case), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(
        hc_post_op, (case["block"], x, post, comb), test_utils=("test_schema", "test_faketensor")
    )


def traced_targets(fn, *args) -> list[str]:
    """The call targets of the one graph `torch.compile` makes of `fn(*args)`."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=record, fullgraph=True, dynamic=False)(*args)
    assert len(graphs) == 1
    return [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]


def test_compiled_sub_block_holds_each_operator_as_one_node(kernels, monkeypatch):
    """Through the layer functions a model calls: with the kernels, one `hc_pre` and one
    `hc_post` node and nothing of their torch forms; without, the torch forms (Sinkhorn's
    ~80 operators among them)."""
    from runtime.layers.hyper_connection import hc_post as layer_post
    from runtime.layers.hyper_connection import hc_pre as layer_pre

    case = make_case(3, 4, 32, torch.float32, 20)

    def sub_block(x, fn, scale, base, block):
        y, post, comb = layer_pre(x, fn, scale, base, NORM_EPS, HC_EPS, 20)
        return layer_post(block + y, x, post, comb)

    args = (case["x"], case["fn"], case["scale"], case["base"], case["block"])
    targets = traced_targets(sub_block, *args)
    computed = [t for t in targets if "getitem" not in t]  # the op's outputs picked out
    assert computed == ["nextn_cpu.hc_pre", "<built-in function add>", "nextn_cpu.hc_post"]

    monkeypatch.setitem(cpu_extension._state, "available", False)
    targets = traced_targets(sub_block, *args)
    assert not any("hc_pre" in t or "hc_post" in t for t in targets), targets
    assert len(targets) > 80


def test_compiled_norms_hold_the_kernel_as_one_node(kernels, monkeypatch):
    """RMSNorm of fp32 rows in a compiled step: `nextn_cpu::rms_norm`, the eager steps'
    kernel (same values captured and eager); without the kernels, the torch form."""
    from runtime.layers.norm import RMSNorm, WeightlessRMSNorm

    norm, weightless = RMSNorm(32, 1e-6), WeightlessRMSNorm(1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32) + 0.5)
    x = torch.randn(3, 4, 32)
    targets = traced_targets(lambda x: weightless(norm(x)), x)
    assert targets == ["nextn_cpu.rms_norm"] * 2, targets
    with torch.no_grad():
        compiled = torch.compile(lambda x: weightless(norm(x)), backend="eager")(x)
        assert torch.equal(compiled, weightless(norm(x)))
    monkeypatch.setitem(cpu_extension._state, "available", False)
    targets = traced_targets(lambda x: weightless(norm(x)), x)
    assert "nextn_cpu.rms_norm" not in targets and any("rsqrt" in t for t in targets), targets


# the Triton kernels (interpreted on CPU, or on a GPU) ------------------------------------

TRITON_CASES = [
    *[
        (tokens, streams, 33, torch.float32, 20)
        for tokens in (1, 3, 16, 17)
        for streams in (1, 2, 4)
    ],
    (17, 4, 300, torch.bfloat16, 20),
    (3, 4, 300, torch.float32, 1),
    (16, 2, 33, torch.bfloat16, 1),
    (1, 1, 300, torch.bfloat16, 20),
]


def run_triton_cases(cases_path: str, out_path: str) -> None:
    """Child process: each case through the Triton kernels (on the GPU where there is one)."""
    from runtime.kernels.triton import hyper_connection

    device = "cuda" if torch.cuda.is_available() else "cpu"
    outputs = []
    for case in torch.load(cases_path):
        on = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        pre = hyper_connection.hc_pre(*pre_args(on))
        post = hyper_connection.hc_post(on["block"], on["x"], pre[1], pre[2])
        outputs.append(([t.cpu() for t in pre], post.cpu()))
    torch.save(outputs, out_path)


@pytest.fixture(scope="module")
def triton_outputs(tmp_path_factory):
    pytest.importorskip("triton")
    folder = tmp_path_factory.mktemp("triton_hc")
    cases = [make_case(*spec, seed=i) for i, spec in enumerate(TRITON_CASES)]
    torch.save(cases, folder / "cases.pt")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "tests.unit.test_hc_ops",
        str(folder / "cases.pt"),
        str(folder / "out.pt"),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return cases, torch.load(folder / "out.pt")


@pytest.mark.parametrize("index", range(len(TRITON_CASES)), ids=[str(c) for c in TRITON_CASES])
def test_triton_kernels_match_references(triton_outputs, index):
    cases, outputs = triton_outputs
    case = cases[index]
    pre, post = outputs[index]
    # Triton's interpreter casts fp32 to bf16 by truncation where a GPU rounds to nearest:
    # within one bf16 step of the fp32 result instead of half of one
    bf16_rtol = 2**-8 if torch.cuda.is_available() else 2**-7
    assert_pre_matches(tuple(pre), case, bf16_rtol)
    assert_post_matches(post, case, pre[1], pre[2], bf16_rtol)


@pytest.mark.gpu
def test_custom_ops_on_cuda_take_the_triton_kernels():
    case = make_case(17, 4, 300, torch.bfloat16, 20)
    on = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    with torch.no_grad():
        got = hc_pre(*pre_args(on))
        expanded = hc_post_op(on["block"], on["x"], got[1], got[2])
    assert_pre_matches(tuple(t.cpu() for t in got), case)
    assert_post_matches(expanded.cpu(), case, got[1].cpu(), got[2].cpu())


if __name__ == "__main__":
    run_triton_cases(*sys.argv[1:])
