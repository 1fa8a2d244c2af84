# SPDX-License-Identifier: Apache-2.0
"""Where this process sits in the parallel layout.

Layers never read global state to learn their shard: they are handed a `ParallelGroup`
(rank, size and the torch.distributed group, if any) through the model's `Mapping`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParallelGroup:
    """One parallel dimension: this process is `rank` of `size`; `group` is the process group."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid parallel group: rank {self.rank} of size {self.size}")


@dataclass(frozen=True)
class AttentionMapping:
    tp: ParallelGroup = field(default_factory=ParallelGroup)

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def tp_size(self) -> int:
        return self.tp.size


@dataclass(frozen=True)
class MoEMapping:
    ep: ParallelGroup = field(default_factory=ParallelGroup)

    @property
    def ep_rank(self) -> int:
        return self.ep.rank

    @property
    def ep_size(self) -> int:
        return self.ep.size


@dataclass(frozen=True)
class Mapping:
    """Attention tensor parallelism and MoE expert parallelism for one process."""

    attn: AttentionMapping = field(default_factory=AttentionMapping)
    moe: MoEMapping = field(default_factory=MoEMapping)

    @classmethod
    def single(cls) -> Mapping:
        return cls()

    @classmethod
    def for_ranks(
        cls,
        tp_rank: int = 0,
        tp_size: int = 1,
        ep_rank: int = 0,
        ep_size: int = 1,
        tp_group: Any = None,
        ep_group: Any = None,
    ) -> Mapping:
        return cls(
            attn=AttentionMapping(ParallelGroup(tp_rank, tp_size, tp_group)),
            moe=MoEMapping(ParallelGroup(ep_rank, ep_size, ep_group)),
        )
