# SPDX-License-Identifier: Apache-2.0
"""Build a model for a checkpoint and fill it: class from the registry, parameters in the
compute dtype, tensors streamed (and dequantized) from safetensors."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from runtime.configs.model_config import ModelConfig
from runtime.distributed import Mapping
from runtime.model_loader.loader import checkpoint_formats, checkpoint_weights
from runtime.model_loader.quantization import formats_to_keep
from runtime.model_loader.safetensors_io import CheckpointError, CheckpointIndex


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    model_config: ModelConfig, model_cls: type | None = None, mapping: Mapping | None = None
) -> nn.Module:
    """An unfilled model in the compute dtype (fp32 where the model asks for it)."""
    if model_cls is None:
        from runtime.models.registry import resolve_model_class

        model_cls = resolve_model_class(model_config.architectures)
    with default_dtype(model_config.dtype):
        model = model_cls(model_config.hf_config, mapping or Mapping.single())
    return model.eval()


def load_model(
    model_config: ModelConfig,
    model_cls: type | None = None,
    mapping: Mapping | None = None,
    progress: bool = True,
) -> nn.Module:
    """`model_cls` defaults to the registry's class for the checkpoint's architecture."""
    keep = kept_formats(model_config)
    model = build_model(model_config, model_cls, mapping)
    skip = getattr(model, "skip_checkpoint_weight", None)
    # block_size=None: the FP8 block size comes from the checkpoint's quantization_config
    # Lazy windows: every weight loader reads only the rows / columns its rank holds.
    weights = checkpoint_weights(
        model_config.model_path,
        model_config.dtype,
        block_size=None,
        progress=progress,
        skip=skip,
        lazy=True,
        keep_formats=keep,
    )
    model.load_weights(weights)
    return model


def kept_formats(model_config: ModelConfig) -> frozenset[str]:
    """The formats `model_config.quantization` keeps quantized in memory; an explicit format
    the checkpoint has no weights in is refused (there is no online quantization)."""
    mode = getattr(model_config, "quantization", "auto")
    keep = formats_to_keep(mode, model_config.raw_config)
    if mode in ("auto", "none"):
        return keep
    present = checkpoint_formats(CheckpointIndex(model_config.model_path))
    if not keep <= present:
        raise CheckpointError(
            f"--quantization {mode}: '{model_config.model_path}' holds no {mode} weights "
            f"(it has {', '.join(sorted(present)) or 'no quantized weights'}); weights are "
            f"not quantized online: use --quantization auto or none"
        )
    return keep
