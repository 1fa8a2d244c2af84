# SPDX-License-Identifier: Apache-2.0
"""Products with quantized weights: the references against the test's own dequantization
of the formats, the C++ kernels against the references, and the custom ops' fakes."""

from __future__ import annotations

import pytest
import torch

from runtime.kernels import cpu_extension
from runtime.kernels import quantized_product as qp

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def fp8_weight(codes, scale, b0, b1):
    """The format restated elementwise: W[n, k] = float(codes[n, k]) * scale[n // b0, k // b1]."""
    n, k = codes.shape
    rows = torch.arange(n) // b0
    cols = torch.arange(k) // b1
    return codes.float() * scale[rows][:, cols]


def mxfp4_weight(codes, scale):
    """Low nibble first; bit 3 the sign; scale byte e is 2^(e - 127) per 32 values."""
    n, half = codes.shape
    out = torch.empty(n, 2 * half)
    for i in range(n):
        for j in range(2 * half):
            nibble = (int(codes[i, j // 2]) >> (4 * (j % 2))) & 0xF
            value = E2M1[nibble & 7] * (-1 if nibble & 8 else 1)
            out[i, j] = value * 2.0 ** (int(scale[i, j // 32]) - 127)
    return out


def random_fp8(n, k, b0, b1, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.exp2(torch.randint(-8, 2, (-(-n // b0), -(-k // b1)), generator=g).float())
    return codes, scale


def random_mxfp4(g_, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (g_, n, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(118, 132, (g_, n, k // 32), generator=g, dtype=torch.uint8)
    return codes, scale


@pytest.fixture(scope="module")
def kernels():
    if not cpu_extension.load():
        pytest.skip("the C++ CPU kernels cannot be built here")


# (rows, out, in, b0, b1): few rows with blocks of 16 columns or more (decoded in registers),
# narrower blocks or ragged widths (decoded into a buffer), many rows (panels and a GEMM)
SHAPES = [
    (1, 40, 256, 128, 128),
    (8, 17, 128, 1, 32),
    (1, 40, 96, 8, 8),
    (4, 33, 70, 128, 32),
    (19, 130, 256, 128, 128),
    (3, 16, 24, 1, 8),
]


@pytest.mark.parametrize("m, n, k, b0, b1", SHAPES)
def test_fp8_reference_is_the_format(m, n, k, b0, b1):
    codes, scale = random_fp8(n, k, b0, b1)
    x = torch.randn(m, k)
    expected = x.double() @ fp8_weight(codes, scale, b0, b1).double().T
    got = qp.fp8_block_linear_reference(x, codes, scale, [b0, b1])
    torch.testing.assert_close(got.double(), expected, atol=1e-3, rtol=1e-5)


def test_mxfp4_reference_is_the_format():
    codes, scale = random_mxfp4(1, 6, 64)
    torch.testing.assert_close(
        qp.dequant_mxfp4(codes[0], scale[0], torch.float32), mxfp4_weight(codes[0], scale[0])
    )


@pytest.mark.parametrize("m, n, k, b0, b1", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kernel_matches_reference(kernels, m, n, k, b0, b1, dtype):
    codes, scale = random_fp8(n, k, b0, b1, seed=m)
    x = torch.randn(m, k).to(dtype)
    got = torch.ops.nextn_cpu.fp8_block_linear(x, codes, scale, b0, b1)
    # the kernel multiplies the exact fp32 weight; compare with the fp32 reference product
    expected = qp.fp8_block_linear_reference(x.float(), codes, scale, [b0, b1]).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, atol=tol * expected.abs().max().item(), rtol=tol)
    with torch.no_grad():  # what layers call is the kernel on CPU (it has no backward)
        assert torch.equal(qp.fp8_linear(x, codes, scale, [b0, b1]), got)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("rows", [5, 40])
def test_grouped_kernel_matches_reference(kernels, fmt, rows):
    groups, n, k = 4, 24, 64
    if fmt == "fp8":
        codes = torch.stack([random_fp8(n, k, 1, 16, seed=g)[0] for g in range(groups)])
        scale = torch.stack([random_fp8(n, k, 1, 16, seed=g)[1] for g in range(groups)])
        block_k = 16
    else:
        (codes, scale), block_k = random_mxfp4(groups, n, k), 32
    x = torch.randn(rows, k)
    ends = torch.tensor([2, 2, rows - 1, rows], dtype=torch.int32)  # an empty group too
    expected = qp.quantized_grouped_reference(x, codes, scale, ends, fmt, block_k)
    got = torch.ops.nextn_cpu.quantized_grouped_product(x, codes, scale, ends, fmt, block_k)
    torch.testing.assert_close(got, expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-4)


def test_batched_fp8_kernel_matches_reference(kernels):
    """Grouped projections (V4's `wo_a`): x [G, M, K] with codes [G, N, K]."""
    pairs = [random_fp8(12, 40, 1, 8, seed=g) for g in range(3)]
    codes, scale = torch.stack([c for c, _ in pairs]), torch.stack([s for _, s in pairs])
    x = torch.randn(3, 2, 40)
    expected = qp.fp8_block_linear_reference(x, codes, scale, [1, 8])
    with torch.no_grad():
        got = qp.fp8_linear(x, codes, scale, [1, 8])
    torch.testing.assert_close(got, expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-4)


def test_ops_have_fakes():
    """Each product is one opaque operator whose fake gives the output's shape."""
    codes, scale = random_fp8(12, 32, 1, 16)
    x = torch.randn(3, 32)
    torch.library.opcheck(
        qp.fp8_block_linear, (x, codes, scale, [1, 16]), test_utils=("test_faketensor",)
    )
    mx_codes, mx_scale = random_mxfp4(2, 12, 32)
    ends = torch.tensor([1, 3], dtype=torch.int32)
    torch.library.opcheck(
        qp.quantized_grouped_product,
        (x, mx_codes, mx_scale, ends, "mxfp4", 32),
        test_utils=("test_faketensor",),
    )


def test_kernels_have_fakes(kernels):
    codes, scale = random_fp8(12, 32, 1, 16)
    torch.library.opcheck(
        torch.ops.nextn_cpu.fp8_block_linear.default,
        (torch.randn(3, 32), codes, scale, 1, 16),
        test_utils=("test_faketensor",),
    )
    mx_codes, mx_scale = random_mxfp4(2, 12, 32)
    torch.library.opcheck(
        torch.ops.nextn_cpu.quantized_grouped_product.default,
        (
            torch.randn(3, 32),
            mx_codes,
            mx_scale,
            torch.tensor([1, 3], dtype=torch.int32),
            "mxfp4",
            32,
        ),
        test_utils=("test_faketensor",),
    )


TRITON_CHECK = """
import torch
from runtime.kernels import quantized_product as qp, quantized_triton as qt
g = torch.Generator().manual_seed(1)
for m, n, k, b0, b1 in [(1, 40, 96, 8, 8), (5, 33, 70, 128, 32), (17, 16, 64, 1, 16)]:
    raw = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # no NaN codes (refused at load)
    codes = raw.view(torch.float8_e4m3fn)
    scale = torch.exp2(torch.randint(-8, 2, (-(-n // b0), -(-k // b1)), generator=g).float())
    x = torch.randn(m, k, generator=g)
    ref = qp.fp8_block_linear_reference(x, codes, scale, [b0, b1])
    got = qt.fp8_block_linear_triton(x, codes, scale, [b0, b1])
    torch.testing.assert_close(got, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)
print("ok")
"""


def test_triton_fp8_kernel_matches_reference_interpreted():
    """Every e4m3 code (subnormals, signed zeros) through the Triton kernel, run by Triton's
    CPU interpreter in a fresh process (TRITON_INTERPRET is read when kernels are built)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
