# SPDX-License-Identifier: Apache-2.0
"""The background compile thread runs at a lower priority than serving (a higher
niceness), where the OS schedules threads by it: on a shared core a cold compile (its C++
compiler processes inherit the niceness) otherwise halves the serving thread's speed."""

import os
import threading

import pytest

from runtime.execution.compile_worker import COMPILE_NICENESS, lower_thread_priority

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no thread niceness")


def niceness_after(increment: int) -> tuple[int, int]:
    """(before, after) niceness of a fresh thread that lowers its priority by `increment`."""
    seen = []

    def run():
        tid = threading.get_native_id()
        seen.append(os.getpriority(os.PRIO_PROCESS, tid))
        lower_thread_priority(increment)
        seen.append(os.getpriority(os.PRIO_PROCESS, tid))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0], seen[1]


def test_the_compile_thread_alone_gets_the_lower_priority():
    before, after = niceness_after(COMPILE_NICENESS)
    assert COMPILE_NICENESS > 0
    assert after == min(before + COMPILE_NICENESS, 19)
    # the calling (serving) thread keeps its own
    me = threading.get_native_id()
    assert os.getpriority(os.PRIO_PROCESS, me) == before
    assert niceness_after(0)[1] == before
