# SPDX-License-Identifier: Apache-2.0
"""Settings of captured steps (SGLang's `--cuda-graph-*` / `--enable-torch-compile` flags)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

CAPTURE_COMPILE_MODES = ("background", "inline", "startup")
DISABLE_ENV = "NEXTN_DISABLE_CUDA_GRAPH"  # set (non-empty): every engine runs steps eagerly
# SGLang's default capture ladder
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def default_cache_dir() -> Path:
    """Where compiled artifacts persist between starts (inductor's FX graph and AOT autograd
    caches live under it): `$NEXTN_CACHE_DIR`, else `$XDG_CACHE_HOME/nextn-runtime`."""
    explicit = os.environ.get("NEXTN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nextn-runtime"


@dataclass(frozen=True)
class CaptureConfig:
    """`enabled`: capture decode, verify and draft steps (`--disable-cuda-graph` turns it off).
    `batch_sizes`: the buckets (`--cuda-graph-bs`), default SGLang's ladder up to
    `max_batch_size` (`--cuda-graph-max-bs`, default the engine's running-request limit).
    `torch_compile`: on CUDA, compile the step before graph capture (`--enable-torch-compile`);
    on CPU the capture is always a compile. `background`: compile a bucket on a worker
    thread the first time it is needed and serve that step eagerly meanwhile (False: compile
    in the calling thread, which then waits; the engine's `startup` mode compiles every
    bucket before serving, in the calling thread too). `cache_dir`: compiled artifacts on disk.
    `inductor_options`: passed to `torch.compile(options=...)` on CPU. `narrow_weights`: on
    CPU the steps read bf16 copies of fp32 weights bf16 holds exactly (`--disable-narrow-weights`
    turns it off). `fused_round`: a greedy NEXTN round (target verify, acceptance, the draft's
    steps) runs as one captured step (`--disable-fused-nextn-round` turns it off)."""

    enabled: bool = True
    batch_sizes: tuple[int, ...] = ()
    max_batch_size: int | None = None
    torch_compile: bool = False
    background: bool = True
    cache_dir: str | None = None
    inductor_options: dict = field(default_factory=dict)
    narrow_weights: bool = True
    fused_round: bool = True

    def buckets(self, max_running_requests: int) -> tuple[int, ...]:
        """Ascending bucket sizes; a batch runs in the smallest bucket that holds it. Sizes
        above the largest batch captured (`--cuda-graph-max-bs`, else the running-request
        limit) give way to that batch size, as SGLang adds its request limit when a listed
        size exceeds it: `--cuda-graph-bs 1 4 16 64` under NEXTN's default of 48 running
        requests captures 1, 4, 16 and 48, so no batch of 17-48 runs eagerly."""
        limit = max(self.max_batch_size or max_running_requests, 1)
        requested = self.batch_sizes or (*(b for b in DEFAULT_BATCH_SIZES if b < limit), limit)
        sizes = {b for b in requested if 1 <= b <= limit}
        if any(b > limit for b in requested):
            sizes.add(limit)
        sizes = tuple(sorted(sizes))
        if not sizes:
            raise ValueError(
                f"no capture batch size within 1..{limit}; check --cuda-graph-bs and "
                "--cuda-graph-max-bs"
            )
        return sizes

    @staticmethod
    def disabled_by_env() -> bool:
        return bool(os.environ.get(DISABLE_ENV))

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()
