# SPDX-License-Identifier: Apache-2.0
"""`nextn_cpu::rms_norm` (one-pass RMSNorm of fp32 rows for eager CPU steps) against the
torch form: row widths with and without a vector tail, one to three dims, no rows, with and
without a weight, non-contiguous input, large and tiny magnitudes; and the norm modules,
which take it eagerly without grad and keep the torch form (and its backward) with grad."""

from __future__ import annotations

import pytest
import torch

from runtime.configs.capture import default_cache_dir
from runtime.kernels import cpu_extension
from runtime.kernels.rms_norm import rms_norm, rms_norm_reference, uses_kernel
from runtime.layers.norm import RMSNorm, WeightlessRMSNorm


@pytest.fixture(scope="module", autouse=True)
def loaded():
    if not cpu_extension.load(default_cache_dir()):
        pytest.skip("the C++ CPU kernels cannot be built here")


@pytest.mark.parametrize("shape", [(5, 1), (9, 7), (33, 16), (40, 33), (3, 4, 64), (2, 3, 5, 256)])
@pytest.mark.parametrize("weighted", [False, True])
def test_kernel_matches_torch_form(shape, weighted):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 4
    weight = torch.rand(shape[-1], generator=g) + 0.5 if weighted else None
    got = rms_norm(x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, rms_norm_reference(x, weight, 1e-6), rtol=1e-6, atol=1e-7)


def test_kernel_with_no_rows_and_non_contiguous_rows():
    assert rms_norm(torch.empty(0, 8), None, 1e-6).shape == (0, 8)
    wide = torch.randn(12, 40)
    x = wide[:, ::2]  # rows of 20 values, stride 2
    assert not x.is_contiguous()
    weight = torch.rand(20) + 0.5
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5), rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("magnitude", [1e-18, 1e-3, 1e15])
def test_kernel_at_extreme_magnitudes(magnitude):
    """eps dominates tiny rows and the squares of large rows stay finite in fp32 (1e15^2 =
    1e30 < 3.4e38): the kernel agrees with the torch form at every scale."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * magnitude
    torch.testing.assert_close(
        rms_norm(x, None, 1e-6), rms_norm_reference(x, None, 1e-6), rtol=1e-6, atol=0.0
    )


def test_kernel_refuses_other_dtypes_and_weight_shapes():
    with pytest.raises(RuntimeError, match="fp32 x"):
        torch.ops.nextn_cpu.rms_norm(torch.randn(3, 4).bfloat16(), None, 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.nextn_cpu.rms_norm(torch.randn(3, 4), torch.ones(5), 1e-6)


def test_modules_use_the_kernel_only_without_grad():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 4, 32, generator=g)
    norm, weightless = RMSNorm(32, 1e-6), WeightlessRMSNorm(1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32, generator=g) + 0.5)
    with torch.inference_mode():
        assert uses_kernel(x)
        torch.testing.assert_close(norm(x), rms_norm_reference(x, norm.weight, 1e-6))
        torch.testing.assert_close(weightless(x), rms_norm_reference(x, None, 1e-6))
        assert not uses_kernel(x.bfloat16())
    leaf = x.clone().requires_grad_(True)
    assert not uses_kernel(leaf)
    norm(leaf).sum().backward()  # the torch form, which has a backward
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0
