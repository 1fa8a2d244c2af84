# SPDX-License-Identifier: Apache-2.0
"""Checkpoint tensors as the model wants them: quantized weights dequantized, scales consumed.

A weight `X.weight` is quantized when it has a float8_e4m3fn / int8 / uint8 dtype and a
paired scale, named `X.scale` (DeepSeek's released naming) or `X.weight_scale_inv` /
`X.weight_scale` (DeepSeek-V3 / Hugging Face naming). Such a pair comes out as one dequantized
`X.weight`. Every other tensor, including a scale-named tensor with no quantized weight next to
it (e.g. a hyper-connection `scale` parameter), comes out as stored.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from runtime.model_loader.lazy import LazyDequantized, LazyTensor, iterate_lazy
from runtime.model_loader.quantization import block_size_from_config, dequantize_tensor
from runtime.model_loader.safetensors_io import (
    CheckpointError,
    CheckpointIndex,
    TensorReader,
    iterate_tensors,
)

QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.uint8)


def scale_candidates(weight_name: str) -> list[str]:
    """Names a scale of `weight_name` may have in a checkpoint, in order of preference."""
    if not weight_name.endswith(".weight"):
        return []
    base = weight_name[: -len(".weight")]
    return [f"{base}.scale", f"{weight_name}_scale_inv", f"{weight_name}_scale"]


def quantized_pairs(index: CheckpointIndex) -> dict[str, str]:
    """Weight name -> its scale name, for every quantized weight that has a scale."""
    pairs = {}
    for name in index.names():
        scale = next((s for s in scale_candidates(name) if index.has(s)), None)
        if scale is not None and index.dtype(name) in QUANTIZED_DTYPES:
            pairs[name] = scale
    return pairs


def checkpoint_weights(
    model_dir: str | os.PathLike,
    dtype: torch.dtype,
    block_size: tuple[int, int] | None = (128, 128),
    progress: bool = True,
    skip: Callable[[str], bool] | None = None,
    lazy: bool = False,
    keep_formats: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Iterator of `(name, tensor)` over the checkpoint in `model_dir`.

    Quantized weights come out dequantized to `dtype` with FP8 blocks of `block_size` (None:
    `quantization_config.weight_block_size` from `model_dir/config.json`, else 128x128); their
    scales are never yielded. Other tensors keep their stored dtype, since each parameter's
    `weight_loader` casts. Names for which `skip(name)` is true are not read at all (a skipped
    weight's scale is not read either). The directory and headers are checked right away, so
    a bad path raises `CheckpointError` here, not on the first `next()`.

    `lazy=True` yields `LazyTensor` / `LazyDequantized` windows instead (see
    `runtime.model_loader.lazy`): nothing is read until a weight loader materializes the
    rows or columns its rank holds. Each is valid until the next one is yielded. Windows of
    a format in `keep_formats` ("fp8", "mxfp4"; lazy only) are marked `keep_quantized`: a
    loader that multiplies that format stores their codes and scales (`--quantization`).
    """
    index = CheckpointIndex(model_dir)
    if block_size is None:
        block_size = _config_block_size(Path(model_dir))
    pairs = quantized_pairs(index)
    scales = set(pairs.values())
    names = [n for n in index.names() if n not in scales and not (skip and skip(n))]
    if keep_formats and not lazy:
        raise ValueError("keeping weights quantized needs lazy=True")
    if lazy:
        return _stream_lazy(index, names, pairs, dtype, block_size, progress, keep_formats)
    return _stream(index, names, pairs, dtype, block_size, progress)


def _stream_lazy(
    index: CheckpointIndex,
    names: list[str],
    pairs: dict[str, str],
    dtype: torch.dtype,
    block_size: tuple[int, int],
    progress: bool,
    keep_formats: frozenset[str],
) -> Iterator[tuple[str, LazyTensor | LazyDequantized]]:
    with TensorReader(index) as scales:
        for name, tensor in iterate_lazy(index, names, progress=progress):
            scale_name = pairs.get(name)
            if scale_name is None:
                yield name, tensor
            else:
                scale = scales.get(scale_name)
                yield name, LazyDequantized(tensor, scale, block_size, dtype, None, keep_formats)


def _stream(
    index: CheckpointIndex,
    names: list[str],
    pairs: dict[str, str],
    dtype: torch.dtype,
    block_size: tuple[int, int],
    progress: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    # Scales are read one at a time next to their weight, so a scale in another shard costs a
    # small side read rather than holding either shard's tensors in memory.
    with TensorReader(index) as scales:
        for name, tensor in iterate_tensors(index, names, progress=progress):
            scale_name = pairs.get(name)
            if scale_name is None:
                yield name, tensor
                continue
            try:
                weight = dequantize_tensor(tensor, scales.get(scale_name), block_size, dtype)
            except CheckpointError as e:
                raise CheckpointError(f"cannot dequantize '{name}' with '{scale_name}': {e}") from e
            yield name, weight


def checkpoint_formats(index: CheckpointIndex) -> set[str]:
    """The quantized formats the checkpoint's weights are in ("fp8", "mxfp4"), by dtype."""
    formats = set()
    for name in quantized_pairs(index):
        formats.add("fp8" if index.dtype(name) == torch.float8_e4m3fn else "mxfp4")
    return formats


def _config_block_size(model_dir: Path) -> tuple[int, int]:
    """FP8 block size from `model_dir/config.json`; (128, 128) when it does not say."""
    path = model_dir / "config.json"
    if not path.is_file():
        return block_size_from_config({})
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"'{path}' is not valid JSON ({e}): fix or re-download it") from e
    return block_size_from_config(config)
