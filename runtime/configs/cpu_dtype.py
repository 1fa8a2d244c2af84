# SPDX-License-Identifier: Apache-2.0
"""Which dtype a CPU runs a half-precision checkpoint fastest in (`--dtype auto` on CPU).

A bf16 checkpoint is served in bf16 only where the CPU multiplies bf16 natively (AMX tiles
or AVX512-BF16) and a short probe confirms it: a batch-1 and a prefill-sized product in the
checkpoint's dtype against float32. Elsewhere bf16 matmuls go through conversions and run
several times slower than float32, so float32 it is. Decided once per process and logged
with the reason.

The batch-1 product must win by more than its halved bytes (`DECODE_BYTES_RATIO`): a
float32 engine serving a bf16 checkpoint already reads bf16 copies of the weights in its
captured decode steps (`runtime.layers.narrow_weights`), so a probe against a plain fp32
product would credit bf16 with a saving the float32 engine already has (the measurement
that showed it: docs/benchmark_history.md).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

logger = logging.getLogger(__name__)

PROBE_SHAPES = ((1, 1024, 1024), (256, 1024, 1024))  # a decode row and a prefill chunk
PROBE_REPEATS = 5
# float32's decode products read bf16 copies of a bf16 checkpoint's weights: half the bytes
# of the plain fp32 product the probe times, which a bf16 product must beat by more
DECODE_BYTES_RATIO = 2.0


def native_half_matmul(dtype: torch.dtype) -> bool:
    """The CPU has instructions that multiply `dtype` without converting to float32."""
    cpu = torch.cpu
    if dtype == torch.bfloat16:
        return cpu._is_amx_tile_supported() or cpu._is_avx512_bf16_supported()
    if dtype == torch.float16:
        return cpu._is_amx_fp16_supported()
    return False


def _seconds(dtype: torch.dtype, rows: int, inner: int, outer: int) -> float:
    x = torch.randn(rows, inner).to(dtype)
    w = torch.randn(outer, inner).to(dtype)
    torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - start)
    return best


def _bytes_ratio(dtype: torch.dtype, rows: int) -> float:
    """How much faster than the plain fp32 product a `dtype` product of `rows` rows must be
    to beat what a float32 engine runs (the narrow copies are bf16: only bf16 checkpoints
    get them, and only products of decode rows read them)."""
    return DECODE_BYTES_RATIO if dtype == torch.bfloat16 and rows == 1 else 1.0


@functools.cache
def fastest_cpu_dtype(checkpoint_dtype: torch.dtype) -> tuple[torch.dtype, str]:
    """(dtype to run in, why) for a checkpoint stored in `checkpoint_dtype`."""
    if checkpoint_dtype == torch.float32:
        return torch.float32, "the checkpoint is float32"
    name = str(checkpoint_dtype).removeprefix("torch.")
    capability = torch.backends.cpu.get_cpu_capability()
    if not native_half_matmul(checkpoint_dtype):
        return torch.float32, f"this CPU ({capability}) has no native {name} matmul"
    slower = [
        shape
        for shape in PROBE_SHAPES
        if _seconds(checkpoint_dtype, *shape) * _bytes_ratio(checkpoint_dtype, shape[0])
        >= _seconds(torch.float32, *shape)
    ]
    if slower:
        rows = ", ".join(f"{m}x{k}x{n}" for m, k, n in slower)
        if any(_bytes_ratio(checkpoint_dtype, m) > 1 for m, _, _ in slower):
            rows += f"; float32's decode rows read {name} copies of the weights"
        return torch.float32, f"a probe ran {name} no faster than float32 on this CPU ({rows})"
    return checkpoint_dtype, f"this CPU ({capability}) multiplies {name} natively and faster"


def resolve_auto_cpu_dtype(checkpoint_dtype: torch.dtype) -> torch.dtype:
    dtype, reason = fastest_cpu_dtype(checkpoint_dtype)
    logger.info("--dtype auto on CPU: %s (%s)", str(dtype).removeprefix("torch."), reason)
    return dtype
