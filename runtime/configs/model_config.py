# SPDX-License-Identifier: Apache-2.0
"""`ModelConfig`: what the runtime needs to know about a checkpoint before building it.

The HF config object comes from transformers' own config classes (they normalise legacy
keys, e.g. DeepSeek-V4's `compress_ratios` -> `layer_types`), the raw `config.json` is
kept beside it for released keys transformers drops.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(
    dtype: str | torch.dtype, config_dtype: Any = None, device: str | None = None
) -> torch.dtype:
    """`auto` takes the checkpoint's dtype (bf16 when it names none); on a CPU, the one of
    that and float32 the host runs faster (`cpu_dtype.fastest_cpu_dtype`). An explicit
    dtype always wins."""
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
        raise ValueError(f"unsupported dtype {dtype}; use one of {', '.join(SUPPORTED_DTYPES)}")
    if dtype == "auto":
        checkpoint = torch.bfloat16
        if isinstance(config_dtype, torch.dtype) and config_dtype in _DTYPES.values():
            checkpoint = config_dtype
        elif isinstance(config_dtype, str) and config_dtype in _DTYPES:
            checkpoint = _DTYPES[config_dtype]
        if device is not None and torch.device(device).type == "cpu":
            from runtime.configs.cpu_dtype import resolve_auto_cpu_dtype

            return resolve_auto_cpu_dtype(checkpoint)
        return checkpoint
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype '{dtype}'; use one of {', '.join(SUPPORTED_DTYPES)}")
    return _DTYPES[dtype]


# `--quantization`: which quantized checkpoint formats stay quantized in memory
QUANTIZATION_CHOICES = ("auto", "fp8", "mxfp4", "none")


@dataclass(frozen=True)
class ModelConfig:
    model_path: str
    hf_config: Any  # transformers PretrainedConfig
    raw_config: dict
    architectures: tuple[str, ...]
    dtype: torch.dtype
    context_length: int
    # which quantized checkpoint formats stay quantized in memory (`--quantization`)
    quantization: str = "auto"

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def eos_token_ids(self) -> set[int]:
        eos = getattr(self.hf_config, "eos_token_id", None)
        if eos is None:
            return set()
        return {eos} if isinstance(eos, int) else set(eos)

    @classmethod
    def from_path(
        cls,
        model_path: str | Path,
        dtype: str | torch.dtype = "auto",
        context_length: int | None = None,
        device: str | None = "cpu",
        quantization: str = "auto",
    ) -> ModelConfig:
        """`device`: where the model will run (`--dtype auto` on a CPU picks the faster of
        the checkpoint's dtype and float32; None keeps the checkpoint's)."""
        path = Path(model_path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"model path '{model_path}' does not exist or is not a directory: "
                "pass --model-path pointing to a checkpoint directory "
                "(config.json + *.safetensors)"
            )
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"no config.json in '{model_path}': is this a checkpoint directory?"
            )
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"config.json in '{model_path}' is not valid JSON: {err}") from None
        hf_config = _load_hf_config(path, raw)
        architectures = tuple(
            raw.get("architectures") or getattr(hf_config, "architectures", None) or ()
        )
        if not architectures:
            raise ValueError(f"config.json in '{model_path}' names no `architectures`")
        max_positions = getattr(hf_config, "max_position_embeddings", None) or 4096
        if context_length is not None and context_length > max_positions:
            raise ValueError(
                f"--context-length {context_length} exceeds the model's "
                f"max_position_embeddings ({max_positions})"
            )
        config_dtype = getattr(hf_config, "dtype", None) or raw.get("torch_dtype")
        return cls(
            str(path),
            hf_config,
            raw,
            architectures,
            resolve_dtype(dtype, config_dtype, device),
            context_length or max_positions,
            quantization,
        )


def _load_hf_config(path: Path, raw: dict):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError) as err:
        raise ValueError(
            f"transformers cannot read config.json of '{path}' "
            f"(model_type={raw.get('model_type')!r}): {err}"
        ) from None
