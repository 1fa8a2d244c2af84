# SPDX-License-Identifier: Apache-2.0
"""Checkpoint tensors that are read only where a rank needs them.

`LazyTensor` stands for one stored tensor: `shape`, `dtype`, `narrow(dim, start, length)`
(a window, still unread) and `materialize()`, which reads just that window through
safetensors' `get_slice`. Weight loaders narrow to their rank's share first, so under
tensor or expert parallelism no rank ever holds a whole sharded tensor, let alone the whole
checkpoint. `LazyDequantized` does the same for an FP8-block or MXFP4 weight: it reads the
smallest block-aligned window of the packed weight and its scales, dequantizes that and
crops. A lazy tensor is valid while its checkpoint file is open: until the loader iterating
the checkpoint moves on to the next tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from runtime.model_loader.quantization import (
    MXFP4_GROUP,
    dequant_fp8_block,
    dequant_mxfp4,
    dequantize_tensor,
    scale_to_float,
)
from runtime.model_loader.safetensors_io import CheckpointError, CheckpointIndex, walk_shards


@dataclass(frozen=True)
class QuantizedPiece:
    """A window of a quantized weight as `runtime.layers.quantized` stores it. `fp8`: `codes
    [..., N, K]` float8_e4m3fn, `scale [..., N, ceil(K/block_k)]` float32. `mxfp4`: `codes
    [..., N, K/2]` uint8 (two E2M1 codes a byte), `scale [..., N, K/32]` uint8 E8M0 bytes
    (`block_k` 32). `name`: the checkpoint tensor, for errors."""

    fmt: str
    codes: torch.Tensor
    scale: torch.Tensor
    block_k: int
    name: str = ""


def _full(shape) -> tuple[tuple[int, int], ...]:
    return tuple((0, n) for n in shape)


def _narrowed(window, shape, dim: int, start: int, length: int):
    dim = dim % len(window)
    if start < 0 or length < 0 or start + length > shape[dim]:
        raise IndexError(f"narrow({dim}, {start}, {length}) out of range for shape {tuple(shape)}")
    lo = window[dim][0]
    return window[:dim] + ((lo + start, lo + start + length),) + window[dim + 1 :]


class _Window:
    """A rectangular window (`[(start, end)]` per dim) of a tensor that is not read yet."""

    window: tuple[tuple[int, int], ...]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(end - start for start, end in self.window)

    def dim(self) -> int:
        return len(self.window)

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int):
        return self._with_window(_narrowed(self.window, self.shape, dim, start, length))


class LazyTensor(_Window):
    """A window of one stored tensor in an open safetensors file (`safe_open` handle)."""

    def __init__(self, handle, name: str, shape, dtype: torch.dtype, window=None):
        self.handle, self.name, self.dtype = handle, name, dtype
        self.stored_shape = tuple(shape)
        self.window = window if window is not None else _full(shape)

    def _with_window(self, window) -> LazyTensor:
        return LazyTensor(self.handle, self.name, self.stored_shape, self.dtype, window)

    def materialize(self) -> torch.Tensor:
        try:
            if self.window == _full(self.stored_shape):
                return self.handle.get_tensor(self.name)
            return self.handle.get_slice(self.name)[tuple(slice(a, b) for a, b in self.window)]
        except Exception as e:  # safetensors raises its own error type for bad files
            raise CheckpointError(
                f"cannot read tensor '{self.name}' ({e}): the file is corrupt or truncated"
            ) from e


class LazyDequantized(_Window):
    """A window of a quantized weight, dequantized to `dtype` when read.

    FP8 block (`[out, in]` float8 with `[ceil(out/b0), ceil(in/b1)]` scales) or MXFP4 (packed
    `[..., in/2]` E2M1 pairs with `[..., in/32]` E8M0 scales); anything else is dequantized
    whole (`dequantize_tensor`) and then narrowed. `weight` is a `LazyTensor`, `scale` a
    tensor (scales are small)."""

    def __init__(
        self,
        weight: LazyTensor,
        scale: torch.Tensor,
        block_size: tuple[int, int],
        dtype: torch.dtype,
        window=None,
        keep_formats: frozenset[str] = frozenset(),
    ):
        self.weight, self.scale, self.block_size, self.dtype = weight, scale, block_size, dtype
        self.kind = self._kind()
        self.logical_shape = self._logical_shape()
        self.window = window if window is not None else _full(self.logical_shape)
        self.keep_formats = keep_formats
        # weight loaders that can multiply this format store `quantized()`; others materialize
        self.keep_quantized = self.kind in keep_formats

    @property
    def name(self) -> str:
        return self.weight.name

    def _kind(self) -> str:
        w = self.weight
        if w.dtype == torch.float8_e4m3fn and w.dim() == 2:
            return "fp8"
        if (
            w.dtype in (torch.int8, torch.uint8)
            and w.dim() >= 1
            and self.scale.dim() == w.dim()
            and self.scale.shape[-1] * MXFP4_GROUP == w.shape[-1] * 2
        ):
            return "mxfp4"
        return "other"

    def _logical_shape(self) -> tuple[int, ...]:
        shape = tuple(self.weight.shape)
        return shape[:-1] + (2 * shape[-1],) if self.kind == "mxfp4" else shape

    def _with_window(self, window) -> LazyDequantized:
        return LazyDequantized(
            self.weight, self.scale, self.block_size, self.dtype, window, self.keep_formats
        )

    def quantized(self) -> QuantizedPiece:
        """The window's codes and scales in the checkpoint's format, cut together: FP8 with
        one float32 scale row per weight row (columns cut along whole scale blocks), MXFP4
        with its E8M0 bytes (columns cut along whole 32-value groups). Malformed scales
        raise `CheckpointError` naming the tensor."""
        if self.kind == "fp8":
            return self._fp8_piece()
        if self.kind == "mxfp4":
            return self._mxfp4_piece()
        raise CheckpointError(f"'{self.name}' is in no format that can stay quantized")

    def _refuse(self, problem: str) -> CheckpointError:
        return CheckpointError(
            f"cannot keep '{self.name}' ({self.weight.dtype} {tuple(self.weight.shape)}, scale "
            f"{self.scale.dtype} {tuple(self.scale.shape)}) quantized: {problem}"
        )

    def _fp8_piece(self) -> QuantizedPiece:
        (b0, b1), (out, inp) = self.block_size, self.logical_shape
        expected = (-(-out // b0), -(-inp // b1))
        if tuple(self.scale.shape) != expected:
            raise self._refuse(
                f"block size {(b0, b1)} needs a scale of shape {expected}: check "
                f"quantization_config.weight_block_size"
            )
        (r0, r1), (c0, c1) = self.window
        if c0 % b1:
            raise self._refuse(
                f"its columns {c0}..{c1} do not start a {b1}-column scale block (a "
                f"tensor-parallel split of its inputs must keep whole blocks)"
            )
        scale = _finite_scale(scale_to_float(self.scale), self)
        rows = torch.arange(r0, r1) // b0
        scale = scale.index_select(0, rows)[:, c0 // b1 : -(-c1 // b1)].contiguous()
        codes = self.weight.narrow(0, r0, r1 - r0).narrow(1, c0, c1 - c0).materialize()
        if bool(((codes.view(torch.uint8) & 0x7F) == 0x7F).any()):
            raise self._refuse("a weight code is NaN (0x7F / 0xFF in e4m3)")
        return QuantizedPiece("fp8", codes, scale, b1, self.name)

    def _mxfp4_piece(self) -> QuantizedPiece:
        lead, inp = self.logical_shape[:-1], self.logical_shape[-1]
        if tuple(self.scale.shape) != (*lead, inp // MXFP4_GROUP):
            raise self._refuse(f"MXFP4 needs a scale of shape {(*lead, inp // MXFP4_GROUP)}")
        if self.scale.dtype == torch.float8_e8m0fnu:
            scale_bytes = self.scale.view(torch.uint8)
        elif self.scale.dtype == torch.uint8:
            scale_bytes = self.scale
        else:
            raise self._refuse("MXFP4 scales must be E8M0 (float8_e8m0fnu or uint8 bytes)")
        if bool((scale_bytes == 255).any()):
            raise self._refuse("a scale byte is 255 (NaN in E8M0)")
        w, scale = self.weight, scale_bytes
        for dim, (start, end) in enumerate(self.window[:-1]):
            w, scale = w.narrow(dim, start, end - start), scale.narrow(dim, start, end - start)
        c0, c1 = self.window[-1]
        if c0 % MXFP4_GROUP or c1 % MXFP4_GROUP:
            raise self._refuse(
                f"its columns {c0}..{c1} are not whole {MXFP4_GROUP}-value groups (a "
                f"tensor-parallel split of its inputs must keep whole groups)"
            )
        last = len(self.window) - 1
        w = w.narrow(last, c0 // 2, (c1 - c0) // 2)
        scale = scale.narrow(last, c0 // MXFP4_GROUP, (c1 - c0) // MXFP4_GROUP).contiguous()
        codes = w.materialize().view(torch.uint8)
        return QuantizedPiece("mxfp4", codes, scale, MXFP4_GROUP, self.name)

    def materialize(self) -> torch.Tensor:
        if self.kind == "fp8":
            return self._fp8()
        if self.kind == "mxfp4":
            return self._mxfp4()
        try:
            full = dequantize_tensor(
                self.weight.materialize(), self.scale, self.block_size, self.dtype
            )
        except CheckpointError as e:
            raise CheckpointError(f"cannot dequantize '{self.name}': {e}") from e
        return full[tuple(slice(a, b) for a, b in self.window)]

    def _fp8(self) -> torch.Tensor:
        """The block-aligned cover of the window, dequantized, then cropped."""
        blocks, w = self.block_size, self.weight
        aligned, scale, crop = [], self.scale, []
        for dim, ((start, end), block) in enumerate(zip(self.window, blocks)):
            first, last = start // block, -(-end // block)
            lo, hi = first * block, min(last * block, self.logical_shape[dim])
            aligned.append((lo, hi))
            scale = scale.narrow(dim, first, last - first)
            crop.append(slice(start - lo, end - lo))
        for dim, (lo, hi) in enumerate(aligned):
            w = w.narrow(dim, lo, hi - lo)
        piece = dequant_fp8_block(w.materialize(), scale, blocks, self.dtype)
        return piece[tuple(crop)]

    def _mxfp4(self) -> torch.Tensor:
        """Leading dims as they are; the last dim aligned to whole 32-value scale groups."""
        w, scale = self.weight, self.scale
        for dim, (start, end) in enumerate(self.window[:-1]):
            w, scale = w.narrow(dim, start, end - start), scale.narrow(dim, start, end - start)
        start, end = self.window[-1]
        first, last = start // MXFP4_GROUP, -(-end // MXFP4_GROUP)
        last_dim = len(self.window) - 1
        w = w.narrow(last_dim, first * MXFP4_GROUP // 2, (last - first) * MXFP4_GROUP // 2)
        scale = scale.narrow(last_dim, first, last - first)
        piece = dequant_mxfp4(w.materialize(), scale, self.dtype)
        offset = first * MXFP4_GROUP
        return piece[..., start - offset : end - offset]


def _finite_scale(scale: torch.Tensor, window: LazyDequantized) -> torch.Tensor:
    if not bool(torch.isfinite(scale).all()):
        raise window._refuse("a scale is not finite (NaN or infinity)")
    return scale


def iterate_lazy(
    index: CheckpointIndex,
    names: Iterable[str] | None = None,
    progress: bool = True,
    desc: str = "Loading weights",
) -> Iterator[tuple[str, LazyTensor]]:
    """`iterate_tensors`' order and checks, but yields `LazyTensor`s that read nothing until
    materialized; each is valid until the next one is yielded."""
    for handle, _, name in walk_shards(index, names, progress, desc):
        yield name, LazyTensor(handle, name, index.shape(name), index.dtype(name))
