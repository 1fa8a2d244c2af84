# SPDX-License-Identifier: Apache-2.0
"""Products of a few fp32 rows with bf16 weights, each weight read once (CPU).

`x [G, M, K]` fp32, `weight [E, N, K]` bf16 (linear layout, out x in), `index [G]`: group
`g` multiplies its `M` rows by `weight[index[g]]`; without `index`, `weight[g]` (`E == G`)
or `weight[0]` for every group (`E == 1`). Returns `[G, M, N]` fp32, the bf16 weights
widened exactly, so only the order of the sums differs from `x @ weight.float().T`.

Why a kernel of its own. A captured decode or verify step of a batch of one multiplies one
to eight rows by each weight (a verify of four draft positions: four rows; a routed expert:
the rows of the pairs routed to it). A GEMM library reads the fp32 weight, or a widened
copy the compiler writes first, and does little work per byte; the compiler's own reduction
widens as it loads but repeats the load and the widening for every row. This kernel
(`csrc/narrow_product.cpp`) loads each block of weight rows once, widens it in registers and
multiplies it into the accumulators of every row that reads it, all groups with the same
index together, so a routed expert chosen by several rows is read once too (SGLang's CPU
kernels, `sgl-kernel/csrc/cpu`, are written the same way: AVX-512 intrinsics, weights
converted in registers, registered as torch ops). Registered as the C++ operator
`nextn_cpu::narrow_product` with a fake implementation, it is one opaque node of a compiled
step, which inductor's C++ wrapper calls through the dispatcher without Python.

The extension is compiled on first use with `torch.utils.cpp_extension` (about 16 s once per
machine, then loaded from its build directory); where it cannot be built (no compiler) the
products keep their other paths (`available()` is False). `NEXTN_DISABLE_NARROW_KERNEL=1`
leaves it unbuilt. The reference defines correctness.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "narrow_product.cpp"
DISABLE_ENV = "NEXTN_DISABLE_NARROW_KERNEL"
# the instruction sets the kernel is built for, by what this torch build dispatches to
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "available": False}


def narrow_product_reference(
    x: torch.Tensor, weight: torch.Tensor, index: torch.Tensor | None = None
) -> torch.Tensor:
    """The product in plain torch (the test oracle)."""
    if index is not None:
        weight = weight[index]
    elif weight.shape[0] == 1:
        weight = weight.expand(x.shape[0], *weight.shape[1:])
    return torch.bmm(x, weight.to(x.dtype).transpose(1, 2))


def available() -> bool:
    """Whether the kernel is loaded in this process (`load` tried and succeeded)."""
    return bool(_state["available"])


def load(cache_dir: Path | str | None = None) -> bool:
    """Build (once per machine) and load the kernel; later calls return at once. Returns
    whether it is available. The build directory is under `cache_dir` (default torch's
    extension directory), one per instruction set and source."""
    with _lock:
        if _state["tried"]:
            return bool(_state["available"])
        _state["tried"] = True
        if os.environ.get(DISABLE_ENV):
            return False
        start = time.perf_counter()
        try:
            _build(cache_dir)
        except Exception as err:  # no compiler, no ninja, an unknown platform
            logger.warning("narrow-weight kernel unavailable, products use GEMMs: %s", err)
            return False
        _state["available"] = True
        logger.info("narrow-weight kernel ready in %.1f s", time.perf_counter() - start)
        return True


def _build(cache_dir: Path | str | None) -> None:
    from torch.utils import cpp_extension

    isa = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", *ISA_FLAGS.get(isa, [])]
    tag = hashlib.sha256(SOURCE.read_bytes() + repr(flags).encode()).hexdigest()[:12]
    name = f"nextn_narrow_product_{isa.lower()}_{tag}"
    build_dir = None
    if cache_dir is not None:
        build_dir = Path(cache_dir) / "kernels" / name
        build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(SOURCE)],
        extra_cflags=flags,
        build_directory=None if build_dir is None else str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    torch.library.register_fake("nextn_cpu::narrow_product")(_narrow_product_fake)


def _narrow_product_fake(x, weight, index=None):
    return x.new_empty((x.shape[0], x.shape[1], weight.shape[1]))


def narrow_product(
    x: torch.Tensor, weight: torch.Tensor, index: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel (`load` first; see the module docstring for the shapes)."""
    return torch.ops.nextn_cpu.narrow_product(x, weight, index)
