# SPDX-License-Identifier: Apache-2.0
"""Rank 0 -> every rank: one picklable message at a time over the replica's gloo control
group (SGLang's `broadcast_pyobj` over its CPU group). Tensors inside a message must be on
the CPU."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class ControlChannel:
    def __init__(self, group: Any, src: int = 0):
        self.group, self.src = group, src

    def send(self, message: Any) -> None:
        dist.broadcast_object_list([message], src=self.src, group=self.group)

    def recv(self) -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]
