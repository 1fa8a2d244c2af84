# SPDX-License-Identifier: Apache-2.0
"""Changes to a cache pool outside a forward, as values.

The prefix cache (snapshot save/restore, page copies) and the speculative worker (the
commit after a verify round) never call a pool directly: they hand a `PoolCommand` to the
runner that owns it (`ModelRunner.apply`). On rank 0 of a multi-rank replica the runner
first sends the command to the other ranks (`rank_sync.BatchBroadcaster.pool_command`),
which apply the same value to their own shard (`FollowerLoop`); `on_host` is the form
that travels (tensors on the CPU). Commands are frozen: the value sent is the value run.
Built and applied on the engine's loop thread (rank 0) or a follower's replay loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.core.kv_pool import KVPool


@dataclass(frozen=True)
class SaveSnapshot:
    """Copy request `req_pool_idx`'s state into snapshot `slot` (`verify_row`: the state
    after that verify row, see `KVPool.request_state`)."""

    req_pool_idx: int
    slot: int
    verify_row: int | None = None

    def apply(self, pool: KVPool) -> None:
        pool.save_snapshot(self.req_pool_idx, self.slot, self.verify_row)

    def on_host(self) -> SaveSnapshot:
        return self


@dataclass(frozen=True)
class RestoreSnapshot:
    """Copy snapshot `slot` back into request `req_pool_idx`'s state."""

    slot: int
    req_pool_idx: int

    def apply(self, pool: KVPool) -> None:
        pool.restore_snapshot(self.slot, self.req_pool_idx)

    def on_host(self) -> RestoreSnapshot:
        return self


@dataclass(frozen=True)
class CopyPages:
    """Copy the rows stored per token page from `src_pages` to `dst_pages`."""

    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]

    def apply(self, pool: KVPool) -> None:
        pool.copy_pages(list(self.src_pages), list(self.dst_pages))

    def on_host(self) -> CopyPages:
        return self


@dataclass(frozen=True)
class CommitVerified:
    """Keep each request's state after its `num_accepted` accepted drafts' verify row."""

    req_pool_indices: torch.Tensor
    num_accepted: torch.Tensor

    def apply(self, pool: KVPool) -> None:
        pool.commit_verified(self.req_pool_indices, self.num_accepted)

    def on_host(self) -> CommitVerified:
        return CommitVerified(self.req_pool_indices.cpu(), self.num_accepted.cpu())


PoolCommand = SaveSnapshot | RestoreSnapshot | CopyPages | CommitVerified
