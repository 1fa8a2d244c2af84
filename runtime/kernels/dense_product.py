# SPDX-License-Identifier: Apache-2.0
"""fp32 products of many rows through oneDNN's GEMM, where it beats the default BLAS (CPU).

`x [..., K]` fp32 times `weight [N, K]` fp32 (linear layout) plus an optional bias ->
`[..., N]`, the same product as `F.linear` with its sums in another order.

Why: PyTorch's CPU build multiplies fp32 with MKL, which picks its instruction set by CPU
vendor (AVX2 code on AMD CPUs with AVX-512); oneDNN, in the same build, picks by the CPU's
features. The gain grows with rows times outputs, hence `DENSE_MIN_ROWS` and
`DENSE_MIN_OUTPUTS`. inductor calls oneDNN only for weights frozen into the graph, so the
C++ extension exposes it as `nextn_cpu::dense_product` (an opaque node with a fake
implementation), multiplying the rows rounded up to a short ladder so that a few oneDNN
primitives per weight serve every size. Whether to use it is decided once per process by a
probe (`choose`, before any step is traced): oneDNN only where it beats the default by
`REQUIRED_SPEED_UP` on a verify-sized and a prefill-sized product; logged;
`NEXTN_CPU_GEMM=onednn` or `=default` decides without a probe. The reference defines
correctness. Measurements: docs/captured_decode.md section 3, docs/benchmark_history.md.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

CHOICE_ENV = "NEXTN_CPU_GEMM"  # onednn | default | unset: probe
# smaller products keep the default GEMM (or the narrow-weight paths): at least this many
# rows, and this many outputs (rows x output features)
DENSE_MIN_ROWS = 16
DENSE_MIN_OUTPUTS = 16 * 512
# grouped products (routed experts, rows sorted by expert) of fewer rows keep theirs, where
# oneDNN group by group stops beating `grouped_mm` (docs/benchmark_history.md)
DENSE_MIN_GROUPED_ROWS = 256
PROBE_SHAPES = ((64, 256, 1024), (512, 512, 512))  # rows, inner, outer
PROBE_REPEATS = 7
REQUIRED_SPEED_UP = 1.15
_state: dict[str, object] = {"enabled": False, "reason": "not probed"}


def dense_product_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The product in plain torch (the test oracle)."""
    return F.linear(x, weight, bias)


def dense_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The operator (`cpu_extension.load` first)."""
    return torch.ops.nextn_cpu.dense_product(x, weight, bias)


def dense_grouped_product(
    x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor
) -> torch.Tensor:
    """`x [A, K]`, rows sorted by group, times `weight [G, N, K]`: rows
    `group_ends[g-1]:group_ends[g]` times `weight[g]`, each group one `dense_product`;
    rows past the last group zero (`grouped_gemm_reference` is the oracle). The bounds are
    read on the host, so CPU tensors only (`cpu_extension.load` first)."""
    return torch.ops.nextn_cpu.dense_grouped_product(x, weight, group_ends)


def enabled() -> bool:
    """Whether products of many fp32 rows go through oneDNN in this process (`choose`)."""
    return bool(_state["enabled"])


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the product of `x` and `weight` should go through `dense_product`: oneDNN
    was chosen, both are fp32 on CPU, the product is large enough (`DENSE_MIN_ROWS`,
    `DENSE_MIN_OUTPUTS`) and no grad is wanted (the operator has no backward)."""
    if not _takes(x, weight):
        return False
    rows = math.prod(x.shape[:-1])
    return rows >= DENSE_MIN_ROWS and rows * weight.shape[0] >= DENSE_MIN_OUTPUTS


def serves_grouped(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a grouped product of `x` with `weight [G, N, K]` should go through
    `dense_grouped_product` (as `serves`, with at least `DENSE_MIN_GROUPED_ROWS` rows)."""
    return _takes(x, weight) and x.shape[0] >= DENSE_MIN_GROUPED_ROWS


def _takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """oneDNN was chosen, `x` and `weight` are fp32 on CPU and no grad is wanted."""
    return (
        bool(_state["enabled"])
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
    )


def choose() -> bool:
    """Decide, once, whether oneDNN serves products of many rows (the extension is loaded:
    `cpu_extension.load` calls this). Returns the choice."""
    if _state["reason"] != "not probed":
        return enabled()
    forced = os.environ.get(CHOICE_ENV, "").strip().lower()
    if forced in ("onednn", "default"):
        _decide(forced == "onednn", f"{CHOICE_ENV}={forced}")
    elif not torch.backends.mkldnn.is_available():
        _decide(False, "this torch build has no oneDNN")
    else:
        speed_ups = [_speed_up(*shape) for shape in PROBE_SHAPES]
        shown = ", ".join(f"{m}x{k}x{n}: {s:.2f}x" for (m, k, n), s in zip(PROBE_SHAPES, speed_ups))
        _decide(min(speed_ups) >= REQUIRED_SPEED_UP, f"oneDNN against the default GEMM {shown}")
    return enabled()


def _decide(enable: bool, reason: str) -> None:
    _state["enabled"], _state["reason"] = enable, reason
    logger.info("fp32 products of many rows: %s (%s)", "oneDNN" if enable else "default", reason)


def _speed_up(rows: int, inner: int, outer: int) -> float:
    """Default GEMM seconds over oneDNN's for one product, best of a few alternating runs."""
    x, weight = torch.randn(rows, inner), torch.randn(outer, inner)
    best = {"default": math.inf, "onednn": math.inf}
    calls = {"default": lambda: F.linear(x, weight), "onednn": lambda: dense_product(x, weight)}
    with torch.inference_mode():
        for name in best:
            calls[name]()
        for _ in range(PROBE_REPEATS):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                best[name] = min(best[name], time.perf_counter() - start)
    return best["default"] / best["onednn"]
