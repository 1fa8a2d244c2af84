# SPDX-License-Identifier: Apache-2.0
"""The background compile thread (`CompileWorker`) stops when the process exits.

CPython 3.11 ends a daemon thread that is inside torch's C++ code at finalisation by
unwinding it, which aborts the process ("terminate called without an active exception",
SIGABRT): a script or server that exited while a step compiled in the background failed.
A stand-in compile (a loop of torch operators, each releasing the GIL in C++) reproduces
that from a plain daemon thread, and exits cleanly from a worker."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest

from runtime.execution.compile_worker import CompileWorker

REPO = Path(__file__).resolve().parents[2]

EXIT_MID_COMPILE = textwrap.dedent(
    """
    import sys, threading, time
    import torch
    from runtime.execution.compile_worker import CompileWorker

    started = threading.Event()

    def compile_step(_):
        a = torch.randn(256, 256)
        started.set()
        end = time.monotonic() + 60
        while time.monotonic() < end:  # torch operators, as a compile runs them
            a = torch.tanh(a @ a)

    if sys.argv[1] == "daemon thread":
        threading.Thread(target=compile_step, args=(0,), daemon=True).start()
    else:
        CompileWorker(compile_step).put(0)
    started.wait()
    time.sleep(0.2)
    print("exiting", flush=True)
    """
)


def exit_mid_compile(how: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", EXIT_MID_COMPILE, how],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, time.monotonic() - start


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14 no longer unwinds daemon threads")
def test_exiting_beside_a_plain_daemon_thread_in_torch_aborts():
    done, _ = exit_mid_compile("daemon thread")
    assert "exiting" in done.stdout
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-500:])


def test_exiting_while_a_worker_compiles_stops_it_and_exits_cleanly():
    done, seconds = exit_mid_compile("worker")
    assert "exiting" in done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
    assert seconds < 60  # the interrupted loop would have run a minute


def test_stop_interrupts_the_compile_in_flight_and_drops_the_queue():
    started, ran, ended = threading.Event(), [], []

    def compile_step(item):
        ran.append(item)
        started.set()
        try:
            while True:  # a long compile
                time.sleep(0.01)
        finally:
            ended.append(item)

    worker = CompileWorker(compile_step)
    for item in (1, 2, 3):
        worker.put(item)
    assert started.wait(10)
    worker.stop()
    assert worker.join(10)
    assert ran == [1] and ended == [1]  # interrupted, and nothing queued after it ran


def test_an_idle_worker_stops_and_a_stopped_one_takes_nothing():
    ran = []
    worker = CompileWorker(ran.append)
    worker.put("a")
    deadline = time.monotonic() + 10
    while not ran and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.stop()
    assert worker.join(10)
    worker.put("b")
    time.sleep(0.05)
    assert ran == ["a"]


def test_a_failing_compile_leaves_the_worker_serving():
    """The graph runner's compile keeps a failed capture eager itself; an error that escapes
    it still must not end the thread, or the steps queued after it would wait for good."""
    ran = []

    def compile_step(item):
        ran.append(item)
        if item == "bad":
            raise RuntimeError("capture failed")

    worker = CompileWorker(compile_step)
    for item in ("bad", "good"):
        worker.put(item)
    deadline = time.monotonic() + 10
    while len(ran) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran == ["bad", "good"]
    worker.stop()
    assert worker.join(10)


class Owner:
    """Stands in for a graph runner: its bound method is what the worker compiles with."""

    def __init__(self):
        self.compiled = []

    def compile(self, item):
        self.compiled.append(item)


def test_a_dropped_owner_is_collected_and_its_worker_ends():
    """The worker holds its owner weakly: a dropped engine's graph runner (and so its model
    and caches) is freed, and the thread ends, instead of living as long as the process."""
    owner = Owner()
    worker = CompileWorker(owner.compile)
    worker.put("step")
    deadline = time.monotonic() + 10
    while not owner.compiled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert owner.compiled == ["step"]
    alive = weakref.ref(owner)
    del owner
    gc.collect()
    assert alive() is None
    assert worker.join(10)


class SlowOwner:
    """An owner whose item waits for `release`: dropped by its caller meanwhile, its last
    reference goes when the worker finishes the item, in the worker's own thread."""

    def __init__(self, started: threading.Event, release: threading.Event):
        self.started, self.release = started, release

    def compile(self, item):
        self.started.set()
        assert self.release.wait(10)


def test_an_owner_collected_in_the_worker_thread_ends_it_quietly(monkeypatch):
    """The collection then runs `stop` in the worker's thread, which must not raise the
    interrupt into itself (an exception ignored in the finalizer, before)."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    started, release = threading.Event(), threading.Event()
    owner = SlowOwner(started, release)
    worker = CompileWorker(owner.compile)
    worker.put("step")
    assert started.wait(10)
    alive = weakref.ref(owner)
    del owner
    gc.collect()
    assert alive() is not None  # the item in flight holds it
    release.set()
    assert worker.join(10)
    assert alive() is None
    assert not unraisable, [u.exc_value for u in unraisable]
