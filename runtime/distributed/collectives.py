# SPDX-License-Identifier: Apache-2.0
"""Collectives over a `ParallelGroup`; identity when the group has one member."""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.distributed.mapping import ParallelGroup


def all_reduce(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    if group.size == 1:
        return x
    dist.all_reduce(x, group=group.group)
    return x


def all_gather_last_dim(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    if group.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.group)
    return torch.cat(parts, dim=-1)
