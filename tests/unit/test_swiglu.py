# SPDX-License-Identifier: Apache-2.0
"""`nextn_cpu::swiglu` (the clamped SwiGLU of fp32 rows in one pass, eager and captured)
against the torch form: with and without DeepSeek-V4's clamp, widths with and without a
vector tail, the gate and up halves of one `[P, 2I]` product (strided rows), no rows,
values far past the clamp and exp's range, NaN passing through; and the dispatch, which
keeps the torch form with grad, for bf16 and for more than two dims."""

from __future__ import annotations

import pytest
import torch

from runtime.configs.capture import default_cache_dir
from runtime.kernels import cpu_extension
from runtime.kernels.swiglu import swiglu, swiglu_reference, uses_kernel


@pytest.fixture(scope="module", autouse=True)
def loaded():
    if not cpu_extension.load(default_cache_dir()):
        pytest.skip("the C++ CPU kernels cannot be built here")


def halves(rows, width, seed=0, spread=8.0):
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(seed))
    return (gate_up * spread).split(width, dim=-1)


@pytest.mark.parametrize("width", [1, 15, 16, 17, 128, 200])
@pytest.mark.parametrize("limit", [None, 7.0])
def test_kernel_matches_torch_form(width, limit):
    gate, up = halves(50, width, seed=width)
    assert gate.stride(0) == 2 * width  # rows of the halves are strided
    with torch.inference_mode():
        assert uses_kernel(gate, up)
        got = swiglu(gate, up, limit)
    torch.testing.assert_close(got, swiglu_reference(gate, up, limit), rtol=1e-6, atol=1e-6)


def test_kernel_at_extremes_and_nan():
    """Gates far below exp's range give silu -> -0 within fp32's resolution, far above
    give the gate itself; the clamp bounds both; NaN passes through the clamps as in torch."""
    gate, up = halves(4, 40, seed=1)
    gate, up = gate.clone(), up.clone()
    gate[0, :5] = torch.tensor([-1e4, -120.0, 95.0, 1e4, float("nan")])
    up[1, :3] = torch.tensor([float("nan"), 1e6, -1e6])
    for limit in (None, 10.0):
        with torch.inference_mode():
            got = swiglu(gate, up, limit)
        expected = swiglu_reference(gate, up, limit)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, equal_nan=True)
        assert got[0, 4].isnan() and got[1, 0].isnan()


def test_no_rows_and_refusals():
    gate, up = halves(0, 8)
    with torch.inference_mode():
        assert swiglu(gate, up, 3.0).shape == (0, 8)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.nextn_cpu.swiglu(torch.ones(2, 3).bfloat16(), torch.ones(2, 3).bfloat16(), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.nextn_cpu.swiglu(torch.ones(3, 2).t(), torch.ones(3, 2).t(), None)


def test_dispatch_keeps_the_torch_form_elsewhere():
    gate, up = halves(6, 16)
    leaf = gate.clone().requires_grad_(True)
    assert not uses_kernel(leaf, up)
    swiglu(leaf, up, 5.0).sum().backward()  # the torch form, which has a backward
    assert leaf.grad is not None
    with torch.inference_mode():
        assert not uses_kernel(gate.bfloat16(), up.bfloat16())
        assert uses_kernel(gate.unsqueeze(1), up.unsqueeze(1))  # leading dims flattened
        torch.testing.assert_close(
            swiglu(gate.unsqueeze(1), up.unsqueeze(1), 5.0).squeeze(1), swiglu(gate, up, 5.0)
        )
