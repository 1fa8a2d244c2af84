# SPDX-License-Identifier: Apache-2.0
"""What the scheduler asks of a prefix cache: admit a request (reusing what it can), cache
it when it finishes or is retracted and after prefill chunks, make room under pressure.

`PrefixCache` shares nothing (SGLang's `ChunkCache`, what `--disable-radix-cache` gives);
`RadixPrefixCache` shares prefixes through a `RadixCache` and per-request state through
snapshots (SGLang's in-batch prefix caching included). Invariants callers rely on:
a match covers at most `seq_len - 1` positions (the last prompt row always runs, as in
SGLang); a resumed request computes exactly what it would have computed itself (target and
MTP draft state, and the draft rows it still owes, come back with the snapshot); a page the
tree shares is never written again (the tree's unit is the least common multiple of the
page size and every pool's `share_alignment`).

How admission, caching, snapshot points and the unit work is docs/prefix_cache.md (sections
2 to 4, and "Module notes").
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from runtime.cache.radix_cache import PrefixMatch, RadixCache, RadixNode
from runtime.cache.slot_table import SlotTable
from runtime.cache.state_snapshots import StateSnapshots
from runtime.core.request import OwedDraftRows, Req

# what a speculative worker's draft still owes a request's state, asked for when a snapshot
# of that state is taken (a copy of its skipped rows, `NextNWorker.owed_draft_rows`)
OwedRowsSource = Callable[[], OwedDraftRows | None]

# A waiting request holds back for a running one only when they share at least this many
# more tokens than the cache already gives it (waiting for a few template tokens costs
# more latency than it saves).
MIN_SHARED_PREFIX = 32


class Admission(enum.Enum):
    ADMITTED = "admitted"
    NO_REQUEST_SLOT = "no request slot"
    NO_ROOM = "no room"


@dataclass(frozen=True)
class PrefixCacheStats:
    enabled: bool
    hit_tokens: int  # prompt tokens served from the cache (first admissions)
    prompt_tokens: int  # prompt tokens of every first admission
    evicted_tokens: int = 0
    evicted_snapshots: int = 0
    cached_tokens: int = 0  # token slots the cache holds right now
    evictable_tokens: int = 0  # of those, the ones no running request reads
    snapshots: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    return len(os.path.commonprefix([a, b]))


def prompt_limit(req: Req) -> int:
    """The most positions a request may take from the cache: its last token always runs,
    and prompt rows whose logprobs it asked for must run too."""
    limit = req.seq_len - 1
    if req.return_logprob and req.logprob_start_len >= 0 and not req.input_logprobs_done:
        limit = min(limit, max(req.logprob_start_len, 1) - 1)
    return limit


class PrefixCache:
    """No prefix sharing: every request prefills from position 0."""

    enabled = False

    def __init__(self, slot_table: SlotTable):
        self.slot_table = slot_table
        self.hit_tokens = self.prompt_tokens = 0

    # admission ----------------------------------------------------------------------------
    def admit(self, req: Req, need_tokens: int, headroom_tokens: int, alone: bool) -> Admission:
        """Give `req` a request slot and positions `[0, need_tokens)`, keeping
        `headroom_tokens` free for the running requests (unless it would run `alone`)."""
        idx = self.slot_table.open_request()
        if idx is None:
            return Admission.NO_REQUEST_SLOT
        if not self._reserve(idx, need_tokens, headroom_tokens, alone):
            self.slot_table.release(idx)
            return Admission.NO_ROOM
        self._admitted(req, idx, 0)
        return Admission.ADMITTED

    def _reserve(self, idx: int, need_tokens: int, headroom_tokens: int, alone: bool) -> bool:
        table = self.slot_table
        new_tokens = need_tokens - table.reserved_tokens(idx)
        fits = alone or table.allocator.available_tokens() >= new_tokens + headroom_tokens
        return fits and table.reserve(idx, need_tokens)

    def _admitted(self, req: Req, idx: int, cached: int) -> None:
        req.req_pool_idx, req.num_cached = idx, cached
        req.owed_draft_rows = None
        if cached < req.seq_len - 1:
            # A retracted request resumed right at its newest token keeps the drafts it had:
            # the cache holds exactly the state they were drafted from, so its next verify
            # round is the one it would have run. Anywhere earlier they are recomputed.
            req.draft_tokens = None
        if req.num_retractions == 0:
            req.cached_tokens = cached
            self.hit_tokens += cached
            self.prompt_tokens += len(req.prompt_ids)

    def waits_for_prefix(self, req: Req, running: Sequence[Req]) -> bool:
        """Whether `req` should wait for a running request to cache a prefix they share."""
        return False

    # while running ------------------------------------------------------------------------
    def chunk_end(self, req: Req, start: int, end: int) -> int:
        """Where a prefill chunk `[start, end)` should stop instead (a snapshot point)."""
        return end

    def after_prefill_chunk(self, req: Req, owed: OwedRowsSource = lambda: None) -> None:
        """`req.num_cached` just advanced to the end of a prefill chunk; `owed()`: the rows up
        to there its MTP draft has not run over (asked for only when a snapshot taken here
        keeps them)."""

    def make_room(self, num_pages: int) -> int:
        """Free up to `num_pages` pages the cache holds; returns how many it freed."""
        return 0

    # release ------------------------------------------------------------------------------
    def release(self, req: Req, keep_state: bool = False, verify_row: int | None = None) -> None:
        """Give back everything `req` holds. With `keep_state` its computed prefix may be
        cached (with the `owed_draft_rows` of a finishing request); `verify_row` j says its
        state is that after row j of the last verify pass (the round emitted tokens past the
        one it stopped at)."""
        self.slot_table.release(req.req_pool_idx)
        req.req_pool_idx, req.owed_draft_rows = None, None

    def reset(self) -> None:
        """Drop everything cached (`/flush_cache`; no request may be running)."""

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.enabled, self.hit_tokens, self.prompt_tokens)

    def describe(self) -> str:
        return "off"


class RadixPrefixCache(PrefixCache):
    enabled = True

    def __init__(
        self,
        slot_table: SlotTable,
        runners: Sequence,
        snapshot_slots: int,
        snapshot_interval: int = 0,
        min_shared_prefix: int = MIN_SHARED_PREFIX,
        owed_capacity: int | None = None,
        next_token_keys: bool = False,
    ):
        """`runners`: the target's and the draft's (their pools must have allocated
        `snapshot_slots` snapshots); every change to their caches is a `PoolCommand` they
        `apply`.
        `owed_capacity`: the most rows an MTP draft may owe a snapshot (`StateSnapshots`).
        `next_token_keys`: an MTP draft keeps rows in shared pages (it reads every row), and
        its row at `p` was computed with the token at `p + 1`, so the tree keys position `p`
        by both tokens (`_keys`): a page is shared only where the next token agrees too."""
        super().__init__(slot_table)
        self.next_token_keys = next_token_keys
        alignments = (runner.kv_pool.share_alignment() for runner in runners)
        unit = math.lcm(slot_table.page_size, *alignments)
        self.snapshots = StateSnapshots(runners, snapshot_slots, owed_capacity)
        self.tree = RadixCache(unit, slot_table.allocator, self.snapshots)
        self.snapshot_interval, self.min_shared_prefix = snapshot_interval, min_shared_prefix
        self._locks: dict[int, RadixNode] = {}  # request slot -> the node its prefix ends at
        self._cuts: dict[int, set[int]] = {}  # request slot -> positions to snapshot at

    @property
    def unit(self) -> int:
        return self.tree.unit

    # admission ----------------------------------------------------------------------------
    def _keys(self, tokens: list[int], length: int) -> list:
        """The tree's key of each of positions `[0, length)`: its token, or with
        `next_token_keys` the pair (its token, the next one; None past the last). Two
        requests that branch at position `s` then share pages up to `s - 1` only: the draft
        row at `s - 1` each reads is its own, computed with its own token `s`, as in a run
        without the cache (sharing it would change the draft's later proposals)."""
        if not self.next_token_keys:
            return tokens[:length]
        following = tokens[1 : length + 1]
        return list(zip(tokens[:length], following + [None] * (length - len(following))))

    def _match(self, req: Req) -> PrefixMatch:
        limit = prompt_limit(req)
        if limit <= 0:
            return PrefixMatch(self.tree.root, [])
        tokens = req.all_ids
        return self.tree.match(self._keys(tokens, len(tokens)), limit, tail_tokens=tokens)

    def admit(self, req: Req, need_tokens: int, headroom_tokens: int, alone: bool) -> Admission:
        table, page = self.slot_table, self.slot_table.page_size
        match = self._match(req)
        idx = table.open_request(match.pages)
        if idx is None:
            return Admission.NO_REQUEST_SLOT
        self.tree.lock(match.node)
        short = need_tokens - table.reserved_tokens(idx) + headroom_tokens
        short -= table.allocator.available_tokens()
        if short > 0:
            self.tree.evict(-(-short // page), protect=match.snapshot)
        if not self._reserve(idx, need_tokens, headroom_tokens, alone):
            table.release(idx)
            self.tree.unlock(match.node)
            return Admission.NO_ROOM
        self._locks[idx] = match.node
        if match.snapshot is not None:
            self._resume(idx, match)
        self._admitted(req, idx, match.length)
        owed = match.snapshot.owed_draft_rows if match.snapshot is not None else None
        if owed is not None:
            req.owed_draft_rows = owed.copy()  # the snapshot's slot may be reused meanwhile
        return Admission.ADMITTED

    def _resume(self, idx: int, match: PrefixMatch) -> None:
        """Copy the snapshot's state into the request slot and its tail pages into the
        request's own pages."""
        snap = match.snapshot
        self.snapshots.restore(snap.slot, idx)
        if snap.tail_pages:
            first = snap.node.depth // self.slot_table.page_size
            own = self.slot_table.pages(idx)[first : first + len(snap.tail_pages)]
            self.snapshots.copy_pages(snap.tail_pages, own)

    def waits_for_prefix(self, req: Req, running: Sequence[Req]) -> bool:
        limit = prompt_limit(req)
        leader, resume = None, 0
        for other in running:
            if other.num_cached >= other.seq_len - 1:
                continue  # nothing left to prefill: no snapshot point can be added
            shared = min(common_prefix_len(other.all_ids, req.all_ids) - 1, limit)
            if shared > max(other.num_cached, resume):
                leader, resume = other, shared
        if leader is None or resume - self._match(req).length < self.min_shared_prefix:
            return False
        self._cuts.setdefault(leader.req_pool_idx, set()).add(resume)
        return True

    # while running ------------------------------------------------------------------------
    def chunk_end(self, req: Req, start: int, end: int) -> int:
        points = [c for c in self._cuts.get(req.req_pool_idx, ()) if start < c < end]
        if self.snapshot_interval > 0:
            points.append((start // self.snapshot_interval + 1) * self.snapshot_interval)
        return min([c for c in points if c < end], default=end)

    def after_prefill_chunk(self, req: Req, owed: OwedRowsSource = lambda: None) -> None:
        pos, idx = req.num_cached, req.req_pool_idx
        interval = self.snapshot_interval
        if pos in self._cuts.get(idx, ()) or (interval > 0 and pos % interval == 0):
            self._cache(req, idx, finishing=False, owed=owed())

    def make_room(self, num_pages: int) -> int:
        return self.tree.evict(num_pages)

    # release ------------------------------------------------------------------------------
    def release(self, req: Req, keep_state: bool = False, verify_row: int | None = None) -> None:
        idx = req.req_pool_idx
        kept = []
        if keep_state:
            kept = self._cache(req, idx, True, verify_row, req.owed_draft_rows)
        req.owed_draft_rows = None
        self.tree.unlock(self._locks.pop(idx))
        self._cuts.pop(idx, None)
        self.slot_table.release(idx, keep=kept)
        req.req_pool_idx = None

    def _cache(
        self,
        req: Req,
        idx: int,
        finishing: bool,
        verify_row: int | None = None,
        owed: OwedDraftRows | None = None,
    ) -> list[int]:
        """Insert the request's prefix up to its last whole unit and snapshot its state at
        `num_cached` (with the rows its draft owes that state). Returns the pages a
        finishing request hands to the snapshot."""
        pos, tokens = req.num_cached, req.all_ids
        if pos <= 0 or pos >= len(tokens):
            return []
        page = self.slot_table.page_size
        depth = pos // self.unit * self.unit
        pages = self.slot_table.pages(idx)
        node, tree_pages = self.tree.insert(self._keys(tokens, depth), pages[: depth // page])
        self.tree.lock(node)
        self.slot_table.allocator.free_pages(self.slot_table.share_prefix(idx, tree_pages))
        tail_src = pages[depth // page : -(-pos // page)]
        try:
            return self._snapshot(
                idx, node, tuple(tokens[depth : pos + 1]), tail_src, finishing, verify_row, owed
            )
        finally:
            if finishing:
                self.tree.unlock(node)
            else:  # the request now reads the tree's pages up to `depth`
                self.tree.unlock(self._locks[idx])
                self._locks[idx] = node

    def _snapshot(
        self,
        idx: int,
        node: RadixNode,
        tail: tuple[int, ...],
        tail_src: list[int],
        finishing: bool,
        verify_row: int | None,
        owed: OwedDraftRows | None = None,
    ) -> list[int]:
        if self.tree.has_snapshot(node, tail):
            return []
        slot = self.snapshots.alloc()
        if slot is None and self.tree.evict_snapshot():
            slot = self.snapshots.alloc()
        if slot is None:
            return []
        tail_pages = tail_src if finishing else self._alloc_pages(len(tail_src))
        if tail_pages is None:
            self.snapshots.free(slot)
            return []
        if not finishing:
            self.snapshots.copy_pages(tail_src, tail_pages)
        self.snapshots.save(idx, slot, verify_row)
        if owed is not None:
            owed = self.snapshots.keep_owed(slot, owed)
        self.tree.add_snapshot(node, tail, slot, tail_pages, owed)
        return tail_pages if finishing else []

    def _alloc_pages(self, count: int) -> list[int] | None:
        allocator = self.slot_table.allocator
        if count > allocator.available_pages():
            self.tree.evict(count - allocator.available_pages())
        return allocator.alloc_pages(count)

    def reset(self) -> None:
        self.tree.reset()

    def describe(self) -> str:
        return (
            f"radix tree in units of {self.unit} tokens, {self.snapshots.num_slots} state "
            f"snapshots of {self.snapshots.nbytes() / self.snapshots.num_slots / 2**10:.1f} KiB"
        )

    def stats(self) -> PrefixCacheStats:
        counters = self.tree.counters
        return PrefixCacheStats(
            self.enabled,
            self.hit_tokens,
            self.prompt_tokens,
            counters.evicted_tokens,
            counters.evicted_snapshots,
            self.tree.cached_pages() * self.slot_table.page_size,
            self.tree.evictable_pages() * self.slot_table.page_size,
            self.tree.num_snapshots(),
        )
