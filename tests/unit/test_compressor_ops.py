# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V4's compressor as one operator each for its state rows
(`runtime.kernels.compressor_rows`, equal to the reference bit for bit) and its pooling
(`runtime.kernels.compressor_pool`): the
C++ kernel `nextn_cpu::compressor_pool` and the Triton kernel of `nextn::compressor_pool`
(on CPU tensors through Triton's interpreter, in a child process: `TRITON_INTERPRET` must
be set before the kernel is defined; or on a GPU where there is one) against the torch
reference, for HCA (overlap 1) and CSA (overlap 2) blocks, some rows not valid, none
valid; the reference against a float64 restatement row by row; the fakes against the real
outputs; and a compiled compressor holding the pooling as one node.

Only the order of the sums differs from the reference (a few ulps of fp32).
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
from runtime.kernels.compressor_entries import (
    compressor_entries,
    compressor_entries_op,
    compressor_entries_reference,
)
from runtime.kernels.compressor_pool import (
    compressor_pool,
    compressor_pool_op,
    compressor_pool_reference,
)
from runtime.kernels.compressor_rows import (
    compressor_rows,
    compressor_rows_op,
    compressor_rows_reference,
)

ROOT = Path(__file__).resolve().parents[2]
# (entries, dim, ratio, overlap)
SHAPES = [(1, 16, 4, 2), (5, 33, 4, 2), (3, 70, 8, 1), (9, 8, 3, 1), (0, 16, 4, 2)]


def make_case(entries, dim, ratio, overlap, seed=0):
    g = torch.Generator().manual_seed(seed)
    length = overlap * ratio
    rows = torch.randn(entries, length, 2 * overlap * dim, generator=g) * 3
    valid = torch.rand(entries, length, generator=g) > 0.3
    valid[:, -1] = True  # every block has a row (the all-masked case is its own test)
    return rows, valid, dim, ratio, overlap


# (tokens, W, ratio, dtype)
ROW_SHAPES = [(1, 16, 4, torch.float32), (7, 33, 4, torch.bfloat16), (5, 70, 128, torch.float16)]


def make_rows_case(tokens, width, ratio, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv_gate = torch.randn(tokens, 2 * width, generator=g).to(dtype)
    ape = torch.randn(ratio, width, generator=g)
    positions = torch.randint(0, 10000, (tokens,), generator=g)
    return kv_gate, ape, positions


def test_state_rows_reference_is_kv_then_gate_plus_its_slot():
    kv_gate, ape, positions = make_rows_case(5, 6, 4, torch.float32)
    got = compressor_rows_reference(kv_gate, ape, positions)
    for t in range(5):
        expected = torch.cat([kv_gate[t, :6], kv_gate[t, 6:] + ape[int(positions[t]) % 4]])
        assert torch.equal(got[t], expected)


def assert_matches(got, rows, valid, dim, ratio, overlap):
    exact = compressor_pool_reference(rows, valid, dim, ratio, overlap)
    assert got.shape == exact.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-6)


