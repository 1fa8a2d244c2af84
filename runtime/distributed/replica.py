# SPDX-License-Identifier: Apache-2.0
"""Joining one model replica: torch.distributed rendezvous and the process groups.

Every rank calls `init_replica` with the same layout and rendezvous address. Rank 0 hosts
the `TCPStore` (torch.distributed's TCP rendezvous), which also carries the ranks'
heartbeats (`runtime.distributed.health`). Groups:

* the default group on the data-plane backend (NCCL on CUDA, gloo on CPU) and one group
  per attention-TP / expert-parallel / expert-TP block, for the layers' collectives;
* a gloo `control` group over the whole replica, through which rank 0 broadcasts each
  forward's description (SGLang keeps the same CPU group for `broadcast_pyobj`). It never
  times out: a follower waits on it for as long as the server is idle, and a rank that
  stops answering is caught by the heartbeats instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from runtime.distributed.mapping import (
    AttentionMapping,
    Mapping,
    MoEMapping,
    ParallelGroup,
    ParallelLayout,
)

logger = logging.getLogger(__name__)

# The control group waits for rank 0's next message while the server is idle.
_CONTROL_TIMEOUT = timedelta(days=365)
# This process's data-plane groups and their configured timeouts (`patient_collectives`).
_DATA_GROUPS: list[tuple[Any, timedelta]] = []


@dataclass
class Replica:
    """This process's place in a replica and the handles it talks through."""

    rank: int
    layout: ParallelLayout
    mapping: Mapping
    control: Any  # gloo process group over the replica (rank 0 broadcasts on it)
    store: Any  # the rendezvous TCPStore (heartbeats)
    address: tuple[str, int]
    backend: str

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def _group(ranks: list[int], rank: int, backend: str, timeout: timedelta):
    """A process group over `ranks` (every rank must call this for every group, in order);
    the WORLD group when `ranks` is everybody."""
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    return dist.new_group(ranks, backend=backend, timeout=timeout)


def _mine(groups: list[list[int]], rank: int, backend: str, timeout: timedelta) -> ParallelGroup:
    """Create every group of a partition; this rank's as a `ParallelGroup` (no process group
    when it has one member: its collectives are identities)."""
    mine = ParallelGroup()
    for ranks in groups:
        handle = _group(ranks, rank, backend, timeout) if len(ranks) > 1 else None
        if rank in ranks:
            mine = ParallelGroup(ranks.index(rank), len(ranks), handle)
    return mine


def init_replica(
    layout: ParallelLayout,
    rank: int,
    address: tuple[str, int],
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> Replica:
    """Rendezvous at `address` (rank 0 listens there) and build every group of `layout`.

    `timeout_s` bounds the rendezvous and each data-plane collective."""
    world = layout.world_size
    timeout = timedelta(seconds=timeout_s)
    host, port = address
    store = dist.TCPStore(
        host, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    control = dist.new_group(list(range(world)), backend="gloo", timeout=_CONTROL_TIMEOUT)
    tp = _mine(layout.tp_groups(), rank, backend, timeout)
    ep = _mine(layout.ep_groups(), rank, backend, timeout)
    moe_tp = _mine(layout.moe_tp_groups(), rank, backend, timeout)
    everyone = ParallelGroup(rank, world, dist.group.WORLD if world > 1 else None)
    handles = {id(g.group): g.group for g in (tp, ep, moe_tp, everyone) if g.group is not None}
    _DATA_GROUPS[:] = [(g, timeout) for g in handles.values()]
    mapping = Mapping(
        attn=AttentionMapping(tp),
        moe=MoEMapping(ep=ep, tp=moe_tp, combine=everyone),
        world=everyone,
    )
    logger.info(
        "rank %d/%d joined at %s:%d (%s): attention tp %d/%d, experts ep %d/%d x tp %d/%d",
        rank,
        world,
        host,
        port,
        backend,
        tp.rank,
        tp.size,
        ep.rank,
        ep.size,
        moe_tp.rank,
        moe_tp.size,
    )
    return Replica(rank, layout, mapping, control, store, (host, port), backend)


@contextmanager
def patient_collectives() -> Iterator[None]:
    """Collectives on this rank's data-plane groups wait as long as the control group's for
    the duration: every rank compiles the same captured step at the same forward, then runs
    it (collectives included), and one rank may finish compiling minutes before another,
    longer than `--dist-timeout`, which otherwise bounds a collective's wait. Outside a
    replica (or on a torch without the setter) nothing changes."""
    from torch.distributed import distributed_c10d

    setter = getattr(distributed_c10d, "_set_pg_timeout", None)
    groups = list(_DATA_GROUPS) if setter is not None and dist.is_initialized() else []
    for group, _ in groups:
        setter(_CONTROL_TIMEOUT, group)
    try:
        yield
    finally:
        for group, timeout in groups:
            setter(timeout, group)


def destroy_replica() -> None:
    _DATA_GROUPS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
