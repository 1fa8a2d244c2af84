# SPDX-License-Identifier: Apache-2.0
"""Model families of scripts/train_tiny_model.py. Each module exposes the same names: its
flags (`add_arguments`), `model_config`, `TinyModel` (trunk + MTP in training form),
`make_balancer`, the released checkpoint names (`released_state_dict`,
`load_released_state_`), the transformers class for parity (`hf_causal_lm`) and its
model-card lines."""

from __future__ import annotations

from types import ModuleType

from tiny_training import deepseek_v4, qwen4_exp

FAMILIES: dict[str, ModuleType] = {family.NAME: family for family in (deepseek_v4, qwen4_exp)}


def family_of_config(config: dict) -> ModuleType:
    """The family that wrote a checkpoint, from its config.json `model_type`."""
    for family in FAMILIES.values():
        if config.get("model_type") == family.MODEL_TYPE:
            return family
    raise ValueError(f"no training family for model_type {config.get('model_type')!r}")
