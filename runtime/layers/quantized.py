# SPDX-License-Identifier: Apache-2.0
"""Weights kept in their checkpoint's quantized format (`--quantization`).

A checkpoint loader that keeps a format hands each weight loader a lazy window with
`keep_quantized = True`, its format in `kind` ("fp8" / "mxfp4") and a `quantized()` method
returning a piece (`runtime.model_loader.lazy.QuantizedPiece`: `fmt`, `codes`, `scale`,
`block_k`, `name`; FP8 `codes [..., N, K]` e4m3 with `scale [..., N, ceil(K/block_k)]`
float32, MXFP4 `codes [..., N, K/2]` uint8 with `scale [..., N, K/32]` E8M0 bytes): the
window's codes and scales, already cut together (FP8: one scale row per weight row, so a
row split or a stacked part of any size keeps its scales; columns split along whole scale
blocks). Layers that can multiply quantized weights store pieces with `store_weight`; on the
first piece the float parameter is replaced by its codes (same name) and a scale parameter
(`<name>_scale_inv` for FP8, `<name>_scale` for MXFP4), so memory holds the checkpoint's
bytes. Every other parameter materializes the window, which dequantizes it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from runtime.kernels.quantized_product import FP8_DTYPE, MXFP4_GROUP
from runtime.layers.weight_utils import copy_checked

FORMATS = ("fp8", "mxfp4")


def keeps_quantized(loaded) -> bool:
    """Whether the loader wants `loaded` stored in its quantized format."""
    return bool(getattr(loaded, "keep_quantized", False))


def scale_name(name: str, fmt: str) -> str:
    return f"{name}_scale_inv" if fmt == "fp8" else f"{name}_scale"


def quantized_format(module: nn.Module, name: str) -> tuple[str, int] | None:
    """(format, block_k) of `module.<name>` once it holds codes, else None."""
    return getattr(module, "quantized_weights", {}).get(name)


def _quantize_param(module: nn.Module, name: str, fmt: str, block_k: int) -> None:
    """Replace the float parameter `module.<name>` by empty codes and scales."""
    old = getattr(module, name)
    *lead, k = old.shape
    if fmt == "fp8":
        codes_shape, codes_dtype = (*lead, k), FP8_DTYPE
        scales_shape, scales_dtype = (*lead, -(-k // block_k)), torch.float32
    else:
        if k % MXFP4_GROUP:
            raise ValueError(
                f"{name}: {k} inputs per row do not split into {MXFP4_GROUP}-value MXFP4 groups "
                f"(a tensor-parallel split of this weight's inputs must keep whole groups)"
            )
        codes_shape, codes_dtype = (*lead, k // 2), torch.uint8
        scales_shape, scales_dtype = (*lead, k // MXFP4_GROUP), torch.uint8
    codes = nn.Parameter(torch.empty(codes_shape, dtype=codes_dtype), requires_grad=False)
    scales = nn.Parameter(torch.empty(scales_shape, dtype=scales_dtype), requires_grad=False)
    codes.__dict__.update(old.__dict__)  # its weight_loader and what that loader reads
    setattr(module, name, codes)
    setattr(module, scale_name(name, fmt), scales)
    if "quantized_weights" not in module.__dict__:
        module.quantized_weights = {}
    module.quantized_weights[name] = (fmt, block_k)


def store_weight(
    module: nn.Module,
    name: str,
    loaded,
    select: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    what: str = "",
    formats: tuple[str, ...] = FORMATS,
) -> None:
    """Copy `loaded` (a tensor, a lazy window, or a window to keep quantized) into
    `select(module.<name>)`, where `select` picks leading dims only (rows of a stacked part,
    one expert). A window of a format outside `formats` is dequantized. A parameter holds one
    format: mixing quantized and float pieces is refused."""
    fmt = quantized_format(module, name)
    plain = module.__dict__.setdefault("_float_pieces", set())
    if not (keeps_quantized(loaded) and getattr(loaded, "kind", None) in formats):
        if fmt is not None:
            tensor = getattr(loaded, "name", "?")
            raise ValueError(
                f"{name}: checkpoint tensor '{tensor}' ({what or 'whole'}) is not in the "
                f"{fmt[0]} format of this parameter's other pieces (float, or scales that do "
                f"not fit it): serve with --quantization none, or fix the checkpoint"
            )
        plain.add(name)
        copy_checked(select(getattr(module, name).data), loaded, what)
        return
    piece = loaded.quantized()
    if fmt is None:
        if name in plain:
            raise ValueError(
                f"{name}: checkpoint tensor '{piece.name}' is quantized but other pieces of "
                f"this parameter were not: serve with --quantization none"
            )
        _quantize_param(module, name, piece.fmt, piece.block_k)
    elif fmt != (piece.fmt, piece.block_k):
        raise ValueError(
            f"{name}: checkpoint tensor '{piece.name}' is {piece.fmt} (block {piece.block_k}) "
            f"but other pieces of this parameter are {fmt[0]} (block {fmt[1]})"
        )
    label = f"{what} of '{piece.name}'" if what else f"'{piece.name}'"
    copy_checked(select(getattr(module, name).data), piece.codes, f"codes {label}")
    scales = getattr(module, scale_name(name, piece.fmt)).data
    copy_checked(select(scales), piece.scale, f"scales {label}")
