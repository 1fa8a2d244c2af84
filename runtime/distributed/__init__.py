# SPDX-License-Identifier: Apache-2.0
"""Parallel layout (`Mapping`), the collectives the layers call, and joining a replica
(rendezvous, process groups, the control channel and rank health)."""

from runtime.distributed.collectives import all_gather_last_dim, all_reduce
from runtime.distributed.mapping import Mapping, ParallelGroup, ParallelLayout

__all__ = ["Mapping", "ParallelGroup", "ParallelLayout", "all_reduce", "all_gather_last_dim"]
