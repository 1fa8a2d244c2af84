# SPDX-License-Identifier: Apache-2.0
"""`nextn_cpu::merge_row_keys` (DeepSeek-V4 CSA in eager prefill: each row's own selected
keys merged into its tile attention, read from the cache where they lie) against its torch
reference, and both against plain sink attention over the concatenated keys: head sizes
with and without the vector kernels' register layout, key counts across a block of 16 and
none at all, rows with no valid own key, rows that saw no tile key (`lse = -inf`), scores
large enough to need the shift, fp32 and bf16 caches, and through `tiled_sink_attention`
with the keys given as cache rows."""

from __future__ import annotations

import pytest
import torch

from runtime.configs.capture import default_cache_dir
from runtime.kernels import cpu_extension
from runtime.kernels.sink_attention import (
    TileKeys,
    merge_row_keys,
    merge_row_keys_reference,
    sink_attention,
    tiled_sink_attention,
    tiled_sink_attention_bmm,
    tiled_sink_attention_flash,
)


@pytest.fixture(scope="module", autouse=True)
def loaded():
    if not cpu_extension.load(default_cache_dir()):
        pytest.skip("the C++ CPU kernels cannot be built here")


def case(rows, heads, dim, own, cache_rows, dtype=torch.float32, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, dim, generator=g) * spread
    source = torch.randn(cache_rows, dim, generator=g).to(dtype)
    index = torch.randint(0, cache_rows, (rows, own), generator=g)
    valid = torch.rand(rows, own, generator=g) < 0.7
    tile_out = torch.randn(rows, heads, dim, generator=g)
    tile_lse = torch.randn(rows, heads, generator=g) * 4
    if rows > 2:
        valid[1] = False  # no own key: the tile's result and the sink alone
        tile_lse[2] = float("-inf")  # no tile key: the own keys and the sink alone
    sink = torch.randn(heads, generator=g)
    return tile_out, tile_lse, q, source, index, valid, sink


@pytest.mark.parametrize("dim", [8, 16, 24, 64, 128])
@pytest.mark.parametrize("own", [0, 1, 5, 16, 17, 32])
def test_kernel_matches_reference(dim, own):
    args = case(70, 3, dim, own, 500, seed=dim + own)
    got = torch.ops.nextn_cpu.merge_row_keys(*args, 0.2)
    torch.testing.assert_close(got, merge_row_keys_reference(*args, 0.2), rtol=1e-5, atol=1e-5)


def test_kernel_with_bf16_cache_widens_exactly():
    """A bf16 cache is widened to fp32 (exact), so the result equals the fp32 reference on
    the widened cache."""
    tile_out, tile_lse, q, source, index, valid, sink = case(40, 8, 64, 32, 300, torch.bfloat16)
    got = torch.ops.nextn_cpu.merge_row_keys(
        tile_out, tile_lse, q, source, index, valid, sink, 0.125
    )
    widened = (tile_out, tile_lse, q, source.float(), index, valid, sink)
    torch.testing.assert_close(got, merge_row_keys_reference(*widened, 0.125), rtol=1e-5, atol=1e-5)


