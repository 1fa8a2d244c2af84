# SPDX-License-Identifier: Apache-2.0
"""The shape of one model replica over ranks (sizes only; the process groups are built by
`runtime.distributed.replica`).

A replica runs on `world = max(tp, ep)` ranks (SGLang's `--tp-size` / `--ep-size`):

* attention is split over `tp` consecutive ranks (heads, vocabulary, dense MLPs); with
  `tp < world` the attention groups repeat and compute the same thing;
* routed experts are split over `ep` ranks in contiguous blocks, and each expert's
  intermediate width over the remaining `moe_tp = world / ep` ranks (SGLang's
  `moe_tp_size = tp_size / ep_size`), so every rank of the replica holds a distinct piece
  of every MoE layer and the partial outputs are summed over the whole replica.
"""

from __future__ import annotations

from dataclasses import dataclass


def parse_address(address: str) -> tuple[str, int]:
    """`host:port` -> (host, port); ValueError naming the flag when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class ParallelLayout:
    """The sizes of one replica's layout and each rank's coordinates in it."""

    tp_size: int = 1
    ep_size: int = 1

    def __post_init__(self) -> None:
        tp, ep = self.tp_size, self.ep_size
        if tp < 1 or ep < 1:
            raise ValueError(f"--tp-size and --ep-size must be >= 1, got {tp} and {ep}")
        if max(tp, ep) % min(tp, ep):
            raise ValueError(
                f"--ep-size {ep} and --tp-size {tp}: the smaller must divide the larger "
                "(a replica runs on max(tp, ep) ranks)"
            )

    @property
    def world_size(self) -> int:
        return max(self.tp_size, self.ep_size)

    @property
    def moe_tp_size(self) -> int:
        return self.world_size // self.ep_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def ep_rank(self, rank: int) -> int:
        return rank // self.moe_tp_size

    def moe_tp_rank(self, rank: int) -> int:
        return rank % self.moe_tp_size

    def tp_groups(self) -> list[list[int]]:
        """Ranks of each attention tensor-parallel group."""
        w, tp = self.world_size, self.tp_size
        return [list(range(start, start + tp)) for start in range(0, w, tp)]

    def ep_groups(self) -> list[list[int]]:
        """Ranks holding the same slice of every expert, one per expert block."""
        return [list(range(i, self.world_size, self.moe_tp_size)) for i in range(self.moe_tp_size)]

    def moe_tp_groups(self) -> list[list[int]]:
        """Ranks holding the same experts, one per slice of the intermediate width."""
        m = self.moe_tp_size
        return [list(range(start, start + m)) for start in range(0, self.world_size, m)]
