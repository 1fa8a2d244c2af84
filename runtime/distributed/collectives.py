# SPDX-License-Identifier: Apache-2.0
"""Collectives over a `ParallelGroup`; identity when the group has one member.

Inside a captured step (`torch.compile`) they are PyTorch's functional collectives, which
dynamo traces into the graph (the in-place `torch.distributed` calls would break it); every
rank of a replica compiles and runs the same step in lockstep, so the collectives inside
the compiled graphs meet as the eager ones do."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from runtime.core.capture import compiling
from runtime.distributed.mapping import ParallelGroup


def all_reduce(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    if group.size == 1:
        return x
    if compiling():
        return funcol.all_reduce(x, "sum", group.group)
    dist.all_reduce(x, group=group.group)
    return x


def all_gather_last_dim(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    if group.size == 1:
        return x
    if compiling():
        # inductor's C++ wrapper cannot call the functional all-gather; a sum of each rank's
        # slice placed among zeros is the same gather (x + 0 is x exactly)
        zeros = x.new_zeros(x.shape)
        slices = [x if r == group.rank else zeros for r in range(group.size)]
        return funcol.all_reduce(torch.cat(slices, dim=-1), "sum", group.group)
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.group)
    return torch.cat(parts, dim=-1)
