# SPDX-License-Identifier: Apache-2.0
"""Parallel layout (`Mapping`) and the collectives the layers call."""

from runtime.distributed.collectives import all_gather_last_dim, all_reduce
from runtime.distributed.mapping import Mapping, ParallelGroup

__all__ = ["Mapping", "ParallelGroup", "all_reduce", "all_gather_last_dim"]
