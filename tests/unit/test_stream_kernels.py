# SPDX-License-Identifier: Apache-2.0
"""mHC's eager-prefill kernels (`nextn_cpu::hc_post`, `nextn_cpu::sinkhorn`) against their
torch references: the stream expansion over token counts across the kernel's blocks, one
to four streams, hidden sizes with and without a vector tail, fp32 and bf16 streams and
non-contiguous inputs; Sinkhorn over matrix counts across its blocks of 16, sizes 1 to 4,
one and twenty iterations and logits large enough to need the softmax's shift; both
through the layer functions a model calls, against transformers' hyper-connection."""

from __future__ import annotations

import pytest
import torch

from runtime.configs.capture import default_cache_dir
from runtime.kernels import cpu_extension
from runtime.kernels import sinkhorn as sinkhorn_module
from runtime.kernels.stream_expand import expand_streams, expand_streams_reference


@pytest.fixture(scope="module", autouse=True)
def loaded():
    if not cpu_extension.load(default_cache_dir()):
        pytest.skip("the C++ CPU kernels cannot be built here")


def streams(tokens, hc, hidden, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    block = torch.randn(tokens, hidden, generator=g).to(dtype)
    residual = torch.randn(tokens, hc, hidden, generator=g).to(dtype)
    post = 2 * torch.rand(tokens, hc, generator=g)
    comb = torch.rand(tokens, hc, hc, generator=g)
    return block, residual, post, comb


@pytest.mark.parametrize("tokens", [0, 1, 17, 300])
@pytest.mark.parametrize("hc", [1, 2, 4])
@pytest.mark.parametrize("hidden", [1, 7, 256])
def test_expansion_matches_reference_fp32(tokens, hc, hidden):
    args = streams(tokens, hc, hidden, torch.float32, seed=tokens + hc + hidden)
    torch.testing.assert_close(
        expand_streams(*args), expand_streams_reference(*args), rtol=1e-6, atol=1e-6
    )


def test_expansion_in_bf16_rounds_once():
    """bf16 streams: products and sums in fp32, one rounding at the end, so the result is
    the fp32 reference rounded (within one bf16 step of it)."""
    block, residual, post, comb = streams(64, 4, 96, torch.bfloat16, seed=3)
    got = expand_streams(block, residual, post, comb)
    assert got.dtype == torch.bfloat16
    exact = expand_streams_reference(block.float(), residual.float(), post, comb)
    torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-6)


def test_expansion_of_non_contiguous_inputs():
    block, residual, post, comb = streams(40, 4, 32, torch.float32, seed=5)
    wide = torch.randn(40, 4, 64)
    wide[..., ::2] = residual
    views = (block.t().contiguous().t(), wide[..., ::2], post.t().contiguous().t(), comb.mT.mT)
    assert not views[1].is_contiguous()
    torch.testing.assert_close(
        expand_streams(*views), expand_streams_reference(block, residual, post, comb)
    )


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 2048])
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("iters", [1, 20])
def test_sinkhorn_kernel_matches_reference(rows, n, iters):
    g = torch.Generator().manual_seed(rows * n + iters)
    logits = torch.randn(rows, n, n, generator=g) * 30  # shifts of the softmax matter
    got = torch.ops.nextn_cpu.sinkhorn(logits, iters, 1e-6)
    expected = sinkhorn_module.sinkhorn_reference(logits, iters, 1e-6)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_sinkhorn_kernel_keeps_leading_shape():
    logits = torch.randn(3, 5, 4, 4)
    got = torch.ops.nextn_cpu.sinkhorn(logits, 20, 1e-6)
    assert got.shape == logits.shape
    torch.testing.assert_close(got, sinkhorn_module.sinkhorn_reference(logits, 20, 1e-6))


def test_eager_sinkhorn_takes_the_kernel_with_it_loaded_and_torch_without(monkeypatch):
    """With the kernels loaded, eager Sinkhorn of any size is the kernel (its torch paths
    are made to fail here); without, the torch paths, bit-identical to the reference."""
    logits = torch.randn(300, 4, 4)

    def unused(*args):
        raise AssertionError("a torch path ran with the kernel loaded")

    with torch.no_grad(), monkeypatch.context() as patched:
        patched.setattr(sinkhorn_module, "_sinkhorn_numpy", unused)
        patched.setattr(sinkhorn_module, "_sinkhorn_rows_last", unused)
        for rows in (5, 300):
            expected = sinkhorn_module.sinkhorn_reference(logits[:rows], 20, 1e-6)
            torch.testing.assert_close(sinkhorn_module.sinkhorn(logits[:rows], 20, 1e-6), expected)
    monkeypatch.setitem(cpu_extension._state, "available", False)
    with torch.no_grad():
        for rows in (5, 300):
            expected = sinkhorn_module.sinkhorn_reference(logits[:rows], 20, 1e-6)
            assert torch.equal(sinkhorn_module.sinkhorn(logits[:rows], 20, 1e-6), expected)


def test_expansion_rejects_mismatched_shapes():
    block, residual, post, comb = streams(8, 4, 16, torch.float32)
    for bad in ((block[:7], residual, post, comb), (block, residual, post.t(), comb)):
        with pytest.raises(RuntimeError, match="hc_post"):
            expand_streams(*bad)
    with pytest.raises(RuntimeError, match="hc_post"):
        expand_streams(block, residual, post, comb[:, :3])


def test_layer_expansion_of_other_dtypes_keeps_the_torch_form():
    """fp16 streams (no kernel for them) go through the torch form, not the kernel's
    dtype check."""
    from runtime.layers.hyper_connection import hc_post

    block, residual, post, comb = streams(8, 4, 16, torch.float16)
    got = hc_post(block, residual, post, comb)
    expected = expand_streams_reference(block.float(), residual.float(), post, comb)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)
