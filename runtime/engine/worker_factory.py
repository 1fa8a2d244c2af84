# SPDX-License-Identifier: Apache-2.0
"""Load the target model (and the MTP draft when speculating) and build the worker that
runs one scheduler step: `PlainWorker`, or `NextNWorker` over the target and an
`MTPDrafter` (DeepSeek-V3 report, section 2.2: the MTP module shares the target's
embedding and output head)."""

from __future__ import annotations

import torch

from runtime.cache.slot_table import SlotTable
from runtime.configs.model_config import ModelConfig
from runtime.configs.speculative import SpeculativeConfig
from runtime.execution.model_runner import ModelRunner
from runtime.execution.worker import PlainWorker
from runtime.model_loader.build import load_model
from runtime.models.registry import model_classes, resolve_model_class
from runtime.speculative.drafter import MTPDrafter
from runtime.speculative.nextn_worker import NextNWorker


def build_worker(
    model_config: ModelConfig,
    slot_table: SlotTable,
    spec: SpeculativeConfig | None,
    eos_ids: set[int],
    generator: torch.Generator | None,
    device: str = "cpu",
    progress: bool = False,
) -> tuple[ModelRunner, PlainWorker | NextNWorker]:
    """(target runner, worker). The model classes come from the checkpoint's architectures."""
    target_cls = resolve_model_class(model_config.architectures)
    draft_cls = draft_class(target_cls, model_config) if spec else None
    pass_width = spec.num_draft_tokens if spec else 1

    def runner(cls: type, width: int) -> ModelRunner:
        model = load_model(model_config, cls, progress=progress)
        return ModelRunner(model, model_config, slot_table, width, device=device)

    target = runner(target_cls, pass_width)
    if not spec:
        return target, PlainWorker(target, eos_ids, generator)
    # The draft writes up to `num_steps` positions past the committed length (its chained
    # steps) on top of rows a later round may reject; rings this much longer still hold
    # the window before any position of the last round, which is where the prefix cache
    # may snapshot a request whose round ran past its stop.
    draft = runner(draft_cls, max(pass_width, 2 * spec.num_steps))
    draft.model.set_embed_and_head(*target.model.get_embed_and_head())
    drafter = MTPDrafter(draft, spec.num_steps)
    return target, NextNWorker(target, drafter, spec, eos_ids, generator)


def draft_class(target_cls: type, model_config: ModelConfig) -> type:
    """The MTP draft class paired with `target_cls`; ValueError when the checkpoint has none."""
    name = getattr(target_cls, "draft_architecture", None)
    if (
        name is None
        or name not in model_classes()
        or not target_cls.has_draft_layers(model_config.hf_config)
    ):
        raise ValueError(
            f"{target_cls.__name__} checkpoint at '{model_config.model_path}' has no "
            "MTP (NextN) draft layer in its config: use a checkpoint "
            "with `mtp.*` weights or drop --speculative-algorithm"
        )
    return model_classes()[name]
