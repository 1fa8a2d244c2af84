# SPDX-License-Identifier: Apache-2.0
"""Request/token slot bookkeeping and the DeepSeek-V4 and Qwen4Exp cache addressing."""

from __future__ import annotations

import itertools

import pytest
import torch

from runtime.cache import PagedTokenAllocator, ReqToTokenPool, SlotTable
from runtime.cache.deepseek_v4_pool import DeepseekV4CacheLayout, DeepseekV4KVPool
from runtime.cache.pool_geometry import PoolGeometry
from runtime.cache.qwen4_exp_pool import Qwen4ExpCacheLayout

QWEN_LAYOUT = Qwen4ExpCacheLayout(
    layer_kinds=("linear", "attention"),
    ple_layers=(0,),
    num_kv_heads=1,
    head_dim=8,
    index_head_dim=4,
    conv_dim=6,
    conv_kernel=4,
    num_v_heads=2,
    head_k_dim=4,
    head_v_dim=4,
    hc_width=8,
    ple_conv_span=9,
    ngram_size=3,
    qsa_ratio=4,
)


def table(max_reqs=4, pages=10, page_size=4, context=64):
    return SlotTable(ReqToTokenPool(max_reqs, context), PagedTokenAllocator(pages, page_size))


def test_reserve_assigns_whole_pages_and_release_returns_them():
    t = table()
    start = t.allocator.available_tokens()
    req = t.open_request()
    assert t.reserve(req, 5)
    assert t.reserved_tokens(req) == 8 and t.allocator.available_tokens() == start - 8
    slots = t.slots(req, 0, 8)
    assert len(set(slots.tolist())) == 8
    assert (slots[:4] // 4).unique().numel() == 1 and (slots[4:] // 4).unique().numel() == 1
    assert (slots % 4).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]  # position p at offset p % page
    assert t.reserve(req, 8) and t.allocator.available_tokens() == start - 8  # nothing new needed
    t.release(req)
    assert t.allocator.available_tokens() == start and t.req_pool.available() == 4


def test_reserve_failure_takes_nothing_and_trim_frees_tail_pages():
    t = table(pages=3)
    req = t.open_request()
    assert t.reserve(req, 8)
    assert not t.reserve(req, 13)
    assert t.reserved_tokens(req) == 8 and t.allocator.available_pages() == 1
    t.trim(req, 3)
    assert t.reserved_tokens(req) == 4 and t.allocator.available_pages() == 2
    with pytest.raises(ValueError, match="exceed the context length"):
        t.reserve(req, 65)


def test_request_slots_run_out_cleanly():
    t = table(max_reqs=2)
    a, _ = t.open_request(), t.open_request()
    assert t.open_request() is None
    t.release(a)
    assert t.open_request() == a
    with pytest.raises(ValueError, match="not allocated"):
        t.req_pool.free(3)


