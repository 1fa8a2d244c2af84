# SPDX-License-Identifier: Apache-2.0
"""Narrow (bf16) copies of wide (fp32) weights, read by captured steps on CPU.

A bf16 checkpoint served in fp32 holds fp32 weights whose values bf16 holds exactly, and a
step of a few rows is bound by the bytes of weights it reads. So every such tensor whose
values round-trip gets a bf16 copy (`<name>_narrow`), and inside a captured step the products
read the copy and widen it as they load: they multiply exactly the fp32 values, so only the
order of the sums moves results, by rounding. Eager forwards keep the wide tensors. A
product's path depends on its rows (`linear_product`): up to `FUSED_MAX_ROWS` a reduction the
compiler fuses (`widening_product`), up to `KERNEL_MAX_ROWS` the narrow-weight kernel
(`runtime.kernels.narrow_product`), above that an external GEMM, which reads a copy only up
to `narrow_max_numel` elements (it widens the whole copy into a temporary first); on CPUs
with AMX, products of at least `TILE_MIN_ROWS` rows run on the tiles
(`runtime.kernels.tile_product`, weights in `tile_weight_names`). The copies cost half the
wide weights' memory again. Why these limits: docs/captured_decode.md section 3; the
measurements: docs/benchmark_history.md.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.core.capture import in_capture
from runtime.kernels import cpu_extension, dense_product, tile_product
from runtime.kernels.grouped_gemm import grouped_gemm_op
from runtime.kernels.narrow_product import narrow_product

NARROW_SUFFIX = "_narrow"
NARROW_DTYPE = torch.bfloat16
# tensors smaller than this stay wide: the saving is noise and the compiler fuses them anyway
MIN_NUMEL = 1 << 14
# a copy widened whole before an external GEMM pays only while its fp32 temporary fits a
# core's L2 cache (1 MiB: 256K elements); the limit of every module that does not set
# `narrow_max_numel`
WIDENED_MAX_NUMEL = 1 << 18
# products over at most this many rows read the copy inside a reduction the compiler writes
FUSED_MAX_ROWS = 1
# products over at most this many rows read the copy through the narrow-weight kernel
# (`runtime.kernels.narrow_product`) where it is loaded
KERNEL_MAX_ROWS = 8
TILE_SUFFIX = "_tiles"
# products over at least this many rows multiply on AMX tiles where the module keeps its
# weight packed (from here on the tiles beat the fp32 GEMM; up to `KERNEL_MAX_ROWS` the
# narrow-weight kernel reads the copy once for all rows)
TILE_MIN_ROWS = 16


def _copy_in_capture(module: nn.Module, name: str) -> torch.Tensor | None:
    """The module's narrow copy of `name` while a step is being captured, else None."""
    return getattr(module, name + NARROW_SUFFIX, None) if in_capture() else None


def weight_for_product(module: nn.Module, name: str) -> torch.Tensor:
    """The tensor a product that widens inside its own kernel should read: the narrow copy
    inside a captured step when the module has one, else the wide weight. Callers widen
    after any gather (`.to(x.dtype)`)."""
    narrow = _copy_in_capture(module, name)
    return getattr(module, name) if narrow is None else narrow


class ProductPath(enum.Enum):
    """How a product reads its weight (`product_weight`)."""

    GEMM = "an external GEMM over the wide weight or a copy widened first"
    REDUCTION = "the compiler's reduction over the copy (`widening_product`)"
    KERNEL = "the narrow-weight kernel over the copy (`narrow_product`)"


def product_weight(module: nn.Module, name: str, rows: int) -> tuple[torch.Tensor, ProductPath]:
    """The tensor a product over `rows` rows should read, and how: a copy inside a
    reduction up to `FUSED_MAX_ROWS` rows, a copy through the narrow-weight kernel up to
    `KERNEL_MAX_ROWS` (where it is loaded), else a GEMM over a copy up to the module's
    `narrow_max_numel` or over the wide weight."""
    narrow = _copy_in_capture(module, name)
    if narrow is not None:
        if rows <= FUSED_MAX_ROWS:
            return narrow, ProductPath.REDUCTION
        if rows <= KERNEL_MAX_ROWS and cpu_extension.available():
            return narrow, ProductPath.KERNEL
        limit = getattr(module, "narrow_max_numel", WIDENED_MAX_NUMEL)
        if limit is None or narrow.numel() <= limit:
            return narrow, ProductPath.GEMM
    return getattr(module, name), ProductPath.GEMM


