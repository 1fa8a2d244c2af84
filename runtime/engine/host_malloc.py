# SPDX-License-Identifier: Apache-2.0
"""glibc's `malloc` told to keep freed memory for reuse (CPU engines).

An eager prefill step allocates and frees megabytes of activations per layer. glibc serves
an allocation above its mmap threshold (128 KiB, raised as large blocks are freed) with a
fresh `mmap` whose pages fault in on first touch and are unmapped again on `free`, and it
hands the heap's free top back to the OS past a trim threshold. So the same pages are
faulted in again and again, and a product whose output lands on fresh pages takes many
times its usual time.

PyTorch's CPU launcher (`torch.backends.xeon.run_cpu`) preloads jemalloc or tcmalloc
configured never to return memory, and the SGLang and vLLM CPU guides ask for tcmalloc in
`LD_PRELOAD`, for the same reason. Where no such allocator is preloaded, `mallopt` gives
glibc that policy: blocks up to 1 GiB come from the heap and the heap is not
trimmed, so the process keeps its peak heap and reuses it, as a caching allocator does.
The settings are process-wide and made once; `NEXTN_DISABLE_MALLOC_TUNING=1` leaves glibc
as it is. A no-op off glibc (and harmless under a preloaded allocator, which leaves glibc's
`malloc` unused).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

# glibc's <malloc.h> parameter numbers
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# blocks below 1 GiB from the heap; glibc builds whose heaps are smaller refuse that, and
# take their largest dynamic threshold (32 MiB on 64-bit) instead
MMAP_THRESHOLDS = (1 << 30, 32 << 20)
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: never trim in practice

DISABLE_ENV = "NEXTN_DISABLE_MALLOC_TUNING"


@functools.cache
def keep_freed_memory() -> bool:
    """Apply the settings once per process; whether glibc accepted them."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False  # not glibc
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # the mmap threshold first: a trim threshold alone would fix the mmap threshold at its
    # 128 KiB start, which slowed prefill (docs/benchmark_history.md)
    threshold = next((t for t in MMAP_THRESHOLDS if mallopt(M_MMAP_THRESHOLD, t)), None)
    applied = threshold is not None and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if applied:
        logger.info(
            "glibc malloc keeps freed memory for reuse (mmap threshold %d MiB, no trim); "
            "%s=1 turns this off",
            threshold >> 20,
            DISABLE_ENV,
        )
    return applied