def test_reference_is_the_row_by_row_pooling():
    rows, valid, dim, ratio, overlap = make_case(3, 6, 4, 2, seed=1)
    got = compressor_pool_reference(rows, valid, dim, ratio, overlap)
    width = overlap * dim
    for b in range(3):
        for c in range(dim):
            kv, gate = [], []
            for j in range(overlap * ratio):
                channel = c + (dim if j >= ratio else 0)
                if valid[b, j]:
                    kv.append(rows[b, j, channel].double())
                    gate.append(rows[b, j, width + channel].double())
            weights = torch.softmax(torch.stack(gate), 0)
            expected = (weights * torch.stack(kv)).sum()
            torch.testing.assert_close(got[b, c].double(), expected, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def kernels():
    if not cpu_extension.load(default_cache_dir()):
        pytest.skip("the C++ CPU kernels cannot be built here")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cpu_kernel_matches_reference(kernels, shape):
    case = make_case(*shape, seed=sum(shape))
    with torch.no_grad():
        got = torch.ops.nextn_cpu.compressor_pool(*case)
    assert_matches(got, *case)


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
def test_cpu_state_rows_kernel_equals_reference(kernels, shape):
    case = make_rows_case(*shape, seed=shape[0])
    with torch.no_grad():
        got = torch.ops.nextn_cpu.compressor_rows(*case)
    assert torch.equal(got, compressor_rows_reference(*case))
    kv_gate, ape, positions = case
    empty = torch.ops.nextn_cpu.compressor_rows(kv_gate[:0], ape, positions[:0])
    assert empty.shape == (0, kv_gate.shape[1])
    with pytest.raises(RuntimeError, match="compressor_rows"):
        torch.ops.nextn_cpu.compressor_rows(kv_gate[:, 1:], ape, positions)
    with pytest.raises(RuntimeError, match="compressor_rows"):
        torch.ops.nextn_cpu.compressor_rows(kv_gate, ape, positions.int())


def test_cpu_kernel_of_a_block_with_no_valid_row_is_nan_as_torch(kernels):
    rows, valid, dim, ratio, overlap = make_case(2, 8, 4, 1)
    valid[0] = False
    got = torch.ops.nextn_cpu.compressor_pool(rows, valid, dim, ratio, overlap)
    exact = compressor_pool_reference(rows, valid, dim, ratio, overlap)
    assert got[0].isnan().all() and exact[0].isnan().all()
    torch.testing.assert_close(got[1], exact[1], rtol=1e-5, atol=1e-6)


def test_cpu_kernel_checks_its_operands(kernels):
    rows, valid, dim, ratio, overlap = make_case(2, 8, 4, 2)
    for bad in (
        (rows, valid, dim + 1, ratio, overlap),
        (rows, valid, dim, ratio, 3),
        (rows, valid[:, :-1], dim, ratio, overlap),
        (rows.double(), valid, dim, ratio, overlap),
    ):
        with pytest.raises(RuntimeError, match="compressor_pool"):
            torch.ops.nextn_cpu.compressor_pool(*bad)


def test_fakes_give_the_real_shapes(kernels):
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_case(5, 16, 4, 2)
    for op in (torch.ops.nextn_cpu.compressor_pool.default, compressor_pool_op):
        real = op(*case)
        with FakeTensorMode() as mode:
            fake = op(mode.from_tensor(case[0]), mode.from_tensor(case[1]), *case[2:])
        assert (fake.shape, fake.dtype) == (real.shape, real.dtype)
    torch.library.opcheck(compressor_pool_op, case, test_utils=("test_schema", "test_faketensor"))
    rows_case = make_rows_case(3, 8, 4, torch.bfloat16)
    for op in (torch.ops.nextn_cpu.compressor_rows.default, compressor_rows_op):
        real = op(*rows_case)
        with FakeTensorMode() as mode:
            fake = op(*[mode.from_tensor(a) for a in rows_case])
        assert (fake.shape, fake.dtype) == (real.shape, real.dtype)
    torch.library.opcheck(
        compressor_rows_op, rows_case, test_utils=("test_schema", "test_faketensor")
    )


def test_compiled_compressor_pools_in_one_node(kernels, monkeypatch):
    """The compressor's `_pool` as a captured step traces it: one node, the eager values;
    without the kernels, the torch form."""
    from runtime.layers.attention.deepseek_v4 import DeepseekV4Compressor

    compressor = DeepseekV4Compressor(32, 16, 4, 1e-6, sparse=True)
    with torch.no_grad():  # parameters start as torch.empty: NaN garbage would fail equality
        for parameter in compressor.parameters():
            parameter.copy_(torch.randn_like(parameter))
    rows, valid = make_case(3, 16, 4, 2)[:2]
    x, positions = torch.randn(3, 32), torch.tensor([0, 5, 11])
    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(compressor._pool, backend=record, fullgraph=True)(rows, valid)
        assert graphs[-1] == ["nextn_cpu.compressor_pool"]
        compiled = torch.compile(compressor._pool, backend="eager")(rows, valid)
        assert torch.equal(compiled, compressor._pool(rows, valid))
        assert_matches(compiled, rows, valid, 16, 4, 2)
        torch.compile(compressor.state_rows, backend=record, fullgraph=True)(x, positions)
        assert graphs[-1][-1] == "nextn_cpu.compressor_rows" and "cat" not in str(graphs[-1])
        kv_gate = compressor.fused_wkv_wgate(x)
        expected = compressor_rows_reference(kv_gate, compressor.ape, positions)
        assert torch.equal(compressor.state_rows(x, positions), expected)
        monkeypatch.setitem(cpu_extension._state, "available", False)
        torch._dynamo.reset()
        torch.compile(compressor._pool, backend=record, fullgraph=True)(rows, valid)
    assert "nextn_cpu.compressor_pool" not in graphs[-1] and len(graphs[-1]) > 5


def make_entries_case(entries=5, dim=32, ratio=4, overlap=2, rd=16, seed=0):
    """The arguments of `compressor_entries`: state rows, a norm weight, positions and a
    rotary table of the trailing `rd` channels (interleaved pairs, DeepSeek-V4's)."""
    rows, valid, *_ = make_case(entries, dim, ratio, overlap, seed=seed)
    g = torch.Generator().manual_seed(seed)
    weight = torch.rand(dim, generator=g) + 0.5
    positions = torch.randint(0, 9000, (entries,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rd, 2).float() / rd))
    return (
        rows,
        valid,
        weight,
        1e-6,
        positions,
        inv_freq,
        1.2,
        dim,
        ratio,
        overlap,
        dim - rd,
        True,
    )


