# SPDX-License-Identifier: Apache-2.0
"""Every rank of a replica runs the forward rank 0 runs.

Rank 0 owns the scheduler, sampling and acceptance. Before each forward its runner hands
the `ModelInput` to a `BatchBroadcaster`, which sends one `ForwardMessage` on the control
channel: the input ids, per-request lengths and slots, the capture mode, the rows to score,
and what changed in the request-to-token table for the requests in the batch since the
last message (vLLM V1 sends new block ids per step the same way). Captured hidden states
travel as a reference (`HiddenRows`: rows of the latest target or draft output, which every
rank holds already); only an input without one ships the tensor. Cache-pool operations
outside a forward (the commit after a verify round, with the accepted lengths decided on
rank 0, the prefix cache's snapshot and page copies) go out as `PoolCommandMessage`s
carrying a typed `PoolCommand`, so every rank's caches change the same way. The other
ranks run a `FollowerLoop` that replays the messages on their own runners (their shard of
every layer) until `StopMessage`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from runtime.core.pool_commands import PoolCommand
from runtime.execution.model_runner import ModelInput, ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class TableUpdate:
    """Cells of the request-to-token table to set before the forward."""

    rows: torch.Tensor
    cols: torch.Tensor
    slots: torch.Tensor


@dataclass
class ForwardMessage:
    role: str
    inp: ModelInput
    table: TableUpdate | None
    step: int


@dataclass
class PoolCommandMessage:
    """`command` applied to the pool of the runner with `role` (its tensors on the CPU)."""

    role: str
    command: PoolCommand


@dataclass
class StopMessage:
    reason: str = "shutdown"


def _cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


class TableMirror:
    """What the other ranks' request-to-token tables hold, to send only the changes.

    Before a forward, the cells a request can read (positions below its sequence length)
    are compared with the copy; whoever wrote them (slot reservation, a prefix cache) the
    differences go out."""

    def __init__(self, req_to_token: torch.Tensor):
        self.table = req_to_token
        self.sent = req_to_token.clone()

    def updates(self, req_pool_indices: list[int], seq_lens: list[int]) -> TableUpdate | None:
        if not req_pool_indices:
            return None
        rows = torch.as_tensor(req_pool_indices, dtype=torch.long, device=self.table.device)
        width = min(max(seq_lens), self.table.shape[1])
        lens = torch.as_tensor(seq_lens, device=self.table.device).unsqueeze(1)
        live = torch.arange(width, device=self.table.device) < lens
        changed = (self.table[rows, :width] != self.sent[rows, :width]) & live
        which, cols = changed.nonzero(as_tuple=True)
        if which.numel() == 0:
            return None
        rows = rows[which]
        slots = self.table[rows, cols]
        self.sent[rows, cols] = slots
        return TableUpdate(rows.cpu(), cols.cpu(), slots.cpu())


class BatchBroadcaster:
    """Rank 0's side: one message per forward / commit, before rank 0 runs it.

    `in_flight` is true from a forward's message until rank 0's own forward returned: a
    failure in between leaves the other ranks inside that forward's collectives, so the
    replica can no longer continue (the engine treats it as fatal)."""

    def __init__(self, channel, req_to_token: torch.Tensor):
        self.channel = channel
        self.mirror = TableMirror(req_to_token)
        self.in_flight = False
        self.steps = 0

    @contextlib.contextmanager
    def forward(self, role: str, inp: ModelInput) -> Iterator[None]:
        seq_lens = [p + e for p, e in zip(inp.prefix_lens, inp.extend_lens)]
        table = self.mirror.updates(list(inp.req_pool_indices), seq_lens)
        shipped = inp
        if inp.hidden_rows is not None or inp.captured_hidden_states is not None:
            hidden = None if inp.hidden_rows is not None else _cpu(inp.captured_hidden_states)
            shipped = dataclasses.replace(inp, captured_hidden_states=hidden)
        shipped = dataclasses.replace(shipped, input_ids=_cpu(shipped.input_ids))
        self.steps += 1
        self.in_flight = True
        self.channel.send(ForwardMessage(role, shipped, table, self.steps))
        yield
        self.in_flight = False

    def pool_command(self, role: str, command: PoolCommand) -> None:
        self.in_flight = True  # a failed send leaves the ranks out of step too
        self.channel.send(PoolCommandMessage(role, command.on_host()))
        self.in_flight = False

    def stop(self, reason: str = "shutdown") -> None:
        self.channel.send(StopMessage(reason))


class FollowerLoop:
    """A non-zero rank: replay rank 0's messages on this rank's runners until told to stop.
    `on_progress(n)` is called after each forward (the heartbeat publishes it)."""

    def __init__(
        self,
        channel,
        runners: dict[str, ModelRunner],
        on_progress: Callable[[int], None] | None = None,
    ):
        self.channel, self.runners = channel, runners
        self.on_progress = on_progress
        self.hidden: dict[str, torch.Tensor | None] = {}
        self.forwards = 0

    def run(self) -> str:
        """Returns the reason rank 0 gave for stopping."""
        while True:
            message = self.channel.recv()
            if isinstance(message, StopMessage):
                return message.reason
            if isinstance(message, ForwardMessage):
                self._forward(message)
            elif isinstance(message, PoolCommandMessage):
                self.runners[message.role].apply(message.command, local=True)
            else:
                raise TypeError(f"unexpected control message {type(message).__name__}")

    @torch.inference_mode()
    def _forward(self, message: ForwardMessage) -> None:
        runner = self.runners[message.role]
        if message.table is not None:
            update = message.table
            device = runner.slot_table.req_to_token.device
            runner.slot_table.req_to_token[update.rows.to(device), update.cols.to(device)] = (
                update.slots.to(device)
            )
        inp = message.inp
        if inp.hidden_rows is not None:
            source = self.hidden.get(inp.hidden_rows.source)
            if source is None:
                raise RuntimeError(
                    f"rank 0 referred to the hidden states of the {inp.hidden_rows.source} "
                    "runner, but it has not produced any on this rank"
                )
            inp = dataclasses.replace(inp, captured_hidden_states=inp.hidden_rows.take(source))
        elif inp.captured_hidden_states is not None:
            inp = dataclasses.replace(
                inp, captured_hidden_states=inp.captured_hidden_states.to(runner.device)
            )
        out = runner.run(inp)
        self.hidden[message.role] = out.hidden_states
        self.forwards += 1
        if self.on_progress is not None:
            self.on_progress(self.forwards)
