# SPDX-License-Identifier: Apache-2.0
"""Rotary position embedding as one operator (`runtime.kernels.rotary`): the C++ kernel
`nextn_cpu::rotary` and the Triton kernel of `nextn::rotary` (on CPU tensors through
Triton's interpreter, in a child process: `TRITON_INTERPRET` must be set before the kernel
is defined; or on a GPU where there is one) against the torch reference, over rows and
heads, interleaved pairs and NeoX halves, full, leading and trailing slices, the forward
and inverse rotation, fp32, bf16 and fp16; the reference against a float64 restatement as
complex products; the fakes against the real outputs; and a compiled step holding the
layer's rotation as one node.

fp32 results may differ from the reference's by an ulp (a product may be fused into its
sum); bf16 and fp16 results are the fp32 result rounded once (within one step).
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
from runtime.kernels.rotary import rotary, rotary_op, rotary_reference

ROOT = Path(__file__).resolve().parents[2]

# (tokens, heads or None for [T, D], dim, rotated dim, where: "full", "head" or "tail")
SHAPES = [
    (1, None, 64, 64, "full"),
    (5, 3, 64, 16, "tail"),
    (7, 4, 40, 24, "head"),
    (16, None, 96, 32, "tail"),
    (17, 2, 34, 2, "head"),
    (0, 4, 64, 16, "tail"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_case(tokens, heads, dim, rd, where, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (tokens, dim) if heads is None else (tokens, heads, dim)
    positions = torch.randint(0, 5000, (tokens,), generator=g).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rd, 2).float() / rd))
    angles = positions[:, None] * inv_freq
    lo = {"full": 0, "head": 0, "tail": dim - rd}[where]
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    return x, angles.cos() * 1.1, angles.sin() * 1.1, lo


def tolerance(dtype):
    step = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    return {"rtol": 2 * step, "atol": 1e-5 if dtype == torch.float32 else 4 * step}


def assert_matches(got, x, cos, sin, lo, interleaved, inverse):
    exact = rotary_reference(x.float(), cos, sin, lo, interleaved, inverse)
    assert got.dtype == x.dtype and got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got.float(), exact, **tolerance(x.dtype))
    rd = 2 * cos.shape[1]
    untouched = torch.ones(x.shape[-1], dtype=torch.bool)
    untouched[lo : lo + rd] = False
    assert torch.equal(got[..., untouched], x[..., untouched])


def test_reference_is_the_complex_rotation():
    """The torch reference against a float64 restatement: each pair a complex number times
    `cos + i sin` (DeepSeek's `apply_rotary_emb`), NeoX halves as `(x[k], x[k + R/2])`."""
    for interleaved in (True, False):
        for inverse in (False, True):
            x, cos, sin, lo = make_case(6, 3, 48, 16, "tail", torch.float32, seed=1)
            rot = x[..., lo:].double()
            if interleaved:
                pairs = torch.view_as_complex(rot.unflatten(-1, (8, 2)).contiguous())
            else:
                pairs = torch.complex(rot[..., :8], rot[..., 8:])
            turn = torch.complex(cos.double(), -sin.double() if inverse else sin.double())
            turned = pairs * turn[:, None]
            parts = torch.view_as_real(turned)
            rotated = parts.flatten(-2) if interleaved else parts.transpose(-1, -2).flatten(-2)
            expected = torch.cat((x[..., :lo].double(), rotated), dim=-1)
            got = rotary_reference(x, cos, sin, lo, interleaved, inverse)
            torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-5)


