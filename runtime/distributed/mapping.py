# SPDX-License-Identifier: Apache-2.0
"""Where this process sits in the parallel layout.

Layers never read global state to learn their shard: they are handed a `ParallelGroup`
(rank, size and the torch.distributed group, if any) through the model's `Mapping`.

The layout of a replica (which ranks split attention, which split experts) is
`runtime.configs.parallel.ParallelLayout`; `runtime.distributed.replica.init_replica` turns it
into this process's `Mapping`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.configs.parallel import ParallelLayout

__all__ = ["AttentionMapping", "Mapping", "MoEMapping", "ParallelGroup", "ParallelLayout"]


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
    """`ep` splits the routed experts, `tp` each expert's intermediate width; `combine` is
    the group whose partial outputs add up to the layer's output (the whole replica)."""

    ep: ParallelGroup = field(default_factory=ParallelGroup)
    tp: ParallelGroup = field(default_factory=ParallelGroup)
    combine: ParallelGroup = field(default_factory=ParallelGroup)

    @property
    def ep_rank(self) -> int:
        return self.ep.rank

    @property
    def ep_size(self) -> int:
        return self.ep.size


@dataclass(frozen=True)
class Mapping:
    """Attention tensor parallelism and MoE expert / tensor parallelism for one process."""

    attn: AttentionMapping = field(default_factory=AttentionMapping)
    moe: MoEMapping = field(default_factory=MoEMapping)
    world: ParallelGroup = field(default_factory=ParallelGroup)

    @classmethod
    def single(cls) -> Mapping:
        return cls()

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def is_parallel(self) -> bool:
        return self.world.size > 1

    @property
    def moe_reduction_spans_tp(self) -> bool:
        """A shared expert split over attention TP can add its partial sums into the routed
        experts' all-reduce (one collective per MoE layer, as SGLang does): the two groups
        are the same ranks."""
        return self.attn.tp.size == self.moe.combine.size

    @classmethod
    def for_layout(cls, layout: ParallelLayout, rank: int) -> Mapping:
        """Rank `rank`'s shard coordinates without process groups: enough to build and load
        that rank's shard of a model (its collectives need `init_replica`'s groups)."""

        def coord(index: int, size: int) -> ParallelGroup:
            return ParallelGroup(index, size)

        w = layout.world_size
        return cls(
            attn=AttentionMapping(coord(layout.tp_rank(rank), layout.tp_size)),
            moe=MoEMapping(
                ep=coord(layout.ep_rank(rank), layout.ep_size),
                tp=coord(layout.moe_tp_rank(rank), layout.moe_tp_size),
                combine=coord(rank, w),
            ),
            world=coord(rank, w),
        )

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
        """A layout with attention TP and expert parallelism over the same ranks (no groups
        are created here: pass them, or use `runtime.distributed.init_replica`)."""
        return cls(
            attn=AttentionMapping(ParallelGroup(tp_rank, tp_size, tp_group)),
            moe=MoEMapping(
                ep=ParallelGroup(ep_rank, ep_size, ep_group),
                combine=ParallelGroup(ep_rank, ep_size, ep_group),
            ),
        )
