# SPDX-License-Identifier: Apache-2.0
"""The radix tree's bookkeeping (pages, snapshots, locks, LRU eviction), borrowed pages in
the slot table, and the snapshot store over the real cache pools."""

from __future__ import annotations

import pytest
import torch

from runtime.cache import PagedTokenAllocator, ReqToTokenPool, SlotTable
from runtime.cache.deepseek_v4_pool import DeepseekV4CacheLayout, DeepseekV4KVPool
from runtime.cache.pool_geometry import PoolGeometry
from runtime.cache.qwen4_exp_pool import Qwen4ExpCacheLayout, Qwen4ExpKVPool
from runtime.cache.radix_cache import RadixCache
from runtime.cache.state_snapshots import RequestStateSnapshots, StateSnapshots
from runtime.core.request import OwedDraftRows


class OneRowPool(RequestStateSnapshots):
    """A pool with one float per request (enough for the tree's bookkeeping)."""

    def __init__(self, max_reqs=8):
        self.state = torch.zeros(max_reqs, 1)

    def request_state(self, idx, verify_row=None):
        return [self.state[idx]]

    def copy_pages(self, src, dst):
        pass


class LocalRunner:
    """What the prefix cache needs of a model runner: its pool, and calls on it."""

    def __init__(self, pool):
        self.kv_pool = pool

    def apply(self, command):
        command.apply(self.kv_pool)


def tree(pages=32, page_size=2, unit=4, slots=4):
    allocator = PagedTokenAllocator(pages, page_size)
    pool = OneRowPool()
    pool.allocate_snapshots(slots)
    return RadixCache(unit, allocator, StateSnapshots([LocalRunner(pool)], slots)), allocator


def take(allocator, count):
    return allocator.alloc_pages(count)


