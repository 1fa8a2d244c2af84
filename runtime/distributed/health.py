# SPDX-License-Identifier: Apache-2.0
"""Noticing a rank that died or hung, within a bounded time.

Every rank runs a `Heartbeat` thread that bumps a counter under `nextn/heartbeat/<rank>` in
the rendezvous `TCPStore` once per `interval` (with the number of forwards it finished).
Rank 0 runs a `Watchdog`: a local rank whose process exited is reported at once (with its
exit code or signal), any rank whose counter stops moving for `timeout` seconds after that
(hung, stopped, or its machine gone). The other ranks run a `LeaderWatch` on rank 0's
counter, so a replica whose rank 0 is gone winds down instead of waiting forever. Both call
`on_failure(message)` once, with the rank named. Heartbeats run on their own store
connection and thread, so a rank busy in a long forward keeps beating.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

KEY = "nextn/heartbeat/{rank}"


def _connect(address: tuple[str, int], timeout_s: float) -> Any:
    host, port = address
    return dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class Heartbeat:
    """Beats for `rank` until `stop()`; `progress` is published with every beat."""

    def __init__(self, address: tuple[str, int], rank: int, interval: float = 1.0):
        self.address, self.rank, self.interval = address, rank, interval
        self.progress = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            store = _connect(self.address, timeout_s=max(10.0, 5 * self.interval))
            beat = 0
            while not self._stop.is_set():
                beat += 1
                store.set(KEY.format(rank=self.rank), f"{beat}:{self.progress}")
                self._stop.wait(self.interval)
        except Exception as err:  # noqa: BLE001 - the watchers report the silence
            logger.warning("rank %d stopped beating: %s", self.rank, err)


class _Watcher:
    def __init__(
        self,
        address: tuple[str, int],
        timeout: float,
        on_failure: Callable[[str], None],
        interval: float,
    ):
        self.address, self.timeout, self.on_failure = address, timeout, on_failure
        self.interval = interval
        self._stop = threading.Event()
        self._fired = False
        self._thread = threading.Thread(target=self._guarded, name=type(self).__name__, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _fail(self, message: str) -> None:
        if not self._fired and not self._stop.is_set():
            self._fired = True
            self.on_failure(message)

    def _guarded(self) -> None:
        try:
            self._run()
        except Exception as err:  # noqa: BLE001 - losing the store is itself the failure
            self._fail(f"lost the rendezvous store at {self.address[0]}:{self.address[1]}: {err}")

    def _run(self) -> None:
        raise NotImplementedError


class _Beats:
    """When each watched rank's counter last moved (this process's clock)."""

    def __init__(self, store: Any, ranks: list[int]):
        self.store, self.seen = store, {}
        now = time.monotonic()
        self.changed = dict.fromkeys(ranks, now)

    def stale(self, timeout: float) -> list[tuple[int, float]]:
        now = time.monotonic()
        keys = [KEY.format(rank=r) for r in self.changed]
        present = self.store.check(keys) if keys else True
        for rank in self.changed:
            key = KEY.format(rank=rank)
            if present or self.store.check([key]):
                value = self.store.get(key)
                if value != self.seen.get(rank):
                    self.seen[rank], self.changed[rank] = value, now
        return [(r, now - t) for r, t in self.changed.items() if now - t > timeout]

    def progress(self, rank: int) -> int | None:
        value = self.seen.get(rank)
        return None if value is None else int(value.split(b":")[1])


class Watchdog(_Watcher):
    """Rank 0's view of the other ranks: `local` maps a rank to its process (a
    `multiprocessing.Process`) when it runs on this machine."""

    def __init__(
        self,
        address: tuple[str, int],
        world_size: int,
        local: dict[int, Any],
        timeout: float,
        on_failure: Callable[[str], None],
        interval: float = 0.5,
    ):
        super().__init__(address, timeout, on_failure, interval)
        self.world_size, self.local = world_size, local

    def _run(self) -> None:
        store = _connect(self.address, timeout_s=max(10.0, self.timeout))
        beats = _Beats(store, list(range(1, self.world_size)))
        while not self._stop.wait(self.interval):
            for rank, proc in self.local.items():
                if proc.exitcode is not None:
                    self._fail(f"rank {rank} (pid {proc.pid}) {describe_exit(proc.exitcode)}")
                    return
            stale = beats.stale(self.timeout)
            if stale:
                rank, silent = stale[0]
                self._fail(
                    f"rank {rank} sent no heartbeat for {silent:.0f} s (hung, stopped or "
                    "unreachable)"
                )
                return


class LeaderWatch(_Watcher):
    """A follower's view of rank 0."""

    def __init__(
        self,
        address: tuple[str, int],
        timeout: float,
        on_failure: Callable[[str], None],
        interval: float = 1.0,
    ):
        super().__init__(address, timeout, on_failure, interval)

    def _run(self) -> None:
        store = _connect(self.address, timeout_s=max(10.0, self.timeout))
        beats = _Beats(store, [0])
        while not self._stop.wait(self.interval):
            stale = beats.stale(self.timeout)
            if stale:
                self._fail(f"rank 0 sent no heartbeat for {stale[0][1]:.0f} s")
                return