def experts_kernel_ready(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether routed experts' products can go through the narrow-weight kernel: `weight` is
    a copy (`weight_for_product` inside capture), `x` fp32 and the kernel loaded."""
    return (
        weight.dtype == NARROW_DTYPE
        and x.dtype == torch.float32
        and in_capture()
        and cpu_extension.available()
    )


def widening_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x [..., M, K] @ weight [..., N, K]^T -> [..., M, N]` as a product and a sum over `K`,
    widening `weight` to `x.dtype` as it is read. Compiled, this is one loop nest over
    `N`, then `M`, then `K`: no temporary, each weight row read once for all `M` rows.

    `x` is first stored as it is (`as_strided` onto its own layout, which the compiler can
    only lower onto a stored buffer). Otherwise the compiler inlines the pointwise work
    that made `x` (a norm's scaling, rotary embedding, a concatenation) into the loads of
    this loop, which redoes it for every one of the `N` outputs (docs/captured_decode.md
    section 3)."""
    x = x.as_strided(x.shape, x.stride())
    wide = weight.to(x.dtype).unsqueeze(-2)  # [..., N, 1, K]
    return (wide * x.unsqueeze(-3)).sum(-1).transpose(-1, -2)


def batched_product(x: torch.Tensor, weight: torch.Tensor, path: ProductPath) -> torch.Tensor:
    """`x [G, M, K] @ weight [G, N, K]^T -> [G, M, N]` along `path` (`product_weight`; the
    kernel takes fp32 rows only, others a batched GEMM)."""
    if path is ProductPath.REDUCTION:
        return widening_product(x, weight)
    if path is ProductPath.KERNEL and x.dtype == torch.float32:
        return narrow_product(x, weight)
    return torch.bmm(x, weight.to(x.dtype).transpose(1, 2))


def linear_product(
    x: torch.Tensor, module: nn.Module, name: str = "weight", bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, module.<name>, bias)`, reading what `product_weight` picks for the
    number of rows of `x`; a product of many rows on AMX tiles where the module keeps its
    weight packed for them, else through oneDNN where this process chose it
    (`dense_product`)."""
    rows = math.prod(x.shape[:-1])
    tiles = _tiles_for(module, name, x, rows)
    if tiles is not None:
        n = getattr(module, name).shape[0]
        y = tile_product.tile_product(x.reshape(rows, x.shape[-1]), tiles, n)
        y = y.reshape(*x.shape[:-1], n)
        return y if bias is None else y + bias
    wide = getattr(module, name)
    if dense_product.serves(x, wide):
        return dense_product.dense_product(x, wide, bias)
    weight, path = product_weight(module, name, rows)
    if path is ProductPath.GEMM:
        return F.linear(x, weight.to(x.dtype), bias)
    flat = x.reshape(1, rows, x.shape[-1])
    y = batched_product(flat, weight.unsqueeze(0), path)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def grouped_product(
    x: torch.Tensor, module: nn.Module, name: str, group_ends: torch.Tensor
) -> torch.Tensor:
    """`x [A, K]`, rows sorted by group, times the module's `<name> [G, N, K]`: rows
    `group_ends[g-1]:group_ends[g]` times `<name>[g]` (`grouped_gemm_op`), on AMX tiles
    for a product of enough rows where the module keeps the weights packed, else group by
    group through oneDNN where this process chose it (`dense_product`)."""
    tiles = _tiles_for(module, name, x, x.shape[0])
    if tiles is not None:
        n = getattr(module, name).shape[1]
        return tile_product.tile_product(x, tiles, n, group_ends)
    weight = getattr(module, name)
    if dense_product.serves_grouped(x, weight):
        return dense_product.dense_grouped_product(x, weight, group_ends)
    return grouped_gemm_op(x, weight, group_ends)


def has_tiles(module: nn.Module, name: str) -> bool:
    """Whether the module keeps `name` packed for AMX tiles and the tile kernel is ready."""
    return getattr(module, name + TILE_SUFFIX, None) is not None and tile_product.ready()


def _tiles_for(module: nn.Module, name: str, x: torch.Tensor, rows: int):
    """The module's packed `name` when a product of `rows` rows of `x` should multiply on
    AMX tiles (eagerly or in a captured step, without grad: the kernel has no backward),
    else None."""
    tiles = getattr(module, name + TILE_SUFFIX, None)
    if tiles is None or rows < TILE_MIN_ROWS or x.dtype != torch.float32:
        return None
    if torch.is_grad_enabled():
        return None
    return tiles if tile_product.ready() else None


def attach_narrow_copies(
    models: Iterable[nn.Module], min_numel: int = MIN_NUMEL, tiles: bool | None = None
) -> int:
    """Give every module of `models` a narrow copy of each fp32 tensor of at least
    `min_numel` elements it lists in `narrow_weight_names` that bf16 holds exactly (a buffer
    `<name>_narrow`), and with `tiles` (default: the CPU has AMX tiles) the copy packed for
    the tile kernel (`<name>_tiles`) of each such tensor it lists in `tile_weight_names`.
    A tensor shared by several modules gets one copy. Returns the bytes made."""
    tiles = tile_product.host_has_tiles() if tiles is None else tiles
    made: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    packed: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    total = 0
    for model in models:
        for module in model.modules():
            for name in getattr(module, "narrow_weight_names", ()):
                wide = getattr(module, name, None)
                if not _narrowable(wide, min_numel):
                    continue
                key = (wide.data_ptr(), tuple(wide.shape))
                if key not in made:
                    narrow = wide.detach().to(NARROW_DTYPE)
                    if not torch.equal(narrow.to(wide.dtype), wide):
                        continue
                    made[key] = narrow
                    total += narrow.numel() * narrow.element_size()
                module.register_buffer(name + NARROW_SUFFIX, made[key], persistent=False)
                if not tiles or name not in getattr(module, "tile_weight_names", ()):
                    continue
                if key not in packed:
                    packed[key] = tile_product.pack(made[key])
                    total += packed[key].numel() * packed[key].element_size()
                module.register_buffer(name + TILE_SUFFIX, packed[key], persistent=False)
    return total


def _narrowable(wide, min_numel: int) -> bool:
    return (
        isinstance(wide, torch.Tensor)
        and wide.dtype == torch.float32
        and wide.device.type == "cpu"
        and wide.numel() >= min_numel
    )
