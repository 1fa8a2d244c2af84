# SPDX-License-Identifier: Apache-2.0
"""`KVPool`: what the runtime calls on a model's cache pool, whatever its family.

A model builds its pool (`create_cache_pool`); the `ModelRunner` owns it and hands it to
every forward as `ForwardContext.kv_pool`. The family-independent part is this protocol:
per-forward addressing (`prepare`, and `prepare_in_step` inside a captured step), the
commit after a verify round, and the prefix cache's needs (share alignment, per-request
state and its snapshots, page copies). Layers of one family reach that family's typed
accessors (`DeepseekV4KVPool`, `Qwen4ExpKVPool`) by narrowing the type; nothing else
does. Every change to a pool outside a forward goes through a `PoolCommand`
(`pool_commands`), so a multi-rank replica makes it on every rank. Pools are touched on
the engine's loop thread only.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class KVPool(Protocol):
    capturable: bool  # uniform batches have fixed-shape metadata (captured steps)

    def prepare(self, ctx: Any, /) -> Any:
        """The addressing every layer of the forward over `ctx` (a `ForwardContext`) reads."""

    def prepare_in_step(self, ctx: Any, like: Any) -> Any:
        """`prepare` inside a captured step, from tensors alone, laid out like `like`."""

    def commit_verified(self, req_pool_indices: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Keep each request's state after its accepted verify rows."""

    def share_alignment(self) -> int:
        """The page multiple a shared prefix must end on."""

    def request_state(self, req_pool_idx: int, verify_row: int | None = None) -> list:
        """Views of the request's rows in every per-request buffer."""

    def allocate_snapshots(self, num_slots: int) -> None: ...

    def save_snapshot(
        self, req_pool_idx: int, slot: int, verify_row: int | None = None
    ) -> None: ...

    def restore_snapshot(self, slot: int, req_pool_idx: int) -> None: ...

    def copy_pages(self, src_pages: list[int], dst_pages: list[int]) -> None: ...

    def snapshot_nbytes(self) -> int: ...

    def nbytes(self) -> int: ...

    def describe(self) -> str: ...
