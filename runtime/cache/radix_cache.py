# SPDX-License-Identifier: Apache-2.0
"""A radix tree over token ids whose nodes own the token pages of a shared prefix, after
SGLang's `RadixCache` (`mem_cache/radix_cache.py`) and its hybrid variant for models with
per-request state (`mamba_radix_cache.py`).

* Edges hold whole *units* of `unit` tokens; the path from the root to a node at depth `D`
  owns the pages of positions `[0, D)`. Running requests read them by reference; `lock` /
  `unlock` count them, and a locked node is never evicted.
* A node carries *snapshots* of per-request state at positions `C >= D`, keyed by the tokens
  at positions `D .. C` (inclusive), with the pages of `[D, C)` (`tail_pages`) no node owns.
  `match` returns the deepest snapshot on the request's path.
* Eviction is LRU: unread leaves without snapshots, then snapshots, then leaves made useless.

The tree owns pages and snapshot slots and gives back whatever it drops; copying state in
and out is the caller's job (`PrefixCache`). Why the key includes token `C`:
docs/prefix_cache.md, section 2.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.cache.allocator import PagedTokenAllocator
from runtime.cache.state_snapshots import StateSnapshots
from runtime.core.request import OwedDraftRows


class RadixNode:
    __slots__ = ("key", "pages", "parent", "children", "depth", "lock_ref", "snapshots", "used")

    def __init__(self, key: tuple, pages: list[int], parent: RadixNode | None, depth: int):
        self.key, self.pages, self.parent, self.depth = key, pages, parent, depth
        self.children: dict[tuple, RadixNode] = {}  # by the first unit of the child's key
        self.lock_ref = 0
        self.snapshots: dict[tuple, Snapshot] = {}  # by tail tokens
        self.used = 0  # LRU clock reading of the last match or insert through this node


@dataclass(eq=False)
class Snapshot:
    node: RadixNode
    tail: tuple[int, ...]  # tokens at positions node.depth .. position (inclusive)
    slot: int  # in `StateSnapshots`
    tail_pages: list[int]  # pages of positions [node.depth, position)
    used: int = 0
    owed_draft_rows: OwedDraftRows | None = None  # what the MTP draft still owes this state

    @property
    def position(self) -> int:
        """Positions `[0, position)` are cached: a resuming request runs from here."""
        return self.node.depth + len(self.tail) - 1


@dataclass
class PrefixMatch:
    node: RadixNode  # the snapshot's node (the root when nothing matched)
    pages: list[int]  # the path's pages: positions [0, node.depth)
    snapshot: Snapshot | None = None

    @property
    def length(self) -> int:
        return self.snapshot.position if self.snapshot is not None else 0


@dataclass
class EvictionCounters:
    evicted_tokens: int = 0  # token slots given back by eviction (flushes not counted)
    evicted_snapshots: int = 0


class RadixCache:
    def __init__(
        self,
        unit: int,
        allocator: PagedTokenAllocator,
        snapshots: StateSnapshots,
    ):
        if unit < 1 or unit % allocator.page_size:
            raise ValueError(f"the unit ({unit}) must be a multiple of the page size")
        self.unit, self.allocator, self.snapshots = unit, allocator, snapshots
        self.page_size = allocator.page_size
        self._clock = itertools.count(1)
        self.counters = EvictionCounters()
        self.root = RadixNode((), [], None, 0)

    # queries ------------------------------------------------------------------------------
    def match(
        self, tokens: Sequence, limit: int, tail_tokens: Sequence[int] | None = None
    ) -> PrefixMatch:
        """The deepest snapshot at a position `<= limit` whose path and tail agree with
        `tokens` (the snapshot at C needs `tokens[C]`, so `limit < len(tokens)`).
        `tail_tokens`: what snapshot tails are compared with, where the edges are keyed by
        something else per position (`tokens`, one key a position)."""
        limit = min(limit, len(tokens) - 1)
        tails = tokens if tail_tokens is None else tail_tokens
        node, best = self.root, self._best_snapshot(self.root, tails, limit)
        while node.depth + self.unit <= limit:
            child = node.children.get(tuple(tokens[node.depth : node.depth + self.unit]))
            if child is None or child.depth > limit:
                break
            if tuple(tokens[node.depth : child.depth]) != child.key:
                break  # only part of the edge matches: its snapshots are out of reach
            node = child
            best = self._best_snapshot(node, tails, limit) or best
        if best is None:
            return PrefixMatch(self.root, [])
        self._touch(best)
        return PrefixMatch(best.node, self.path_pages(best.node), best)

    def _best_snapshot(self, node: RadixNode, tokens: Sequence[int], limit: int):
        best = None
        for snap in node.snapshots.values():
            end = snap.position
            if end <= limit and (best is None or end > best.position):
                if tuple(tokens[node.depth : end + 1]) == snap.tail:
                    best = snap
        return best

    def path_pages(self, node: RadixNode) -> list[int]:
        chain = []
        while node is not None:
            chain.append(node.pages)
            node = node.parent
        return [p for pages in reversed(chain) for p in pages]

    def has_snapshot(self, node: RadixNode, tail: tuple[int, ...]) -> bool:
        snap = node.snapshots.get(tail)
        if snap is not None:
            self._touch(snap)
        return snap is not None

    # reference counts ---------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        while node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlocking a radix node that is not locked")
            node.lock_ref -= 1
            node = node.parent

    # insertion ----------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[RadixNode, list[int]]:
        """Make the tree hold `tokens` (whole units) with `pages` (their pages). Returns the
        node at the end and the tree's pages for those positions: where the tree already had
        a page the caller's page is a duplicate; new nodes take the caller's pages."""
        length = len(tokens)
        if length % self.unit or len(pages) * self.page_size < length:
            raise ValueError("insert whole units, with a page for every position")
        node, path = self.root, []
        stamp = next(self._clock)
        while node.depth < length:
            start = node.depth
            child = node.children.get(tuple(tokens[start : start + self.unit]))
            if child is None:
                child = RadixNode(
                    tuple(tokens[start:length]),
                    list(pages[start // self.page_size : length // self.page_size]),
                    node,
                    length,
                )
                node.children[child.key[: self.unit]] = child
            else:
                common = self._common_units(child.key, tokens[start:length])
                if common < len(child.key):
                    child = self._split(child, common)
            child.used = stamp
            path += child.pages
            node = child
        return node, path

    def _common_units(self, key: tuple, tokens: Sequence[int]) -> int:
        n, unit = self.unit, self.unit  # the first unit matched through the children dict
        while n + unit <= min(len(key), len(tokens)) and key[n : n + unit] == tuple(
            tokens[n : n + unit]
        ):
            n += unit
        return n

    def _split(self, child: RadixNode, length: int) -> RadixNode:
        """Cut `child`'s edge after `length` tokens; the new upper node is returned."""
        parent, cut = child.parent, length // self.page_size
        upper = RadixNode(child.key[:length], child.pages[:cut], parent, parent.depth + length)
        upper.lock_ref, upper.used = child.lock_ref, child.used
        child.key, child.pages, child.parent = child.key[length:], child.pages[cut:], upper
        upper.children[child.key[: self.unit]] = child
        parent.children[upper.key[: self.unit]] = upper
        return upper

    def add_snapshot(
        self,
        node: RadixNode,
        tail: tuple[int, ...],
        slot: int,
        tail_pages: list[int],
        owed_draft_rows: OwedDraftRows | None = None,
    ) -> Snapshot:
        if not 1 <= len(tail) <= self.unit:
            raise ValueError("a snapshot's tail covers 1 .. unit tokens")
        snap = Snapshot(node, tail, slot, list(tail_pages), owed_draft_rows=owed_draft_rows)
        node.snapshots[tail] = snap
        self._touch(snap)
        return snap

    def _touch(self, snap: Snapshot) -> None:
        stamp = next(self._clock)
        snap.used = stamp
        node = snap.node
        while node is not None:
            node.used = stamp
            node = node.parent

    # eviction -----------------------------------------------------------------------------
    def evict(self, num_pages: int, protect: Snapshot | None = None) -> int:
        """Free at least `num_pages` pages if the tree can (locked nodes and `protect` stay).
        Returns the pages freed."""
        freed = 0
        if num_pages <= 0:
            return 0
        for leaf in self._useless_leaves():
            freed += self._remove_upward(leaf)
            if freed >= num_pages:
                return freed
        for snap in self._snapshots_by_age():
            if snap is protect:
                continue
            freed += self._drop(snap)
            if freed >= num_pages:
                break
        return freed

    def evict_snapshot(self, protect: Snapshot | None = None) -> bool:
        """Drop the least recently used snapshot (to free its slot); False if none."""
        for snap in self._snapshots_by_age():
            if snap is not protect:
                self._drop(snap)
                return True
        return False

    def _drop(self, snap: Snapshot) -> int:
        del snap.node.snapshots[snap.tail]
        self.snapshots.free(snap.slot)
        self.allocator.free_pages(snap.tail_pages)
        self.counters.evicted_snapshots += 1
        self.counters.evicted_tokens += len(snap.tail_pages) * self.page_size
        return len(snap.tail_pages) + self._remove_upward(snap.node)

    def _useless(self, node: RadixNode) -> bool:
        return (
            node is not self.root and not node.lock_ref and not node.children and not node.snapshots
        )

    def _remove_upward(self, node: RadixNode) -> int:
        """Remove `node` and then each parent it leaves useless; returns the pages freed."""
        freed = 0
        while self._useless(node):
            parent = node.parent
            del parent.children[node.key[: self.unit]]
            self.allocator.free_pages(node.pages)
            freed += len(node.pages)
            self.counters.evicted_tokens += len(node.pages) * self.page_size
            node = parent
        return freed

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _useless_leaves(self) -> list[RadixNode]:
        return sorted((n for n in self._nodes() if self._useless(n)), key=lambda n: n.used)

    def _snapshots_by_age(self) -> list[Snapshot]:
        snaps = [s for n in self._nodes() for s in n.snapshots.values()]
        return sorted(snaps, key=lambda s: s.used)

    # bookkeeping --------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop everything (nothing may be locked)."""
        for node in self._nodes():
            if node.lock_ref:
                raise RuntimeError("cannot reset the radix cache while requests read it")
        for node in list(self._nodes()):
            self.allocator.free_pages(node.pages)
            for snap in node.snapshots.values():
                self.snapshots.free(snap.slot)
                self.allocator.free_pages(snap.tail_pages)
        self.root = RadixNode((), [], None, 0)

    def cached_pages(self) -> int:
        """Pages the tree holds (nodes and snapshot tails)."""
        return sum(
            len(n.pages) + sum(len(s.tail_pages) for s in n.snapshots.values())
            for n in self._nodes()
        )

    def evictable_pages(self) -> int:
        """Pages eviction could free now: those of nodes no request reads, and every
        snapshot's tail pages."""
        return sum(
            (0 if n.lock_ref else len(n.pages))
            + sum(len(s.tail_pages) for s in n.snapshots.values())
            for n in self._nodes()
        )

    def num_snapshots(self) -> int:
        return sum(len(n.snapshots) for n in self._nodes())

    def locked_nodes(self) -> int:
        return sum(1 for n in self._nodes() if n.lock_ref)
