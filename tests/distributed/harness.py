# SPDX-License-Identifier: Apache-2.0
"""Run a function on every rank of a replica: spawned processes on gloo (CPU), rendezvous
on a free loopback port. Rank 0's return value comes back through a file."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.multiprocessing as mp

from runtime.distributed import ParallelLayout
from runtime.distributed.replica import destroy_replica, init_replica
from tests.server_process import free_port


def _rank_main(rank: int, layout: ParallelLayout, port: int, out: str, fn, args) -> None:
    torch.set_num_threads(1)
    replica = init_replica(layout, rank, ("127.0.0.1", port), "gloo", timeout_s=120)
    try:
        result = fn(replica, *args)
        if rank == 0:
            torch.save(result, out)
    finally:
        destroy_replica()


def run_ranks(layout: ParallelLayout, fn, *args):
    """`fn(replica, *args)` on every rank of `layout`; returns rank 0's result. `fn` must be
    importable (spawned processes pickle it by name)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.spawn(_rank_main, args=(layout, free_port(), out, fn, args), nprocs=layout.world_size)
        return torch.load(out, weights_only=False)