def snapshot_at(cache, allocator, tokens, position):
    """Insert `tokens[:position]` (rounded down to units) with fresh pages and a snapshot."""
    unit, page = cache.unit, cache.page_size
    depth = position // unit * unit
    node, path = cache.insert(tokens[:depth], take(allocator, depth // page))
    tail_pages = take(allocator, -(-(position - depth) // page))
    cache.add_snapshot(
        node, tuple(tokens[depth : position + 1]), cache.snapshots.alloc(), tail_pages
    )
    return node, path


def test_match_returns_the_deepest_snapshot_whose_path_and_tail_agree():
    cache, allocator = tree()
    a = list(range(100, 120))
    snapshot_at(cache, allocator, a, 6)
    node, path = snapshot_at(cache, allocator, a, 13)
    assert node.depth == 12 and len(path) == 6
    assert cache.match(a, limit=19).length == 13
    assert cache.match(a, limit=12).length == 6  # the deeper one is past the limit
    assert cache.match(a[:13], limit=12).length == 6  # token 13 is part of the key
    other = a[:13] + [7] + a[14:]
    assert cache.match(other, limit=19).length == 6  # the tail (positions 12..13) differs
    diverged = a[:10] + [7] * 10  # inside the edge of the deeper node
    assert cache.match(diverged, limit=19).length == 6
    assert cache.match([1, 2, 3], limit=2).length == 0
    hit = cache.match(a, limit=19)
    assert hit.pages == path  # the pages of positions [0, 12)


def test_insert_splits_edges_and_returns_the_trees_pages():
    cache, allocator = tree()
    a = list(range(16))
    b = a[:8] + [99] * 8
    node_a, pages_a = cache.insert(a, take(allocator, 8))
    own_b = take(allocator, 8)
    node_b, pages_b = cache.insert(b, own_b)
    assert pages_b[:4] == pages_a[:4]  # the shared part keeps the tree's pages...
    assert pages_b[4:] == own_b[4:]  # ...the new part takes the caller's
    assert node_a.parent is node_b.parent and node_a.parent.depth == 8
    assert sorted(len(c.key) for c in node_a.parent.children.values()) == [8, 8]
    # lock counts follow a split
    cache.lock(node_a)
    c = a[:4] + [55] * 4
    cache.insert(c, take(allocator, 4))
    assert node_a.parent.parent.depth == 4 and node_a.parent.parent.lock_ref == 1
    cache.unlock(node_a)
    assert cache.locked_nodes() == 0


def test_eviction_is_lru_skips_locked_nodes_and_frees_everything():
    cache, allocator = tree(pages=64)
    start = allocator.available_pages() + 0
    seqs = [[s] * 4 + list(range(20)) for s in range(3)]
    nodes = [snapshot_at(cache, allocator, s, 17)[0] for s in seqs]
    held = cache.cached_pages()
    assert held == 3 * (8 + 1) and allocator.available_pages() == start - held
    cache.match(seqs[0], limit=20)  # seqs[0] is now the most recently used
    cache.lock(nodes[1])
    # LRU: seqs[1]'s snapshot (only its tail page: its node is locked), then seqs[2]'s with
    # the leaf it leaves useless
    assert cache.evict(2) == 1 + 9
    assert cache.match(seqs[2], limit=20).length == cache.match(seqs[1], limit=20).length == 0
    assert cache.match(seqs[0], limit=20).length == 17
    assert cache.counters.evicted_snapshots == 2 and cache.counters.evicted_tokens == 20
    assert cache.evict(100) == 9
    assert cache.match(seqs[0], limit=20).length == 0
    # the locked path keeps its pages
    assert cache.cached_pages() == 8 and cache.num_snapshots() == 0
    assert cache.evictable_pages() == 0
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(nodes[1])
    cache.reset()
    assert allocator.available_pages() == start
    assert cache.snapshots.available() == cache.snapshots.num_slots


def test_useless_leaves_go_before_snapshots():
    cache, allocator = tree()
    kept = list(range(30, 50))
    snapshot_at(cache, allocator, kept, 9)
    cache.insert(list(range(8)), take(allocator, 4))  # pages without any snapshot
    assert cache.evict(4) == 4
    assert cache.match(kept, limit=19).length == 9


def test_slot_table_borrowed_pages_are_never_freed_by_the_request():
    table = SlotTable(ReqToTokenPool(4, 64), PagedTokenAllocator(16, 4))
    start = table.allocator.available_pages()
    shared = table.allocator.alloc_pages(2)
    req = table.open_request(shared)
    assert table.reserve(req, 20) and table.pages(req)[:2] == shared
    assert table.slots(req, 0, 8).tolist() == table.allocator.page_slots(shared).tolist()
    own = table.pages(req)[2:]
    # the cache takes over page 2 (a new node) and already has a copy of page 3
    other = table.allocator.alloc_pages(1)
    replaced = table.share_prefix(req, shared + [own[0]] + other)
    assert replaced == [own[1]] and table.borrowed_pages(req) == 4
    assert table.slots(req, 12, 16).tolist() == table.allocator.page_slots(other).tolist()
    table.allocator.free_pages(replaced)
    table.trim(req, 0)  # never below the borrowed pages
    assert table.pages(req) == shared + [own[0]] + other
    table.release(req)
    cache_pages = shared + [own[0]] + other
    assert table.allocator.available_pages() == start - len(cache_pages)
    table.allocator.free_pages(cache_pages)
    assert table.allocator.available_pages() == start


def geometry(**kw):
    base = dict(max_reqs=3, num_pages=6, page_size=4, max_tokens_per_pass=3, dtype=torch.float32)
    return PoolGeometry(**{**base, **kw})


def v4_pool():
    layout = DeepseekV4CacheLayout((0, 4, 16), head_dim=8, index_head_dim=4, sliding_window=8)
    return DeepseekV4KVPool(layout, geometry())


def qwen_pool():
    layout = Qwen4ExpCacheLayout(
        layer_kinds=("linear", "attention"),
        ple_layers=(0,),
        num_kv_heads=1,
        head_dim=4,
        index_head_dim=2,
        conv_dim=6,
        conv_kernel=4,
        num_v_heads=2,
        head_k_dim=3,
        head_v_dim=3,
        hc_width=5,
        ple_conv_span=6,
        ngram_size=3,
        qsa_ratio=4,
    )
    return Qwen4ExpKVPool(layout, geometry())


def randomise(pool):
    """Random contents in every cache buffer (the snapshot slots are left alone)."""
    for name, value in vars(pool).items():
        if name == "_snapshot_store":
            continue
        buffers = value if isinstance(value, list) else getattr(value, "values", lambda: [])()
        for buf in buffers:
            if isinstance(buf, torch.Tensor):
                buf.copy_(torch.randint(0, 50, buf.shape).to(buf.dtype))


@pytest.mark.parametrize("make", [v4_pool, qwen_pool])
def test_snapshots_round_trip_exactly_the_per_request_rows(make):
    pool = make()
    randomise(pool)
    pool.allocate_snapshots(2)
    store = StateSnapshots([LocalRunner(pool)], num_slots=2)
    before = [v.clone() for v in pool.request_state(0)]
    untouched = [v.clone() for v in pool.request_state(2)]
    slot = store.alloc()
    store.save(0, slot)
    randomise(pool)
    store.restore(slot, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.request_state(1)))
    assert not all(torch.equal(a, b) for a, b in zip(untouched, pool.request_state(2)))
    # nothing outside request 1's rows was written by the restore
    snapshot = [v.clone() for v in pool.request_state(2)]
    store.restore(slot, 1)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, pool.request_state(2)))


def test_owed_rows_live_in_one_buffer_allocated_once_and_come_back_exactly():
    """The rows a draft owes each snapshot are copied into that slot's rows of one buffer
    (allocated at the first, counted in `nbytes`); a later snapshot in the same slot
    overwrites them, so a resuming request takes a copy; rows the buffer cannot hold stay
    as they came."""
    pool = OneRowPool()
    pool.allocate_snapshots(3)
    store = StateSnapshots([LocalRunner(pool)], num_slots=3, owed_capacity=4)
    before = store.nbytes()
    owed = [OwedDraftRows(10 + i, torch.randn(i + 2, 6), tuple(range(i + 2))) for i in range(3)]
    kept = [store.keep_owed(slot, rows) for slot, rows in enumerate(owed)]
    assert store.nbytes() == before + 3 * 4 * 6 * 4
    storages = {k.hidden.untyped_storage().data_ptr() for k in kept}
    assert len(storages) == 1 and all(
        k.hidden.data_ptr() != o.hidden.data_ptr() for k, o in zip(kept, owed)
    )
    for k, o in zip(kept, owed):
        assert (k.start, k.following) == (o.start, o.following)
        assert torch.equal(k.hidden, o.hidden)
    resumed = kept[1].copy()
    store.keep_owed(1, OwedDraftRows(0, torch.zeros(3, 6), (0, 0, 0)))  # the slot's next state
    assert torch.equal(resumed.hidden, owed[1].hidden)
    assert not torch.equal(kept[1].hidden, owed[1].hidden)
    too_many = OwedDraftRows(0, torch.randn(5, 6), tuple(range(5)))
    other_width = OwedDraftRows(0, torch.randn(2, 7), (1, 2))
    assert store.keep_owed(0, too_many) is too_many
    assert store.keep_owed(0, other_width) is other_width
    no_buffer = StateSnapshots([LocalRunner(pool)], num_slots=3)
    assert no_buffer.keep_owed(0, owed[0]) is owed[0] and no_buffer.nbytes() == before


def test_qwen_snapshot_of_a_verify_row_takes_that_rows_recurrent_state():
    pool = qwen_pool()
    randomise(pool)
    pool.allocate_snapshots(1)
    store = StateSnapshots([LocalRunner(pool)], num_slots=1)
    store.save(1, 0, verify_row=2)
    store.restore(0, 0)
    layer = next(iter(pool.ssm_state))
    assert torch.equal(pool.ssm_state[layer][0], pool.ssm_snapshots[layer][1, 2])


@pytest.mark.parametrize("make", [v4_pool, qwen_pool])
def test_copy_pages_copies_whole_pages_and_nothing_else(make):
    pool = make()
    randomise(pool)
    full_history = (
        list(pool.compressed_kv.values()) + list(pool.indexer_k.values())
        if isinstance(pool, DeepseekV4KVPool)
        else [*pool.k_cache.values(), *pool.v_cache.values(), *pool.index_cache.values()]
    )
    before = [b.clone() for b in full_history]
    pool.copy_pages([1, 4], [2, 5])
    for old, new in zip(before, full_history):
        rows = new.shape[0] // 6  # rows per page (the pool has 6 pages)
        for page in range(6):
            src = {2: 1, 5: 4}.get(page, page)
            assert torch.equal(
                new[page * rows : (page + 1) * rows], old[src * rows : (src + 1) * rows]
            )