def test_kernel_equals_sink_attention_over_all_keys():
    """The merge is sink attention over [tile keys | own keys]: with the tile part computed
    by the reference on the tile keys alone (its output and log-sum-exp), the merged result
    equals `sink_attention` over the concatenation."""
    g = torch.Generator().manual_seed(7)
    rows, heads, dim, tile_width, own = 30, 4, 64, 9, 20
    q = torch.randn(rows, heads, dim, generator=g)
    tile_kv = torch.randn(rows, tile_width, dim, generator=g)
    tile_valid = torch.rand(rows, tile_width, generator=g) < 0.6
    tile_valid[3] = False
    source = torch.randn(200, dim, generator=g)
    index = torch.randint(0, 200, (rows, own), generator=g)
    valid = torch.rand(rows, own, generator=g) < 0.5
    sink = torch.randn(heads, generator=g)
    scores = torch.einsum("thd,tkd->thk", q, tile_kv) * 0.125
    scores = scores.masked_fill(~tile_valid.unsqueeze(1), float("-inf"))
    tile_lse = torch.logsumexp(scores, -1)
    tile_out = torch.einsum("thk,tkd->thd", torch.softmax(scores, -1).nan_to_num(0.0), tile_kv)
    got = merge_row_keys(tile_out, tile_lse, q, source, index, valid, sink, 0.125)
    keys = torch.cat([tile_kv, source[index]], 1)
    expected = sink_attention(q, keys, torch.cat([tile_valid, valid], 1), sink, 0.125)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_kernel_shifts_large_scores():
    """Scores far beyond exp's range (a query of norm ~1e3): the shift by the largest score
    keeps the result finite and equal to the reference."""
    args = case(20, 2, 64, 16, 50, spread=300.0, seed=3)
    got = torch.ops.nextn_cpu.merge_row_keys(*args, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, merge_row_keys_reference(*args, 1.0), rtol=1e-5, atol=1e-4)


def test_kernel_refuses_rows_outside_the_cache():
    tile_out, tile_lse, q, source, index, valid, sink = case(5, 2, 16, 4, 10)
    index[3, 2] = 10
    valid[3, 2] = False  # masked entries are checked too: the kernel reads no row it cannot
    with pytest.raises(RuntimeError, match="index out of the source's rows"):
        torch.ops.nextn_cpu.merge_row_keys(tile_out, tile_lse, q, source, index, valid, sink, 1.0)


def test_dispatch_uses_the_reference_with_grad():
    """The kernel has no backward: with grad enabled the torch form runs (and propagates
    gradients to the queries)."""
    tile_out, tile_lse, q, source, index, valid, sink = case(6, 2, 16, 4, 10)
    q.requires_grad_(True)
    with torch.enable_grad():
        out = merge_row_keys(tile_out, tile_lse, q, source, index, valid, sink, 0.5)
        out.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


@pytest.mark.parametrize("kernel", [tiled_sink_attention_flash, tiled_sink_attention_bmm])
def test_tiled_attention_with_keys_as_cache_rows(kernel):
    """`TileKeys` with the own keys as rows of a cache (`row_source[row_index]`, as the CSA
    layer passes them) gives the same result as with the gathered copy, through both
    implementations and the dispatcher."""
    g = torch.Generator().manual_seed(1)
    num_rows, heads, dim, tile_width, own = 7, 2, 64, 5, 17
    tile_rows = torch.tensor([[0, 1, 2], [3, 4, 7], [5, 6, 7]])
    row_slot = torch.tensor([0, 1, 2, 3, 4, 6, 7])
    q = torch.randn(num_rows, heads, dim, generator=g)
    tile_kv = torch.randn(3, tile_width, dim, generator=g)
    tile_valid = torch.rand(3, 3, tile_width, generator=g) > 0.3
    tile_valid[1, 1] = False
    source = torch.randn(40, dim, generator=g)
    row_index = torch.randint(0, 40, (num_rows, own), generator=g)
    row_valid = torch.rand(num_rows, own, generator=g) > 0.3
    sink = torch.randn(heads, generator=g)
    as_rows = TileKeys(
        tile_rows,
        row_slot,
        tile_kv,
        tile_valid,
        row_valid=row_valid,
        row_source=source,
        row_index=row_index,
    )
    gathered = TileKeys(tile_rows, row_slot, tile_kv, tile_valid, source[row_index], row_valid)
    tile_of, lane_of = row_slot // 3, row_slot % 3
    keys = torch.cat([tile_kv[tile_of], source[row_index]], 1)
    valid = torch.cat([tile_valid[tile_of, lane_of], row_valid], 1)
    expected = sink_attention(q, keys, valid, sink, scale=0.3)
    for tiled in (as_rows, gathered):
        torch.testing.assert_close(kernel(q, tiled, sink, 0.3), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        tiled_sink_attention(q, as_rows, sink, 0.3), expected, rtol=1e-5, atol=1e-5
    )
