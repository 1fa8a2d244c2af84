# SPDX-License-Identifier: Apache-2.0
"""Dequantizing the checkpoint formats DeepSeek releases: FP8 block weights and MXFP4 experts.

* E8M0 scale byte `e` is `2^(e - 127)`; `e = 255` is NaN.
* FP8 block: `W [out, in]` float8_e4m3fn with `S [ceil(out/b0), ceil(in/b1)]` (float32 or
  E8M0); `W_deq[i, j] = W[i, j] * S[i // b0, j // b1]`.
* MXFP4: `Wq [..., in/2]` int8/uint8 holding two E2M1 codes per byte (low nibble = element
  2k, high nibble = element 2k+1) with `S [..., in/32]` E8M0;
  `W[i, j] = e2m1(code[i, j]) * S[i, j // 32]`.

All products are taken in float32 (exact for power-of-two scales) and then cast to `dtype`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from runtime.model_loader.safetensors_io import CheckpointError

DEFAULT_BLOCK_SIZE = (128, 128)
MXFP4_GROUP = 32

# E2M1 value of each 4-bit code `s e e m`: the low 3 bits pick the magnitude, bit 3 the sign.
_E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
_E2M1_VALUES = torch.tensor(_E2M1_MAGNITUDES + [-m for m in _E2M1_MAGNITUDES])


def e8m0_to_float(t: torch.Tensor) -> torch.Tensor:
    """float32 values of E8M0 scales: `float8_e8m0fnu`, or uint8 holding the raw bytes."""
    if t.dtype == torch.float8_e8m0fnu:
        return t.float()
    if t.dtype == torch.uint8:
        # exp2(255 - 127) would be +inf; the format says that byte is NaN.
        return torch.where(t == 255, torch.nan, torch.exp2(t.float() - 127))
    raise CheckpointError(
        f"E8M0 scales must be float8_e8m0fnu or uint8 bytes, got {t.dtype}: check the scale "
        f"tensor's dtype in the checkpoint"
    )


def scale_to_float(s: torch.Tensor) -> torch.Tensor:
    """float32 values of a scale tensor stored as a float dtype or as E8M0."""
    if s.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return e8m0_to_float(s)
    if s.is_floating_point():
        return s.float()
    raise CheckpointError(
        f"unsupported scale dtype {s.dtype} (shape {tuple(s.shape)}): expected float32 or E8M0"
    )


QUANTIZATION_FORMATS = {"fp8": ("fp8",), "mxfp4": ("mxfp4",), "none": ()}


def formats_to_keep(mode: str, config: Mapping) -> frozenset[str]:
    """The checkpoint formats `--quantization mode` keeps quantized in memory: `auto` those
    the config declares (`quantization_config.quant_method` fp8 or mxfp4, and DeepSeek-V4's
    `expert_dtype: fp4` for MXFP4 routed experts), `fp8` / `mxfp4` that one, `none` nothing
    (every quantized tensor is dequantized on load)."""
    if mode == "auto":
        method = (config.get("quantization_config") or {}).get("quant_method")
        declared = {method} & {"fp8", "mxfp4"}
        if config.get("expert_dtype") == "fp4":
            declared.add("mxfp4")
        return frozenset(declared)
    if mode not in QUANTIZATION_FORMATS:
        choices = ", ".join(["auto", *QUANTIZATION_FORMATS])
        raise ValueError(f"--quantization {mode!r} is not supported; use one of {choices}")
    return frozenset(QUANTIZATION_FORMATS[mode])


def block_size_from_config(config: Mapping) -> tuple[int, int]:
    """`quantization_config.weight_block_size` of a model config dict, else (128, 128)."""
    block = (config.get("quantization_config") or {}).get("weight_block_size")
    if block is None:
        return DEFAULT_BLOCK_SIZE
    valid = isinstance(block, (list, tuple)) and len(block) == 2
    if not (valid and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(
            f"quantization_config.weight_block_size must be two positive ints, got {block!r}: "
            f"fix config.json"
        )
    return int(block[0]), int(block[1])


def dequant_fp8_block(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """`[out, in]` fp8 weight with per-block `scale [ceil(out/b0), ceil(in/b1)]` -> `dtype`.

    Edge blocks of a shape that is not a multiple of the block size are partial: the expanded
    scale is cropped to `[out, in]`.
    """
    b0, b1 = block_size
    if weight.dim() != 2:
        raise CheckpointError(f"fp8 block weight must be 2-D, got shape {tuple(weight.shape)}")
    out, inp = weight.shape
    expected = (-(-out // b0), -(-inp // b1))
    if tuple(scale.shape) != expected:
        raise CheckpointError(
            f"fp8 weight of shape {(out, inp)} with block size {(b0, b1)} needs a scale of shape "
            f"{expected}, got {tuple(scale.shape)}: check quantization_config.weight_block_size"
        )
    s = scale_to_float(scale).repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)
    return (weight.float() * s[:out, :inp]).to(dtype)


def dequant_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """`[..., in/2]` packed E2M1 pairs with E8M0 `scale [..., in/32]` -> `[..., in]` `dtype`."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise CheckpointError(f"mxfp4 weight must be int8 or uint8, got {packed.dtype}")
    lead, half = tuple(packed.shape[:-1]), packed.shape[-1]
    inp = 2 * half
    if inp % MXFP4_GROUP or tuple(scale.shape) != (*lead, inp // MXFP4_GROUP):
        raise CheckpointError(
            f"mxfp4 weight of shape {tuple(packed.shape)} ({inp} values per row) needs a scale "
            f"of shape {(*lead, inp // MXFP4_GROUP)}, got {tuple(scale.shape)}"
        )
    # int8 and uint8 hold the same bits; shifting uint8 keeps the high nibble free of sign bits.
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).to(torch.int32)
    values = _E2M1_VALUES.to(packed.device)[codes].reshape(*lead, inp // MXFP4_GROUP, MXFP4_GROUP)
    out = values * scale_to_float(scale).unsqueeze(-1)
    return out.reshape(*lead, inp).to(dtype)


def dequantize_tensor(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantize `weight` with its `scale`, choosing the format from dtypes and shapes.

    float8_e4m3fn -> FP8 block; int8/uint8 whose scale's last dim is `2 * in_bytes / 32` ->
    MXFP4. Anything else raises `CheckpointError` naming both dtypes and shapes.
    """
    if weight.dtype == torch.float8_e4m3fn:
        return dequant_fp8_block(weight, scale, block_size, dtype)
    if (
        weight.dtype in (torch.int8, torch.uint8)
        and weight.dim() >= 1
        and scale.dim() == weight.dim()
        and scale.shape[-1] * MXFP4_GROUP == weight.shape[-1] * 2
    ):
        return dequant_mxfp4(weight, scale, dtype)
    raise CheckpointError(
        f"unsupported quantized weight: weight {weight.dtype} {tuple(weight.shape)} with scale "
        f"{scale.dtype} {tuple(scale.shape)}; supported are float8_e4m3fn with block scales and "
        f"int8/uint8 MXFP4 with one E8M0 scale per {MXFP4_GROUP} values"
    )
