# SPDX-License-Identifier: Apache-2.0
"""Model families of the tiny-model trainer, one module each. Every family module exposes
the same names, so that adding a family is adding one module here:

- `NAME`, `MODEL_TYPE` (config.json `model_type`), `HF_CLASS_NAME`, `DEFAULT_OUTPUT`,
  `DEFAULT_WORK_DIR`;
- `add_arguments(parser)` (shape and family flags), `model_config(args, vocab, token_ids)`;
- `TinyModel(config, seed)`: trunk + MTP in training form, `forward(tokens)` -> (trunk
  logits, MTP logits), and optionally `chained_draft(tokens, passes)` (the draft chained
  as the runtime chains it, for `training.distill_draft`); `make_balancer(model, args)` with
  `loss()` and `update()`;
- `released_state_dict(model)`, `load_released_state_(model, tensors)`: the released
  checkpoint names and dtypes; `hf_causal_lm()`: the transformers class for parity;
- `training_summary(args, model)`, `card_introduction`, `card_architecture`,
  `card_training_notes`: the family's lines of training.json and of the model card."""

from __future__ import annotations

from types import ModuleType

from training.families import deepseek_v4, qwen4_exp

FAMILIES: dict[str, ModuleType] = {family.NAME: family for family in (deepseek_v4, qwen4_exp)}


def family_of_config(config: dict) -> ModuleType:
    """The family that wrote a checkpoint, from its config.json `model_type`."""
    for family in FAMILIES.values():
        if config.get("model_type") == family.MODEL_TYPE:
            return family
    raise ValueError(f"no training family for model_type {config.get('model_type')!r}")
