# SPDX-License-Identifier: Apache-2.0
"""`nextn_cpu::tile_attention` (eager prefill's attention of a tile of rows over the tile's
shared keys, every head in one GEMM per tile) against plain softmax attention over each
row's valid keys and against PyTorch's flash kernel, which it replaces on CPU: head sizes
with and without a full vector of lanes, key counts across a block of 16, rows that see no
key (zeros and `lse = -inf`), short tiles padded with row T, scores large enough to need
the shift, both GEMM libraries; and the dispatch (`tile_keys_attention`) keeping the flash
kernel for bf16 and wherever a grad is wanted."""

from __future__ import annotations

import pytest
import torch

from runtime.configs.capture import default_cache_dir
from runtime.kernels import cpu_extension
from runtime.kernels.sink_attention import (
    TileKeys,
    sink_attention,
    tile_keys_attention,
    tiled_sink_attention,
)


@pytest.fixture(scope="module", autouse=True)
def loaded():
    if not cpu_extension.load(default_cache_dir()):
        pytest.skip("the C++ CPU kernels cannot be built here")


def case(tiles, lanes, heads, dim, keys, seed=0, spread=3.0, short=2):
    """Tiles of `lanes` rows over `tiles * lanes - short` rows (the last tile padded with
    row T); row 1 sees none of its tile's keys."""
    g = torch.Generator().manual_seed(seed)
    num_rows = tiles * lanes - short
    q = torch.randn(num_rows, heads, dim, generator=g) * spread
    kv = torch.randn(tiles, keys, dim, generator=g)
    valid = torch.rand(tiles, lanes, keys, generator=g) < 0.7
    if lanes > 1:
        valid[0, 1] = False
    tile_rows = torch.arange(tiles * lanes).view(tiles, lanes).clamp(max=num_rows)
    return q, tile_rows, kv, valid


def expected(q, tile_rows, kv, valid, scale):
    """Each lane's softmax attention over its valid keys, by definition: ([N, R, H, D],
    [N, R, H]), zeros and -inf for a lane that sees no key."""
    padded = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[tile_rows]  # [N, R, H, D]
    scores = torch.einsum("nrhd,nkd->nrhk", padded.double(), kv.double()) * scale
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    out = torch.einsum("nrhk,nkd->nrhd", probs, kv.double())
    return out.float(), lse.float()


@pytest.mark.parametrize("dim", [8, 16, 24, 64])
@pytest.mark.parametrize("keys", [1, 15, 16, 17, 40])
@pytest.mark.parametrize("onednn", [False, True])
def test_kernel_matches_the_definition(dim, keys, onednn):
    q, tile_rows, kv, valid = case(4, 5, 3, dim, keys, seed=dim * 100 + keys)
    out, lse = torch.ops.nextn_cpu.tile_attention(q, tile_rows, kv, valid, 0.2, onednn)
    want_out, want_lse = expected(q, tile_rows, kv, valid, 0.2)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    seen = valid.any(-1)  # [N, R]
    torch.testing.assert_close(lse[seen], want_lse[seen], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(lse[~seen]).all()
    assert not out[~seen].any()


def test_kernel_equals_the_flash_kernel_at_prefill_shapes():
    """The default model's shapes: tiles of 32 rows, 8 heads of 64, 159 window keys."""
    q, tile_rows, kv, valid = case(6, 32, 8, 64, 159, seed=1, spread=1.0, short=5)
    out, lse = torch.ops.nextn_cpu.tile_attention(q, tile_rows, kv, valid, 0.125, True)
    padded = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[tile_rows]
    bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf")).unsqueeze(1)
    shared = kv.unsqueeze(1).expand(-1, 8, -1, -1)
    flash_out, flash_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        padded.transpose(1, 2), shared, shared, attn_mask=bias, scale=0.125
    )
    seen = valid.any(-1)
    torch.testing.assert_close(out[seen], flash_out.transpose(1, 2)[seen], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[seen], flash_lse.transpose(1, 2)[seen], rtol=1e-5, atol=1e-5)


def test_kernel_shifts_large_scores():
    q, tile_rows, kv, valid = case(2, 4, 2, 16, 20, seed=3, spread=60.0)
    out, lse = torch.ops.nextn_cpu.tile_attention(q, tile_rows, kv, valid, 1.0, False)
    want_out, want_lse = expected(q, tile_rows, kv, valid, 1.0)
    assert torch.isfinite(out).all()
    seen = valid.any(-1)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse[seen], want_lse[seen], rtol=1e-5, atol=1e-4)


def test_kernel_refuses_lanes_outside_the_rows():
    q, tile_rows, kv, valid = case(2, 4, 2, 16, 8)
    tile_rows[1, 0] = q.shape[0] + 1
    with pytest.raises(RuntimeError, match="tile_rows"):
        torch.ops.nextn_cpu.tile_attention(q, tile_rows, kv, valid, 0.2, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_dispatch_gives_each_row_its_tile_attention(dtype, grad):
    """`tile_keys_attention` (the kernel for fp32 without grad, PyTorch's flash kernel
    otherwise) and `tiled_sink_attention` through it, against sink attention over each
    row's tile keys."""
    q, tile_rows, kv, valid = case(3, 4, 2, 16, 9, seed=5, spread=1.0)
    q, kv = q.to(dtype), kv.to(dtype)
    num_rows = q.shape[0]
    row_slot = torch.arange(num_rows)
    keys = TileKeys(tile_rows, row_slot, kv, valid)
    sink = torch.randn(2, generator=torch.Generator().manual_seed(6))
    with torch.set_grad_enabled(grad):
        out, lse = tile_keys_attention(q, keys, 0.3)
        attended = tiled_sink_attention(q, keys, sink, 0.3)
    want_out, want_lse = expected(q.float(), tile_rows, kv.float(), valid, 0.3)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    lanes = want_out.flatten(0, 1)[row_slot]
    torch.testing.assert_close(out.float(), lanes, **tol)
    seen = valid.flatten(0, 1)[row_slot].any(-1)
    torch.testing.assert_close(lse[seen].float(), want_lse.flatten(0, 1)[row_slot][seen], **tol)
    assert torch.isneginf(lse[~seen]).all()
    tile_of, lane_of = row_slot // 4, row_slot % 4
    plain = sink_attention(q, kv[tile_of], valid[tile_of, lane_of], sink, 0.3)
    torch.testing.assert_close(attended.float(), plain.float(), **tol)
