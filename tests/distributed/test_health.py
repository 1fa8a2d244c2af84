# SPDX-License-Identifier: Apache-2.0
"""Rank health over a real rendezvous store (in this process): a rank whose heartbeat stops
is named after the timeout, a local rank whose process exited is named at once with its
signal, and rank 0 going silent is noticed by the others."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from runtime.distributed.health import Heartbeat, LeaderWatch, Watchdog
from tests.distributed.harness import free_port


@dataclass
class FakeProcess:
    pid: int
    exitcode: int | None = None


def store_at_free_port():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10), wait_for_workers=False)
    return store, ("127.0.0.1", port)


def wait_for(event: threading.Event, seconds: float) -> float:
    start = time.monotonic()
    assert event.wait(seconds), "the watcher never fired"
    return time.monotonic() - start


def test_a_silent_rank_is_named_after_the_timeout():
    store, address = store_at_free_port()
    beats = [Heartbeat(address, rank, interval=0.1).start() for rank in (1, 2)]
    messages, fired = [], threading.Event()
    watchdog = Watchdog(
        address,
        3,
        {},
        timeout=1.0,
        on_failure=lambda m: (messages.append(m), fired.set()),
        interval=0.1,
    ).start()
    time.sleep(1.5)
    assert not fired.is_set()  # both beating
    beats[1].stop()  # rank 2 goes quiet
    took = wait_for(fired, 5.0)
    watchdog.stop()
    beats[0].stop()
    assert 0.8 < took < 3.0
    assert messages == [messages[0]] and messages[0].startswith("rank 2 sent no heartbeat")
    del store


def test_a_dead_local_rank_is_named_at_once():
    store, address = store_at_free_port()
    beat = Heartbeat(address, 1, interval=0.1).start()
    child = FakeProcess(pid=4242)
    messages, fired = [], threading.Event()
    watchdog = Watchdog(
        address,
        2,
        {1: child},
        timeout=30.0,
        on_failure=lambda m: (messages.append(m), fired.set()),
        interval=0.1,
    ).start()
    time.sleep(0.3)
    child.exitcode = -9
    assert wait_for(fired, 2.0) < 1.0
    watchdog.stop()
    beat.stop()
    assert messages == ["rank 1 (pid 4242) killed by signal SIGKILL"]
    del store


def test_the_other_ranks_notice_rank_0_going_silent():
    store, address = store_at_free_port()
    leader = Heartbeat(address, 0, interval=0.1).start()
    messages, fired = [], threading.Event()
    watch = LeaderWatch(
        address, timeout=1.0, on_failure=lambda m: (messages.append(m), fired.set()), interval=0.1
    ).start()
    time.sleep(1.2)
    assert not fired.is_set()
    leader.stop()
    wait_for(fired, 5.0)
    watch.stop()
    assert messages[0].startswith("rank 0 sent no heartbeat")
    del store