@pytest.mark.parametrize("overlap", [1, 2])
def test_cpu_entries_are_the_steps_one_by_one(kernels, overlap):
    """`nextn_cpu::compressor_entries` equals the pooling, norm and rotation kernels called
    in turn (bit for bit) and the torch reference (within the kernels' ulps)."""
    args = make_entries_case(overlap=overlap, seed=overlap)
    rows, valid, weight, eps, positions, inv_freq, scaling, dim, ratio, _, lo, inter = args
    with torch.no_grad():
        got = torch.ops.nextn_cpu.compressor_entries(*args)
        pooled = torch.ops.nextn_cpu.compressor_pool(rows, valid, dim, ratio, overlap)
        normed = torch.ops.nextn_cpu.rms_norm(pooled, weight, eps)
        freqs = positions.float().unsqueeze(-1) * inv_freq
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        steps = torch.ops.nextn_cpu.rotary(normed, cos, sin, lo, inter, False)
    assert torch.equal(got, steps)
    torch.testing.assert_close(got, compressor_entries_reference(*args), rtol=1e-5, atol=1e-5)
    fake = fake_entries(torch.ops.nextn_cpu.compressor_entries.default, args)
    assert (fake.shape, fake.dtype) == (got.shape, got.dtype)
    assert fake_entries(compressor_entries_op, args).shape == got.shape
    torch.library.opcheck(
        compressor_entries_op, args, test_utils=("test_schema", "test_faketensor")
    )


def fake_entries(op, args):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        return op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])


