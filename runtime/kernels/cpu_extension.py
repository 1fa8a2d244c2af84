# SPDX-License-Identifier: Apache-2.0
"""The project's C++ CPU kernels (`csrc/*.cpp`, one extension), built on first use.

Every operator lives under the `nextn_cpu` namespace with a fake implementation, so a
compiled step holds it as one opaque node that inductor's C++ wrapper calls through the
dispatcher without Python (SGLang's CPU kernels, `sgl-kernel/csrc/cpu`, are registered as
torch ops the same way). Each operator's Python module (`runtime.kernels.<name>`) owns its
contract and its torch reference; the list of operators and their sources is in
docs/architecture.md, "Module notes".

`load` builds the extension with `torch.utils.cpp_extension` once per machine (then loads it
from its build directory) and registers the fakes; the graph runner calls it in its compile
worker before a CPU step's first trace, and a CPU model runner that captures nothing
(`--disable-cuda-graph`) when it is built. Where it cannot be built (no compiler, no ninja)
every caller keeps its other path (`available()` is False); `NEXTN_DISABLE_CPU_KERNELS=1`
leaves it unbuilt.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

from runtime.core.capture import compiling
from runtime.kernels import dense_product

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))  # one extension of every source there
DISABLE_ENV = "NEXTN_DISABLE_CPU_KERNELS"
# the instruction sets the kernels are built for, by what this torch build dispatches to
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
# torch's builder waits for as long as a build directory's `lock` file exists; one left by
# a process killed mid-build would stall every later start, so a lock older than this
# (many times a build's time) is taken as stale and removed
STALE_LOCK_SECONDS = 300.0
_lock = threading.Lock()
_state: dict[str, bool] = {"tried": False, "available": False, "tiles": False}


def available() -> bool:
    """Whether the kernels are loaded in this process (`load` tried and succeeded)."""
    return _state["available"]


def serves(x: torch.Tensor) -> bool:
    """Whether a kernel here may compute on `x` instead of its torch form, eagerly or inside
    a compiled step: the kernels are loaded, `x` is on CPU and no grad is wanted (the
    kernels have no backward)."""
    return _state["available"] and x.device.type == "cpu" and not torch.is_grad_enabled()


def serves_eagerly(x: torch.Tensor) -> bool:
    """`serves`, and the call is eager: for kernels whose compiled steps keep the torch
    forms, which the compiler fuses."""
    return serves(x) and not compiling()


def tiles_granted() -> bool:
    """Whether the loaded kernels may use AMX tiles (the CPU has AMX-BF16 and Linux let the
    process use the tile registers). Asked once at load, so that a trace only reads it."""
    return _state["tiles"]


def load(cache_dir: Path | str | None = None) -> bool:
    """Build (once per machine) and load the kernels; later calls return at once. Returns
    whether they are available. The build directory is under `cache_dir` (default torch's
    extension directory), one per instruction set, source, torch and Python."""
    with _lock:
        if _state["tried"]:
            return _state["available"]
        _state["tried"] = True
        if os.environ.get(DISABLE_ENV):
            return False
        start = time.perf_counter()
        try:
            _build(cache_dir)
        except Exception as err:  # no compiler, no ninja, an unknown platform
            logger.warning("C++ CPU kernels unavailable, their callers use torch: %s", err)
            return False
        _state["available"] = True
        _state["tiles"] = bool(torch.ops.nextn_cpu.tile_ready())
        dense_product.choose()  # before any step is traced: the choice shapes the graphs
        logger.info(
            "C++ CPU kernels ready in %.1f s (AMX tile products: %s, oneDNN products: %s)",
            time.perf_counter() - start,
            "yes" if _state["tiles"] else "no",
            "yes" if dense_product.enabled() else "no",
        )
        return True


def _build(cache_dir: Path | str | None) -> None:
    from torch.utils import cpp_extension

    isa = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", *ISA_FLAGS.get(isa, [])]
    # a build serves one source, flags, torch and Python (a shared cache directory may see
    # several installs; an extension built against another torch must not be loaded)
    built_for = repr((flags, torch.__version__, sys.version)).encode()
    sources = b"".join(source.name.encode() + source.read_bytes() for source in SOURCES)
    tag = hashlib.sha256(sources + built_for).hexdigest()[:12]
    name = f"nextn_cpu_{isa.lower()}_{tag}"
    build_dir = None
    if cache_dir is not None:
        build_dir = Path(cache_dir) / "kernels" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        wait_for_build_lock(build_dir / "lock")
    cpp_extension.load(
        name=name,
        sources=[str(source) for source in SOURCES],
        extra_cflags=flags,
        build_directory=None if build_dir is None else str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    torch.library.register_fake("nextn_cpu::narrow_product")(_narrow_product_fake)
    torch.library.register_fake("nextn_cpu::indexer_topk")(_indexer_topk_fake)
    torch.library.register_fake("nextn_cpu::hc_post")(_hc_post_fake)
    torch.library.register_fake("nextn_cpu::sinkhorn")(_sinkhorn_fake)
    torch.library.register_fake("nextn_cpu::hc_pre")(_hc_pre_fake)
    torch.library.register_fake("nextn_cpu::rms_norm")(_rms_norm_fake)
    torch.library.register_fake("nextn_cpu::swiglu")(_swiglu_fake)
    torch.library.register_fake("nextn_cpu::tile_product")(_tile_product_fake)
    torch.library.register_fake("nextn_cpu::merge_row_keys")(_merge_row_keys_fake)
    torch.library.register_fake("nextn_cpu::tile_attention")(_tile_attention_fake)
    torch.library.register_fake("nextn_cpu::dense_product")(_dense_product_fake)
    torch.library.register_fake("nextn_cpu::group_attention")(_group_attention_fake)
    torch.library.register_fake("nextn_cpu::dense_grouped_product")(_dense_grouped_product_fake)
    torch.library.register_fake("nextn_cpu::fp8_block_linear")(_fp8_block_linear_fake)
    torch.library.register_fake("nextn_cpu::quantized_grouped_product")(_quantized_grouped_fake)
    torch.library.register_fake("nextn_cpu::rotary")(_rotary_fake)
    torch.library.register_fake("nextn_cpu::compressor_pool")(_compressor_pool_fake)
    torch.library.register_fake("nextn_cpu::moe_route")(_moe_route_fake)
    torch.library.register_fake("nextn_cpu::compressor_rows")(_compressor_rows_fake)
    torch.library.register_fake("nextn_cpu::compressor_entries")(_compressor_entries_fake)


def wait_for_build_lock(
    lock: Path, stale_after: float = STALE_LOCK_SECONDS, poll: float = 0.5
) -> None:
    """Return once `lock` is gone: another process's build finished, or the lock is older
    than `stale_after` seconds (its builder died), in which case it is removed."""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_after:
            logger.warning("removing a stale build lock %s (%.0f s old)", lock, age)
            lock.unlink(missing_ok=True)
            return
        time.sleep(min(poll, stale_after - age))


def _merge_row_keys_fake(tile_out, tile_lse, q, source, index, valid, sink, scale):
    return q.new_empty(q.shape)


def _tile_attention_fake(q, tile_rows, kv, valid, scale, onednn):
    shape = (*tile_rows.shape, q.shape[1])
    return q.new_empty((*shape, q.shape[2])), q.new_empty(shape)


def _group_attention_fake(q, kv, valid, row_kv, row_valid, sink, scale):
    batch, rows, heads, dim = q.shape
    return q.new_empty((batch * rows, heads, dim))


def _narrow_product_fake(x, weight, index=None):
    return x.new_empty((x.shape[0], x.shape[1], weight.shape[1]))


def _indexer_topk_fake(scores, lengths, visible, k):
    shape = (scores.shape[0], k)
    return scores.new_empty(shape, dtype=torch.long), scores.new_empty(shape, dtype=torch.bool)


def _hc_post_fake(block, residual, post, comb):
    return torch.empty_like(residual)


def _hc_pre_fake(x, fn, scale, base, norm_eps, hc_eps, iters):
    tokens, streams, hidden = x.shape
    fp32 = torch.float32
    return (
        x.new_empty((tokens, hidden)),
        x.new_empty((tokens, streams), dtype=fp32),
        x.new_empty((tokens, streams, streams), dtype=fp32),
    )


def _rotary_fake(x, cos, sin, lo, interleaved, inverse):
    return x.new_empty(x.shape)


def _compressor_pool_fake(rows, valid, dim, ratio, overlap):
    return rows.new_empty((rows.shape[0], dim))


def _moe_route_fake(logits, bias, hash_ids, top_k, scoring, renormalize, scale):
    shape = (logits.shape[0], top_k if hash_ids is None else hash_ids.shape[1])
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.long)


def _compressor_rows_fake(kv_gate, ape, positions):
    return kv_gate.new_empty(kv_gate.shape, dtype=torch.float32)


def _compressor_entries_fake(rows, valid, weight, eps, pos, inv_freq, scaling, dim, *rest):
    return rows.new_empty((rows.shape[0], dim))


def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _swiglu_fake(gate, up, limit):
    return gate.new_empty(gate.shape)


def _sinkhorn_fake(logits, iters, eps):
    return torch.empty_like(logits)


def _dense_product_fake(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _dense_grouped_product_fake(x, weight, group_ends):
    return x.new_empty((x.shape[0], weight.shape[1]))


def _fp8_block_linear_fake(x, codes, scale, b0, b1):
    return x.new_empty((*x.shape[:-1], codes.shape[-2]))


def _quantized_grouped_fake(x, codes, scale, group_ends, fmt, block_k):
    return x.new_empty((x.shape[0], codes.shape[1]))


def _tile_product_fake(x, packed, n, group_ends=None):
    return x.new_empty((x.shape[0], n))
