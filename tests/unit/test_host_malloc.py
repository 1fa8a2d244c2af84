# SPDX-License-Identifier: Apache-2.0
"""`runtime.engine.host_malloc`: after `keep_freed_memory`, glibc serves a large tensor from
its heap (no fresh `mmap` whose pages fault in again on every use) and keeps the memory
after `free`; `NEXTN_DISABLE_MALLOC_TUNING=1` leaves glibc as it is. Each case runs in a
fresh interpreter, since the settings are process-wide. glibc's own counters
(`mallinfo2`: bytes in mmapped blocks, bytes of the main heap) are the oracle."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, ctypes.util, json
import torch
from runtime.engine.host_malloc import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_memory()
before = libc.mallinfo2()
x = torch.ones(16 << 20)  # 64 MiB: above glibc's largest dynamic mmap threshold
during = libc.mallinfo2()
del x
after = libc.mallinfo2()
print(json.dumps({
    "applied": applied,
    "mmapped_growth": during.hblkhd - before.hblkhd,
    # bytes of the heap in use: the arena itself may grow by less than the tensor where it
    # already held free chunks before the allocation
    "heap_used_growth": during.uordblks - before.uordblks,
    "heap_trimmed": during.arena - after.arena,
    "heap_kept": after.arena - before.arena,
}))
"""


def glibc_with_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2")
    except OSError:
        return False


def probe(disable: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["NEXTN_DISABLE_MALLOC_TUNING"] = "1" if disable else "0"
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not glibc_with_mallinfo2(), reason="needs glibc 2.33+ (mallinfo2)")
def test_large_tensors_come_from_the_heap_and_stay_there():
    size = 64 << 20
    tuned = probe(disable=False)
    assert tuned["applied"]
    assert tuned["mmapped_growth"] < size // 2
    assert tuned["heap_used_growth"] >= size
    assert tuned["heap_trimmed"] == 0  # not trimmed back to the OS on free

    untouched = probe(disable=True)
    assert not untouched["applied"]
    assert untouched["mmapped_growth"] >= size  # glibc's default: its own mmap
    assert untouched["heap_kept"] < size // 2
