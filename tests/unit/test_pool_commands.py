# SPDX-License-Identifier: Apache-2.0
"""Pool commands: each runs its pool method with its fields, and a follower rank replays
the command rank 0 sent on its own runner (`rank_sync`), with the same effect."""

from __future__ import annotations

import pickle

import torch

from runtime.core.pool_commands import CommitVerified, CopyPages, RestoreSnapshot, SaveSnapshot
from runtime.execution.rank_sync import BatchBroadcaster, FollowerLoop, PoolCommandMessage


class RecordingPool:
    def __init__(self):
        self.calls = []

    def save_snapshot(self, req_pool_idx, slot, verify_row=None):
        self.calls.append(("save_snapshot", req_pool_idx, slot, verify_row))

    def restore_snapshot(self, slot, req_pool_idx):
        self.calls.append(("restore_snapshot", slot, req_pool_idx))

    def copy_pages(self, src, dst):
        self.calls.append(("copy_pages", src, dst))

    def commit_verified(self, req_pool_indices, num_accepted):
        self.calls.append(("commit_verified", req_pool_indices.tolist(), num_accepted.tolist()))


class Runner:
    """A runner's command path: `ModelRunner.apply` without a model."""

    def __init__(self, broadcaster=None):
        self.kv_pool, self.broadcaster, self.role = RecordingPool(), broadcaster, "target"

    def apply(self, command, local=False):
        if self.broadcaster is not None and not local:
            self.broadcaster.pool_command(self.role, command)
        command.apply(self.kv_pool)


class Pipe:
    """A control channel in one process: what rank 0 sends, pickled, in order."""

    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(pickle.dumps(message))

    def recv(self):
        return pickle.loads(self.sent.pop(0))


COMMANDS = [
    SaveSnapshot(2, 1, verify_row=3),
    RestoreSnapshot(1, 0),
    CopyPages((4, 5), (6, 7)),
    CommitVerified(torch.tensor([0, 2]), torch.tensor([1, 3])),
]


def test_each_command_calls_its_pool_method():
    pool = RecordingPool()
    for command in COMMANDS:
        command.apply(pool)
    assert pool.calls == [
        ("save_snapshot", 2, 1, 3),
        ("restore_snapshot", 1, 0),
        ("copy_pages", [4, 5], [6, 7]),
        ("commit_verified", [0, 2], [1, 3]),
    ]


def test_a_follower_replays_what_rank_0_applied():
    pipe = Pipe()
    leader = Runner(BatchBroadcaster(pipe, torch.zeros(4, 8, dtype=torch.long)))
    follower = Runner()
    for command in COMMANDS:
        leader.apply(command)
    assert all(isinstance(pickle.loads(m), PoolCommandMessage) for m in pipe.sent)
    leader.broadcaster.stop("done")
    assert FollowerLoop(pipe, {"target": follower}).run() == "done"
    assert follower.kv_pool.calls == leader.kv_pool.calls
    assert not leader.broadcaster.in_flight