def test_compiled_make_entries_is_one_node(kernels, monkeypatch):
    """The compressor's `make_entries` (pool, norm, rotary table, rotation) as a captured
    step traces it: one node, with the values of the kernels one by one (the layer's path
    without the fused operator)."""
    from runtime.layers.attention.deepseek_v4 import DeepseekV4Compressor
    from runtime.layers.rotary import RotaryEmbedding

    compressor = DeepseekV4Compressor(32, 32, 4, 1e-6, sparse=True)
    with torch.no_grad():
        compressor.norm.weight.copy_(torch.rand(32) + 0.5)
    rope = RotaryEmbedding(16, {"rope_theta": 10000.0}, interleaved=True, rotate_tail=True)
    rows, valid, *_ = make_case(3, 32, 4, 2, seed=7)
    positions = torch.tensor([0, 8, 4096])
    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    def entries(rows, valid, positions):
        return compressor.make_entries(rows, valid, positions, rope, torch.float32)

    torch._dynamo.reset()
    with torch.no_grad():
        fused = torch.compile(entries, backend=record, fullgraph=True)(rows, valid, positions)
        assert graphs[-1] == ["nextn_cpu.compressor_entries"], graphs[-1]
        monkeypatch.setattr("runtime.kernels.compressor_entries.uses_kernel", lambda *a: False)
        assert torch.equal(fused, entries(rows, valid, positions))  # the kernels one by one


# the Triton kernel (interpreted on CPU, or on a GPU) -------------------------------------


def run_triton_cases(cases_path: str, out_path: str) -> None:
    """Child process: each case through the Triton kernel (on the GPU where there is one)."""
    from runtime.kernels.triton import compressor_pool as triton_pool

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pool_cases, row_cases = torch.load(cases_path)
    pooled, rows_out = [], []
    for rows, valid, dim, ratio, overlap in pool_cases:
        got = triton_pool.compressor_pool(rows.to(device), valid.to(device), dim, ratio, overlap)
        pooled.append(got.cpu())
    for case in row_cases:
        rows_out.append(triton_pool.compressor_rows(*[a.to(device) for a in case]).cpu())
    torch.save((pooled, rows_out), out_path)


@pytest.fixture(scope="module")
def triton_outputs(tmp_path_factory):
    pytest.importorskip("triton")
    folder = tmp_path_factory.mktemp("triton_pool")
    pool_cases = [make_case(*shape, seed=i) for i, shape in enumerate(SHAPES)]
    row_cases = [make_rows_case(*shape, seed=i) for i, shape in enumerate(ROW_SHAPES)]
    torch.save((pool_cases, row_cases), folder / "in.pt")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "tests.unit.test_compressor_ops"]
    cmd += [str(folder / "in.pt"), str(folder / "out.pt")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(folder / "out.pt")


@pytest.mark.parametrize("index", range(len(SHAPES)), ids=[str(s) for s in SHAPES])
def test_triton_kernel_matches_reference(triton_outputs, index):
    assert_matches(triton_outputs[0][index], *make_case(*SHAPES[index], seed=index))


@pytest.mark.parametrize("index", range(len(ROW_SHAPES)), ids=[str(s) for s in ROW_SHAPES])
def test_triton_state_rows_kernel_equals_reference(triton_outputs, index):
    case = make_rows_case(*ROW_SHAPES[index], seed=index)
    assert torch.equal(triton_outputs[1][index], compressor_rows_reference(*case))


@pytest.mark.gpu
def test_custom_op_on_cuda_takes_the_triton_kernel():
    rows, valid, dim, ratio, overlap = make_case(9, 64, 4, 2, seed=3)
    with torch.no_grad():
        got = compressor_pool(rows.cuda(), valid.cuda(), dim, ratio, overlap)
    assert_matches(got.cpu(), rows, valid, dim, ratio, overlap)
    kv_gate, ape, positions = make_rows_case(9, 64, 4, torch.bfloat16)
    with torch.no_grad():
        state = compressor_rows(kv_gate.cuda(), ape.cuda(), positions.cuda())
    assert torch.equal(state.cpu(), compressor_rows_reference(kv_gate, ape, positions))
    args = make_entries_case(entries=9, dim=64, rd=32, seed=5)
    on = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    with torch.no_grad():
        got = compressor_entries(*on)
    expected = compressor_entries_reference(*args)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    run_triton_cases(*sys.argv[1:])