@pytest.mark.parametrize("page_size", [1, 3, 4, 6, 16, 32])
def test_compressed_rows_are_unique_per_block_and_fit_the_pool(page_size):
    layout = DeepseekV4CacheLayout((0, 4, 16), head_dim=8, index_head_dim=4, sliding_window=8)
    pages = -(-64 // page_size) * 3
    geometry = PoolGeometry(
        max_reqs=3, num_pages=pages, page_size=page_size, max_tokens_per_pass=4, dtype=torch.float32
    )
    pool = DeepseekV4KVPool(layout, geometry)
    t = SlotTable(ReqToTokenPool(3, 64), PagedTokenAllocator(pages, page_size))
    reqs = [t.open_request() for _ in range(3)]
    for r in reqs:
        assert t.reserve(r, 64)
    for ratio in (4, 16):
        rows = []
        for r in reqs:
            starts = torch.arange(0, 64, ratio)
            rows += pool.compressed_loc(ratio, t.req_to_token[r, starts]).tolist()
        assert len(set(rows)) == len(rows)
        assert max(rows) < pool.compressed_kv[1 if ratio == 4 else 2].shape[0]


def test_rings_hold_window_plus_one_pass_without_collisions():
    layout = DeepseekV4CacheLayout((0, 4), head_dim=8, index_head_dim=4, sliding_window=8)
    geometry = PoolGeometry(
        max_reqs=2, num_pages=8, page_size=4, max_tokens_per_pass=4, dtype=torch.float32
    )
    pool = DeepseekV4KVPool(layout, geometry)
    assert pool.swa_ring == 12 and pool.state_ring(4) == 12
    req = torch.tensor([1])
    for last in range(40):
        # a verify pass writes last..last+3 while rows down to last-7 stay readable
        live = torch.arange(max(0, last - 7), last + 4)
        locs = pool.swa_loc(req.expand_as(live), live)
        assert locs.unique().numel() == live.numel()
        assert ((locs >= 12) & (locs < 24)).all()
    assert pool.nbytes() > 0 and "compress ratios [4]" in pool.describe()


def test_page_slots_cover_pages_in_order():
    alloc = PagedTokenAllocator(5, 3)
    pages = alloc.alloc_pages(2)
    assert alloc.page_slots(pages).tolist() == list(
        itertools.chain(*(range(p * 3, p * 3 + 3) for p in pages))
    )
    assert alloc.alloc_pages(4) is None and alloc.available_pages() == 3


@pytest.mark.parametrize("rows_per_req", [1, 4])
def test_uniform_metadata_numpy_equals_torch(rows_per_req):
    """The CPU fast path of the fixed-shape DeepSeek-V4 metadata builds the same tensors as
    the torch statement (used on other devices), padding request and trash rows included."""
    from runtime.cache.deepseek_v4_metadata import uniform_metadata, uniform_metadata_torch
    from runtime.core.forward_context import ForwardContext
    from runtime.core.forward_mode import ForwardMode
    from runtime.execution.capture_buffer import tensors_of

    layout = DeepseekV4CacheLayout((0, 4, 16), head_dim=8, index_head_dim=4, sliding_window=8)
    geometry = PoolGeometry(
        max_reqs=3, num_pages=48, page_size=4, max_tokens_per_pass=4, dtype=torch.float32
    )
    pool = DeepseekV4KVPool(layout, geometry)
    t = SlotTable(ReqToTokenPool(3, 64), PagedTokenAllocator(48, 4))
    reqs = [t.open_request() for _ in range(3)]
    for r in reqs:
        assert t.reserve(r, 60)
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        ctx = ForwardContext.build(
            mode,
            reqs + [t.req_pool.pad_req],
            [0, 17, 50, 0],
            [rows_per_req] * 4,
            None,
            t.req_to_token,
            pool,
        )
        fast = uniform_metadata(ctx, pool, lambda ratio, needed: needed + 3)
        reference = uniform_metadata_torch(ctx, pool, lambda ratio, needed: needed + 3)
        for a, b in zip(tensors_of(fast), tensors_of(reference), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_padding_request_scratch_page_and_snapshots_never_share_a_slot():
    """The padding request that fills captured batches owns nothing: its table row lies past
    the request slots, every one of its positions points into the scratch page (where the
    positions past any request's reservation point too), which the allocator never hands
    out and every pool holds; the prefix cache's snapshots are buffers of their own, so
    saving and restoring a request's state leaves the padding rows alone."""
    t = table(max_reqs=3, pages=8, page_size=4, context=40)
    pad = t.req_pool.pad_req
    assert t.req_to_token.shape[0] == pad + 1 == 4
    assert torch.equal(t.req_to_token[pad], t.scratch_slots(torch.arange(40)))
    assert (t.req_to_token[pad] // 4 == t.scratch_page).all() and t.scratch_page == 8
    reqs = [t.open_request() for _ in range(3)]
    assert sorted(reqs) == [0, 1, 2] and t.open_request() is None
    assert all(t.reserve(r, 10) for r in reqs[:2]) and t.reserve(reqs[2], 8)
    assert t.allocator.available_pages() == 0
    owned = {p for r in reqs for p in t.pages(r)}
    assert owned == set(range(8))  # every page handed out, the scratch page never
    assert (t.req_to_token[reqs[2], 8:] // 4 == t.scratch_page).all()  # past its reservation
    with pytest.raises(ValueError):
        t.req_pool.free(pad)

    layout = DeepseekV4CacheLayout((0, 4), head_dim=8, index_head_dim=4, sliding_window=8)
    geometry = PoolGeometry(
        max_reqs=3, num_pages=8, page_size=4, max_tokens_per_pass=4, dtype=torch.float32
    )
    pool = DeepseekV4KVPool(layout, geometry)
    assert pool.swa_kv[0].shape[0] == 4 * pool.swa_ring  # 3 requests + the padding one
    assert pool.compressed_kv[1].shape[0] == 9 * pool.compressed_rows_per_page(4)
    scratch_loc = pool.compressed_loc(4, t.req_to_token[pad, :1])
    assert pool.trash_row(4) == int(scratch_loc) == 8 * pool.compressed_rows_per_page(4)
    pool.allocate_snapshots(2)
    for buf in pool.request_state(pad):
        buf.fill_(7.0)
    for buf in pool.request_state(1):
        buf.fill_(1.0)
    pool.save_snapshot(1, slot=1)
    for buf in pool.request_state(1):
        buf.zero_()
    pool.restore_snapshot(1, reqs[0])
    assert all((buf == 1.0).all() for buf in pool.request_state(reqs[0]))
    assert all((buf == 7.0).all() for buf in pool.request_state(pad))


def test_qwen4_exp_padding_rows_address_only_the_padding_request_and_the_scratch_page():
    """In a captured Qwen4Exp step padded with copies of the padding request, every cache row
    a padding row writes or reads (its token slots, its keys, its conv, token and PLE ring
    rows, its recurrent state row) is the padding request's or in the scratch page; and
    snapshot save/restore of a request's state leaves the padding rows alone."""
    from runtime.cache.qwen4_exp_metadata import Qwen4ExpUniformMetadata
    from runtime.cache.qwen4_exp_pool import Qwen4ExpKVPool
    from runtime.core.forward_context import ForwardContext
    from runtime.core.forward_mode import ForwardMode

    layout = QWEN_LAYOUT
    t = table(max_reqs=3, pages=24, page_size=4, context=48)
    geometry = PoolGeometry(
        max_reqs=3,
        num_pages=24,
        page_size=4,
        max_tokens_per_pass=4,
        dtype=torch.float32,
        max_context=48,
    )
    pool = Qwen4ExpKVPool(layout, geometry)
    pad = t.req_pool.pad_req
    assert pool.ssm_state[0].shape[0] == 4 and pool.conv_state[0].shape[0] == 4 * pool.conv_ring
    assert pool.k_cache[1].shape[0] == 25 * 4  # every page and the scratch page
    reqs = [t.open_request() for _ in range(2)]
    for r in reqs:
        assert t.reserve(r, 40)
    scratch = set(t.scratch_slots(torch.arange(4)).tolist())
    for rows in (1, 4):
        ctx = ForwardContext.build(
            ForwardMode.TARGET_VERIFY,
            reqs + [pad] * 2,
            [30, 9, 0, 0],
            [rows] * 4,
            None,
            t.req_to_token,
            pool,
        )
        meta = pool.prepare(ctx, lambda ratio, needed: 16)  # more than the context holds
        assert isinstance(meta, Qwen4ExpUniformMetadata)
        padding = slice(2 * rows, None)  # rows of the two padding copies
        assert set(ctx.out_cache_loc[padding].tolist()) <= scratch
        assert set(meta.keys.key_slots[2:].flatten().tolist()) <= scratch
        for ring, size in (
            (meta.conv, pool.conv_ring),
            (meta.ple_tokens, pool.token_ring),
            (meta.ple_conv, pool.ple_conv_ring),
        ):
            assert set((ring.write[padding] // size).tolist()) == {pad}
            assert set((ring.read[padding] // size).flatten().tolist()) == {pad}
        assert meta.state_kept.tolist() == [True, True, False, False]
        assert meta.keys.key_slots.shape[1] == pool.max_blocks == 12  # 48 positions / 4
    pool.allocate_snapshots(2)
    for buf in pool.request_state(pad):
        buf.fill_(7)
    for buf in pool.request_state(reqs[1]):
        buf.fill_(1)
    pool.save_snapshot(reqs[1], slot=0)
    pool.restore_snapshot(0, reqs[0])
    assert all((buf == 1).all() for buf in pool.request_state(reqs[0]))
    assert all((buf == 7).all() for buf in pool.request_state(pad))


@pytest.mark.parametrize("rows_per_req", [1, 4])
def test_qwen4_exp_uniform_metadata_numpy_equals_torch(rows_per_req):
    """The CPU fast path of the fixed-shape Qwen4Exp metadata (numpy) builds the same tensors
    as the torch statement used on other devices, padding request included."""
    from runtime.cache.qwen4_exp_metadata import uniform_metadata
    from runtime.cache.qwen4_exp_pool import Qwen4ExpKVPool
    from runtime.core.forward_context import ForwardContext
    from runtime.core.forward_mode import ForwardMode
    from runtime.execution.capture_buffer import tensors_of

    t = table(max_reqs=3, pages=48, page_size=4, context=64)
    geometry = PoolGeometry(
        max_reqs=3,
        num_pages=48,
        page_size=4,
        max_tokens_per_pass=4,
        dtype=torch.float32,
        max_context=64,
    )
    pool = Qwen4ExpKVPool(QWEN_LAYOUT, geometry)
    reqs = [t.open_request() for _ in range(3)]
    for r in reqs:
        assert t.reserve(r, 60)
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        ctx = ForwardContext.build(
            mode,
            reqs + [t.req_pool.pad_req],
            [0, 17, 50, 0],
            [rows_per_req] * 4,
            None,
            t.req_to_token,
            pool,
        )
        blocks = lambda ratio, needed: needed + 3  # noqa: E731
        fast = uniform_metadata(ctx, pool, blocks, host=True)
        reference = uniform_metadata(ctx, pool, blocks, host=False)
        for a, b in zip(tensors_of(fast), tensors_of(reference), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("prefix_lens", [[0, 0, 0], [0, 5, 12], [3, 9, 1]])
def test_ring_reads_equal_the_virtual_buffer(prefix_lens):
    """`gather_ring` over `ring_access` reads, for every existing key, the row of the
    virtual buffer `[ring rows | this forward's rows]` its position lives in: ring row
    `slot * ring + p % ring` for positions before the request's cached prefix, the forward's
    own row after it; with and without cached prefixes (one gather, or a gather from the
    ring and a copy of the fresh rows at the places the metadata found)."""
    from runtime.cache.ring_access import ring_access
    from runtime.core.forward_context import ForwardContext
    from runtime.core.forward_mode import ForwardMode
    from runtime.layers.position_ring import gather_ring

    ring, width, dim = 6, 4, 3
    t = SlotTable(ReqToTokenPool(3, 64), PagedTokenAllocator(48, 4))
    reqs = [t.open_request() for _ in range(3)]
    extend_lens = [4, 7, 2]
    for r, p, n in zip(reqs, prefix_lens, extend_lens):
        assert t.reserve(r, p + n)
    ctx = ForwardContext.build(
        ForwardMode.EXTEND, reqs, prefix_lens, extend_lens, None, t.req_to_token, None
    )
    num_ring_rows = 3 * ring
    g = torch.Generator().manual_seed(sum(prefix_lens))
    ring_buf = torch.randn(num_ring_rows, dim, generator=g)
    fresh = torch.randn(sum(extend_lens), dim, generator=g)
    rows = torch.arange(sum(extend_lens))
    key_pos = ctx.positions.unsqueeze(1) - torch.arange(width)  # each row's last 4 positions
    access = ring_access(ctx, rows, key_pos, ring, num_ring_rows)
    assert (access.fresh_idx is None) == any(prefix_lens)
    got = gather_ring(ring_buf, fresh, access)
    starts = torch.tensor([0, *extend_lens]).cumsum(0)
    for row in range(len(rows)):
        b = int(ctx.token_to_req[row])
        for j in range(width):
            p = int(key_pos[row, j])
            assert bool(access.read_valid[row, j]) == (p >= 0)
            if p < 0:
                continue
            if p >= prefix_lens[b]:
                expected = fresh[starts[b] + p - prefix_lens[b]]
            else:
                expected = ring_buf[reqs[b] * ring + p % ring]
            assert torch.equal(got[row, j], expected)
