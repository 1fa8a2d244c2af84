# SPDX-License-Identifier: Apache-2.0
"""A server stopped while it compiles a captured step exits within its grace period, and
every process it started (C++ compilers, inductor's compile-worker pool) ends with it.

Captured steps are on for these servers only (tests/conftest.py turns them off), with an
empty cache directory, so a step really compiles, in compiler subprocesses. The oracle is
`/proc`: the server leads a process group of its own, which its descendants inherit; each
process seen in it while the server ran, and any process left in the group, must be gone
(or a zombie, already exited) once the server has."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.server.conftest import serve

GRACE_S = 2
# the grace, uvicorn's drain of aborted requests, the children's SIGTERM-to-SIGKILL grace
# and start-up slack: a bound on a hang, not a timing
EXIT_BOUND_S = GRACE_S + 5 + 5 + 20
CHILD_WAIT_S = 180  # for the first compiler process (tracing the step comes first)


def process_table() -> dict[int, tuple[str, int, int, str]]:
    """pid -> (state, process group, start time, name) of every process."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        comm = text[text.index("(") + 1 : text.rindex(")")]
        table[int(name)] = (fields[0], int(fields[2]), int(fields[19]), comm)
    return table


def group_members(group: int, leader: int) -> dict[int, tuple[int, str]]:
    """The running processes of process group `group` other than `leader`, by pid: (start
    time, name)."""
    return {
        pid: (start, comm)
        for pid, (state, pgid, start, comm) in process_table().items()
        if pgid == group and pid != leader and state != "Z"
    }


def still_running(seen: dict[int, tuple[int, str]]) -> dict[int, str]:
    table = process_table()
    return {
        pid: comm
        for pid, (start, comm) in seen.items()
        if pid in table and table[pid][2] == start and table[pid][0] != "Z"
    }


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads Linux's /proc")
@pytest.mark.parametrize(
    "mode, sig, status",
    [
        # uvicorn raises the signal again once shut down: the process dies by it
        ("background", signal.SIGTERM, -signal.SIGTERM),
        ("background", signal.SIGINT, -signal.SIGINT),
        # stopped while it compiles at start-up: it unwinds and exits 128 + SIGTERM
        ("startup", signal.SIGTERM, 128 + signal.SIGTERM),
    ],
)
def test_children_end_with_a_server_stopped_mid_compile(
    served_checkpoint, tmp_path, mode, sig, status
):
    env = {
        "NEXTN_DISABLE_CUDA_GRAPH": None,
        "NEXTN_CACHE_DIR": str(tmp_path / "cache"),
        "TORCHINDUCTOR_CACHE_DIR": None,
        "TRITON_CACHE_DIR": None,
    }
    flags = ["--cuda-graph-bs", "1", "--graceful-shutdown-timeout", str(GRACE_S)]
    flags += ["--capture-compile", mode, "--log-level", "info"]
    # `startup` compiles before it serves: stopped while it starts
    server = serve(
        served_checkpoint,
        *flags,
        env=env,
        new_session=True,
        wait=mode == "background",
        log_path=tmp_path / "server.log",
    )
    group = server.proc.pid
    try:
        if mode == "background":  # served eagerly while its decode step compiles
            server.generate("hello", {"max_new_tokens": 4, "temperature": 0})
        seen: dict[int, tuple[int, str]] = {}
        deadline = time.time() + CHILD_WAIT_S
        while not (running := group_members(group, group)):
            assert server.proc.poll() is None, server.output()
            assert time.time() < deadline, f"no compiler process started\n{server.output()}"
            time.sleep(0.05)
        seen.update(running)
        server.proc.send_signal(sig)
        # a descendant started meanwhile counts too
        while server.proc.poll() is None and time.time() < deadline:
            seen.update(group_members(group, group))
            time.sleep(0.05)
        server.proc.wait(timeout=EXIT_BOUND_S)
        assert server.proc.returncode == status, server.output()
        assert not still_running(seen), (seen, server.output())
        assert not group_members(group, group), server.output()
    finally:
        server.log.close()
        if server.proc.poll() is None:
            server.proc.kill()
        try:  # what a failure left of the group this test started
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.proc.wait()
