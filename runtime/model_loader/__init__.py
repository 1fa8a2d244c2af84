# SPDX-License-Identifier: Apache-2.0
"""Reading safetensors checkpoints into the runtime: shard discovery, header validation,
streaming tensors, and dequantizing FP8-block / MXFP4 weights with their scales."""

from runtime.model_loader.loader import checkpoint_weights
from runtime.model_loader.quantization import (
    block_size_from_config,
    dequant_fp8_block,
    dequant_mxfp4,
    dequantize_tensor,
    e8m0_to_float,
)
from runtime.model_loader.safetensors_io import (
    CheckpointError,
    CheckpointIndex,
    find_checkpoint_files,
    iterate_tensors,
)

__all__ = [
    "CheckpointError",
    "CheckpointIndex",
    "block_size_from_config",
    "checkpoint_weights",
    "dequant_fp8_block",
    "dequant_mxfp4",
    "dequantize_tensor",
    "e8m0_to_float",
    "find_checkpoint_files",
    "iterate_tensors",
]
