# SPDX-License-Identifier: Apache-2.0
"""`CompileWorker`: the thread a graph runner compiles its steps on in the background.

The thread is a daemon, so a process never waits for compiles it no longer needs. But
CPython 3.11 finalises a process by ending each daemon thread that next wants the GIL with
`pthread_exit`, which unwinds the thread's stack; with torch's C++ frames on that stack
the unwinding ends in `std::terminate`. A script or a server that exited while a step
compiled aborted with "terminate called without an active exception" and exit status 134.

So before finalisation (`atexit` handlers run first) every worker is stopped: it takes no
further step, the compile in flight is interrupted by an exception raised in its thread at
the thread's next Python bytecode (the C API's `PyThreadState_SetAsyncExc`), and the exit
waits for the thread to end, at most `EXIT_WAIT_S`. A thread blocked in native code (a C++
compiler subprocess, a wait on inductor's compile pool) takes the exception when that
returns, seconds later.
"""

from __future__ import annotations

import atexit
import ctypes
import inspect
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

# Compiles run at this much lower priority than serving: on a machine with few cores the
# compile thread otherwise takes half of the serving thread's core.
COMPILE_NICENESS = 10
EXIT_WAIT_S = 60.0  # how long an exiting process waits for an interrupted compile to end
EXIT_NOTICE_S = 1.0  # after this, the wait is logged

Item = TypeVar("Item")
_STOP = object()  # queued by `stop`: wakes an idle thread


class CompileAbandoned(BaseException):  # noqa: N818 -- a stop signal, like SystemExit
    """Raised inside a worker's thread to end its compile at exit. A `BaseException`, so
    the `except Exception` that keeps a failed capture eager does not swallow it."""


def lower_thread_priority(increment: int) -> None:
    """Raise the calling thread's niceness by `increment` where the OS schedules threads by
    it (Linux); elsewhere leave it."""
    if not increment or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
    except OSError as err:  # not permitted, or no such scheduling on this platform
        logger.debug("compile thread keeps its priority: %s", err)


def raise_in_thread(thread: threading.Thread, exc_type: type[BaseException]) -> None:
    """Schedule `exc_type` in the started `thread`, raised at its next bytecode."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(exc_type)
    )


class CompileWorker(Generic[Item]):
    """A daemon thread that runs `compile_fn` on each item put to it, in order, at lower
    priority (`COMPILE_NICENESS`), and stops cleanly when the process exits.

    A bound `compile_fn` is held weakly and its object's collection stops the worker: the
    thread would otherwise keep a dropped engine's graph runner, and with it the model and
    its caches, alive for the rest of the process. So no reference to the owner outlives a
    compile in the thread (the items queued and not compiled yet hold theirs)."""

    def __init__(self, compile_fn: Callable[[Item], None], name: str = "capture"):
        if inspect.ismethod(compile_fn):
            self._compile_fn: Callable[[], Callable | None] = weakref.WeakMethod(compile_fn)
            weakref.finalize(compile_fn.__self__, self.stop)
        else:
            self._compile_fn = lambda: compile_fn
        self._queue: queue.Queue = queue.Queue()
        # orders `busy` against `stop`; re-entrant because a collection of the owner can
        # run `stop` in this worker's own thread
        self._lock = threading.RLock()
        self._busy = self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        _register(self)
        self._thread.start()

    def put(self, item: Item) -> None:
        self._queue.put(item)

    def _loop(self) -> None:
        lower_thread_priority(COMPILE_NICENESS)
        try:
            while (item := self._queue.get()) is not _STOP:
                with self._lock:
                    if self._stopping:
                        return
                    self._busy = True
                try:
                    if (compile_fn := self._compile_fn()) is None:
                        return  # the owner is gone
                    compile_fn(item)
                except Exception:  # the steps queued after it still compile
                    logger.exception("background compile failed")
                finally:
                    compile_fn = item = None  # nothing of the owner's while idle
                    with self._lock:
                        self._busy = False
        except CompileAbandoned:
            logger.info("background compile stopped")

    def stop(self) -> None:
        """Take no further item, and interrupt the one in flight."""
        with self._lock:
            self._stopping = True
            # a collection of the owner inside the worker's own item runs this in that
            # thread: the item then ends by itself, and the loop after it
            if self._busy and threading.current_thread() is not self._thread:
                raise_in_thread(self._thread, CompileAbandoned)
        self._queue.put(_STOP)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; True if it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


_workers: weakref.WeakSet[CompileWorker] = weakref.WeakSet()
_registered = False


def _register(worker: CompileWorker) -> None:
    global _registered
    _workers.add(worker)
    if not _registered:
        # atexit runs its handlers last-registered first: register after inductor's own
        # (its compile pool's shutdown) so the workers stop while that pool still serves
        import torch._inductor.async_compile  # noqa: F401

        atexit.register(stop_all, EXIT_WAIT_S)
        _registered = True


def stop_workers() -> list[CompileWorker]:
    """Stop every live worker (no further item, the compile in flight interrupted) without
    waiting; returns them, for `join_workers`."""
    workers = list(_workers)
    for worker in workers:
        worker.stop()
    return workers


def join_workers(workers: list[CompileWorker], timeout: float) -> bool:
    """Wait up to `timeout` seconds for all of `workers` to end; True if they have."""
    deadline = time.monotonic() + timeout
    noticed = False
    for worker in workers:
        if not noticed and not worker.join(min(EXIT_NOTICE_S, timeout)):
            logger.warning("waiting up to %.0f s for a background compile to stop", timeout)
            noticed = True
        if not worker.join(max(0.0, deadline - time.monotonic())):
            return False
    return True


def stop_all(timeout: float = EXIT_WAIT_S) -> None:
    """Stop every live worker and wait up to `timeout` seconds for all."""
    if not join_workers(stop_workers(), timeout):
        logger.warning("a background compile did not stop; the exit may abort")