def test_inverse_undoes_the_rotation():
    x, cos, sin, lo = make_case(9, 2, 64, 32, "tail", torch.float32, seed=2)
    there = rotary_reference(x, cos / 1.1, sin / 1.1, lo, True, False)
    back = rotary_reference(there, cos / 1.1, sin / 1.1, lo, True, True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


# the C++ kernel ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernels():
    if not cpu_extension.load(default_cache_dir()):
        pytest.skip("the C++ CPU kernels cannot be built here")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("inverse", [False, True])
def test_cpu_kernel_matches_reference(kernels, shape, dtype, interleaved, inverse):
    x, cos, sin, lo = make_case(*shape, dtype, seed=shape[0] + shape[2])
    with torch.no_grad():
        got = torch.ops.nextn_cpu.rotary(x, cos, sin, lo, interleaved, inverse)
    assert_matches(got, x, cos, sin, lo, interleaved, inverse)


def test_cpu_kernel_of_non_contiguous_rows_and_its_checks(kernels):
    x, cos, sin, lo = make_case(6, 4, 32, 16, "tail", torch.float32, seed=4)
    wide = torch.randn(6, 4, 64)
    wide[..., ::2] = x
    got = torch.ops.nextn_cpu.rotary(wide[..., ::2], cos, sin, lo, True, False)
    assert_matches(got, x, cos, sin, lo, True, False)
    for bad in (
        (x, cos[:-1], sin[:-1], lo),  # another token count
        (x, cos, sin[:, :-1], lo),  # cos and sin disagree
        (x, cos, sin, lo + 1),  # the slice runs past the row
        (x, cos.double(), sin.double(), lo),
    ):
        with pytest.raises(RuntimeError, match="rotary"):
            torch.ops.nextn_cpu.rotary(*bad, True, False)


# fakes and compiled graphs -------------------------------------------------------------


def fake_output(op, args):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        return op(*fake_args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fakes_give_the_real_shapes_and_dtypes(kernels, dtype):
    x, cos, sin, lo = make_case(5, 3, 64, 16, "tail", dtype)
    args = (x, cos, sin, lo, True, True)
    for op in (torch.ops.nextn_cpu.rotary.default, rotary_op):
        real, fake = op(*args), fake_output(op, args)
        assert (fake.shape, fake.dtype) == (real.shape, real.dtype) and fake.is_contiguous()
    torch.library.opcheck(rotary_op, args, test_utils=("test_schema", "test_faketensor"))


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


def test_compiled_layer_rotation_is_one_node(kernels, monkeypatch):
    """`RotaryEmbedding.apply` as a captured step traces it: one `nextn_cpu::rotary` node
    per call, the eager steps' values; without the kernels, the torch form."""
    from runtime.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(16, {"rope_theta": 10000.0}, interleaved=True, rotate_tail=True)
    x = torch.randn(3, 4, 64)
    cos, sin = rope.cos_sin(torch.tensor([0, 7, 4000]))

    def step(x, cos, sin):
        return rope.apply(rope.apply(x, cos, sin), cos, sin, inverse=True)

    assert traced_targets(step, x, cos, sin) == ["nextn_cpu.rotary"] * 2
    with torch.no_grad():
        compiled = torch.compile(step, backend="eager")(x, cos, sin)
        assert torch.equal(compiled, step(x, cos, sin))
        assert_matches(rope.apply(x, cos, sin), x, cos, sin, 48, True, False)
    monkeypatch.setitem(cpu_extension._state, "available", False)
    targets = traced_targets(step, x, cos, sin)
    assert "nextn_cpu.rotary" not in targets and len(targets) > 10, targets


# the Triton kernel (interpreted on CPU, or on a GPU) -------------------------------------

TRITON_CASES = [
    (*shape, dtype, interleaved, inverse)
    for shape in SHAPES[:5]
    for dtype, interleaved, inverse in (
        (torch.float32, True, False),
        (torch.float32, False, True),
        (torch.bfloat16, True, True),
    )
]


def run_triton_cases(cases_path: str, out_path: str) -> None:
    """Child process: each case through the Triton kernel (on the GPU where there is one)."""
    from runtime.kernels.triton import rotary as triton_rotary

    device = "cuda" if torch.cuda.is_available() else "cpu"
    outputs = []
    for x, cos, sin, lo, interleaved, inverse in torch.load(cases_path):
        got = triton_rotary.rotary(
            x.to(device), cos.to(device), sin.to(device), lo, interleaved, inverse
        )
        outputs.append(got.cpu())
    torch.save(outputs, out_path)


def triton_case(index):
    *shape, dtype, interleaved, inverse = TRITON_CASES[index]
    x, cos, sin, lo = make_case(*shape, dtype, seed=index)
    return x, cos, sin, lo, interleaved, inverse


@pytest.fixture(scope="module")
def triton_outputs(tmp_path_factory):
    pytest.importorskip("triton")
    folder = tmp_path_factory.mktemp("triton_rotary")
    torch.save([triton_case(i) for i in range(len(TRITON_CASES))], folder / "cases.pt")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "tests.unit.test_rotary_op"]
    cmd += [str(folder / "cases.pt"), str(folder / "out.pt")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(folder / "out.pt")


@pytest.mark.parametrize("index", range(len(TRITON_CASES)), ids=[str(c) for c in TRITON_CASES])
def test_triton_kernel_matches_reference(triton_outputs, index):
    assert_matches(triton_outputs[index], *triton_case(index))


@pytest.mark.gpu
def test_custom_op_on_cuda_takes_the_triton_kernel():
    x, cos, sin, lo = make_case(17, 4, 64, 16, "tail", torch.bfloat16, seed=3)
    with torch.no_grad():
        got = rotary(x.cuda(), cos.cuda(), sin.cuda(), lo, True, True)
    assert_matches(got.cpu(), x, cos, sin, lo, True, True)


if __name__ == "__main__":
    run_triton_cases(*sys.argv[1:])
