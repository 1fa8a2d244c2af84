# SPDX-License-Identifier: Apache-2.0
"""Narrow copies of wide weights for captured steps on CPU.

A decode, verify or draft step of a few rows is bound by the bytes of weights it reads,
not by arithmetic. A bf16 checkpoint served with `--dtype float32` (the fast dtype of a CPU
without native bf16 products) holds fp32 weights whose values are all exactly
representable in bf16. For such a tensor a bf16 copy holds the same numbers in half the
bytes: inside a captured step the products read the copy and widen it as they load
(`weight_for_product`). The products then see exactly the fp32 values, so results are
unchanged; only memory traffic halves. Eager forwards (prefill) keep using the wide tensor,
so they pay no conversion.

Where the widening lands decides whether a copy pays. Routed experts are gathered per pair
and multiplied inside one kernel the compiler writes, so the widening is fused into the
read and no fp32 copy ever exists. A linear layer's product is an external GEMM: the
compiler first widens the whole copy into an fp32 temporary, which the GEMM then reads.
That pays while the temporary stays in the core's cache (the weight leaves memory as 2
bytes an element), and costs more than the wide weight once it does not (2 bytes read, 4
written, 4 read again, every call). So a module's copies are limited to `narrow_max_numel`
elements, `WIDENED_MAX_NUMEL` unless the module sets it (None: no limit, for products
that widen inside their own kernel, as the routed experts do): the default
model's LM head (4096 x 256, a 4 MB temporary written four times a NEXTN round) measured
4.05 and 3.01 ms per NEXTN token with its copy against 2.83 and 2.74 ms reading the fp32
head (two one-off in-process A/Bs; docs/captured_decode.md section 3), and plain decoding
unchanged.

A tensor gets a copy only when the copy is lossless (every value round-trips), so an fp32
checkpoint, or weights a loader dequantised to values bf16 cannot hold, keep the wide path.
The copies cost half the wide weights' memory again.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from runtime.core.capture import in_capture

NARROW_SUFFIX = "_narrow"
NARROW_DTYPE = torch.bfloat16
# tensors smaller than this stay wide: the saving is noise and the compiler fuses them anyway
MIN_NUMEL = 1 << 14
# a copy widened whole before an external GEMM pays only while its fp32 temporary fits a
# core's L2 cache (1 MiB: 256K elements); the limit of every module that does not set
# `narrow_max_numel`
WIDENED_MAX_NUMEL = 1 << 18


def weight_for_product(module: nn.Module, name: str) -> torch.Tensor:
    """The tensor a product should read: the narrow copy inside a captured step when the
    module has one, else the wide weight. Callers widen after any gather (`.to(x.dtype)`)."""
    if in_capture():
        narrow = getattr(module, name + NARROW_SUFFIX, None)
        if narrow is not None:
            return narrow
    return getattr(module, name)


def attach_narrow_copies(models: Iterable[nn.Module], min_numel: int = MIN_NUMEL) -> int:
    """Give every module of `models` a narrow copy of each fp32 tensor of at least
    `min_numel` elements (and at most the module's `narrow_max_numel`, `WIDENED_MAX_NUMEL`
    unless it sets one) it lists in `narrow_weight_names` that bf16 holds exactly (a buffer
    `<name>_narrow`). A tensor shared by several modules gets one copy. Returns the bytes of
    the copies made."""
    made: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    total = 0
    for model in models:
        for module in model.modules():
            max_numel = getattr(module, "narrow_max_numel", WIDENED_MAX_NUMEL)
            for name in getattr(module, "narrow_weight_names", ()):
                wide = getattr(module, name, None)
                if not _narrowable(wide, min_numel, max_numel):
                    continue
                key = (wide.data_ptr(), tuple(wide.shape))
                if key not in made:
                    narrow = wide.detach().to(NARROW_DTYPE)
                    if not torch.equal(narrow.to(wide.dtype), wide):
                        continue
                    made[key] = narrow
                    total += narrow.numel() * narrow.element_size()
                module.register_buffer(name + NARROW_SUFFIX, made[key], persistent=False)
    return total


def _narrowable(wide, min_numel: int, max_numel: int | None) -> bool:
    return (
        isinstance(wide, torch.Tensor)
        and wide.dtype == torch.float32
        and wide.device.type == "cpu"
        and wide.numel() >= min_numel
        and (max_numel is None or wide.numel() <= max_numel)
    )
