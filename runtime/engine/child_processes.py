# SPDX-License-Identifier: Apache-2.0
"""The processes a server starts end with it.

A server's descendants: the C++ compiler processes a captured step's compile runs (`g++`,
`cc1plus`, `ld`; a compile thread waits on them), inductor's compile-worker pool (a sidecar
process, `torch/_inductor/compile_worker`, and its workers), the other ranks of a replica.
uvicorn ends a server stopped by SIGTERM by raising the signal again once its shutdown is
done, which kills the process without running `atexit` handlers (the compile threads' stop,
inductor's pool shutdown): a compiler process then ran on for seconds after the server had
exited. So the server ends them itself (`end_compiles_and_children`) at the end of its
shutdown, and as a child subreaper (`adopt_orphans`) it still finds the processes whose own
parent ended first (a compiler whose pool worker was stopped), which would otherwise have
become init's. The walk reads Linux's `/proc`; elsewhere there is nothing to end.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

from runtime.execution import compile_worker

logger = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
END_GRACE_S = 5.0  # SIGTERM, then SIGKILL for what is still running after this long
KILL_WAIT_S = 2.0  # how long the SIGKILLed processes get to disappear
POOL_SHUTDOWN_S = 2.0  # inductor's own pool shutdown, before its processes are ended
WORKER_JOIN_S = 5.0  # a compile thread ends once the compiler it waited on is gone
POLL_S = 0.05


def adopt_orphans() -> bool:
    """Make this process the subreaper of its descendants (`prctl(PR_SET_CHILD_SUBREAPER)`,
    Linux): one whose parent ends before it becomes this process's child, not init's.
    False where the platform has no such call."""
    if not os.path.isdir("/proc/self"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of `pid` from /proc, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and ")"
    return fields[0], int(fields[1])


def descendants(root: int | None = None) -> list[int]:
    """The running (not yet exited) descendants of `root` (default this process)."""
    root = os.getpid() if root is None else root
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for pid in pids:
        stat = _stat(pid)
        if stat is not None and stat[0] != "Z":
            children.setdefault(stat[1], []).append(pid)
    found, frontier = [], [root]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found += kids
        frontier += kids
    return found


def end_descendants(grace_s: float = END_GRACE_S) -> list[int]:
    """SIGTERM every descendant (again for each one that appears meanwhile: an orphan
    adopted, a process just started), SIGKILL what still runs after `grace_s`; returns
    the pids signalled. The adopted ones are reaped here (no `Popen` waits for them)."""
    me = os.getpid()
    signalled: set[int] = set()
    adopted: set[int] = set()  # not started by this process: nobody here reaps them
    killing_from = time.monotonic() + grace_s
    give_up = killing_from + KILL_WAIT_S
    while (alive := descendants()) and time.monotonic() < give_up:
        kill = time.monotonic() >= killing_from
        for pid in alive:
            if pid not in signalled and (stat := _stat(pid)) is not None and stat[1] != me:
                adopted.add(pid)
            if kill or pid not in signalled:
                try:
                    os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
                except ProcessLookupError:
                    continue
                signalled.add(pid)
        time.sleep(POLL_S)
        _reap(adopted)
    _reap(adopted)
    if alive:
        logger.warning("child processes still running at exit: %s", alive)
    return sorted(signalled)


def _reap(pids: set[int]) -> None:
    for pid in list(pids):
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                pids.discard(pid)
        except ChildProcessError:  # not (yet) this process's child, or reaped
            pass


def shut_down_compile_pools(timeout: float = POOL_SHUTDOWN_S) -> None:
    """Inductor's compile-worker pools shut down their own way (the sidecar ends its
    workers), for at most `timeout` seconds: a sidecar still starting reads the request
    only once it has imported torch, and `end_descendants` ends what is left."""
    if "torch._inductor.async_compile" not in sys.modules:
        return  # nothing compiled, no pool
    from torch._inductor.async_compile import shutdown_compile_workers

    thread = threading.Thread(target=shutdown_compile_workers, name="pool-shutdown", daemon=True)
    thread.start()
    thread.join(timeout)


def end_compiles_and_children(grace_s: float = END_GRACE_S) -> list[int]:
    """At a server's exit: stop the compile threads (no further step, the one in flight
    interrupted), shut inductor's compile pools down, end every descendant process, then
    wait briefly for the threads, which end once the compilers they waited on are gone.
    Returns the pids that had to be signalled."""
    workers = compile_worker.stop_workers()
    shut_down_compile_pools()
    ended = end_descendants(grace_s)
    compile_worker.join_workers(workers, WORKER_JOIN_S)
    return ended
