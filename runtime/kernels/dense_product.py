# SPDX-License-Identifier: Apache-2.0
"""fp32 products of many rows through oneDNN's GEMM, where it beats the default BLAS (CPU).

`x [..., K]` fp32 times `weight [N, K]` fp32 (linear layout) plus an optional bias ->
`[..., N]`, the same product as `F.linear` with its sums in another order.

Why. PyTorch's CPU build multiplies fp32 matrices with MKL, whose kernels pick their
instruction set by CPU vendor: on an AMD CPU with AVX-512 they ran at about 105 GFLOP/s,
the rate of AVX2 code, half the core's AVX-512 rate. oneDNN (in the same build,
`torch.ops.mkldnn`) picks by the CPU's features. On a 2-core AMD EPYC machine (AVX-512, one
thread, weights taken in turn from 8 MB of them, so from memory as in a step) oneDNN took
0.55 against 1.21 ms for `[1,024, 256] x [256, 256]` (a prefill chunk), 0.69 against 1.54
ms for a verify's 64 rows through the 4,096-row LM head, 0.25 against 0.47 ms for 16 rows
through it, and 48 against 80 us for 64 rows through a 256 x 256 projection. Small products
lose: 16 rows through that projection were level, 8 rows slower (20 against 15 us); the
gain grows with the rows times the outputs, hence `DENSE_MIN_ROWS` and `DENSE_MIN_OUTPUTS`
(below them a captured step's few rows take the narrow-weight paths anyway). inductor calls
the same operator only for weights frozen into the graph, and a captured step reads its
weights as inputs, so the project's C++ extension exposes it as `nextn_cpu::dense_product`
(an opaque node with a fake implementation, called by inductor's C++ wrapper through the
dispatcher).

oneDNN builds a primitive per shape (its cache holds 1,024), which costs more than the
product itself for a shape met the first time; the C++ operator therefore multiplies the
rows rounded up to a short ladder (zero rows appended, their results dropped), so that
prefill chunks and routed-expert groups of any size reuse a few shapes per weight.

Whether to use it is decided once per process by a short probe (`choose`, when the
extension loads, before any step is traced): both libraries multiply a verify-sized and a
prefill-sized product, and oneDNN is used only where it is faster on both by
`REQUIRED_SPEED_UP` (on CPUs where MKL runs its AVX-512 kernels the two are close, and
the default stays). The choice is logged. `NEXTN_CPU_GEMM=onednn` or `=default` decides
without a probe. The reference defines correctness.
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
# grouped products (routed experts, rows sorted by expert) of fewer rows keep theirs: at
# 256 pairs over 8 experts oneDNN group by group was 1.25x faster than `grouped_mm`, at
# 4,096 2.2x (one thread, the default model's expert shapes)
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
