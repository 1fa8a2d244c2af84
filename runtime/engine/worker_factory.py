# SPDX-License-Identifier: Apache-2.0
"""Load the target model (and the MTP draft when speculating) and build the worker that
runs one scheduler step: `PlainWorker`, or `NextNWorker` over the target and an
`MTPDrafter` (DeepSeek-V3 report, section 2.2: the MTP module shares the target's
embedding and output head)."""

from __future__ import annotations

import logging

import torch

from runtime.cache.slot_table import SlotTable
from runtime.configs.capture import CaptureConfig
from runtime.configs.model_config import ModelConfig
from runtime.configs.speculative import SpeculativeConfig
from runtime.configs.token_map import check_token_map
from runtime.distributed import Mapping
from runtime.execution.model_runner import DRAFT, TARGET, ModelRunner
from runtime.execution.worker import PlainWorker
from runtime.layers.narrow_weights import attach_narrow_copies
from runtime.model_loader.build import load_model
from runtime.models.registry import model_classes, resolve_model_class
from runtime.speculative.drafter import MTPDrafter
from runtime.speculative.nextn_worker import NextNWorker

logger = logging.getLogger(__name__)


def build_runners(
    model_config: ModelConfig,
    slot_table: SlotTable,
    spec: SpeculativeConfig | None,
    mapping: Mapping | None = None,
    device: str = "cpu",
    progress: bool = False,
    snapshot_slots: int = 0,
    capture: CaptureConfig | None = None,
) -> dict[str, ModelRunner]:
    """The target runner and, when speculating, the draft's (sharing the target's embedding
    and vocab-parallel head), each loading this rank's shard of its weights. Every pool gets
    `snapshot_slots` slots of per-request state for the prefix cache (0: it is off).
    `capture`: both runners replay their decode, verify and draft steps from captured
    graphs, verify-shaped steps at the speculative width."""
    target_cls = resolve_model_class(model_config.architectures)
    draft_cls = draft_class(target_cls, model_config) if spec else None
    if spec and spec.hot_token_ids is not None:
        check_token_map(spec.hot_token_ids, model_config.vocab_size)  # before any weights
    pass_width = spec.num_draft_tokens if spec else 1

    def runner(cls: type, role: str, width: int) -> ModelRunner:
        model = load_model(model_config, cls, mapping, progress=progress).to(device)
        return ModelRunner(
            model,
            model_config,
            slot_table,
            width,
            device=device,
            role=role,
            capture=capture,
            verify_width=pass_width,
        )

    runners = {TARGET: runner(target_cls, TARGET, pass_width)}
    if draft_cls is not None:
        # The draft writes up to `num_steps` positions past the committed length (its chained
        # steps) on top of rows a later round may reject; rings this much longer still hold
        # the window before any position of the last round, which is where the prefix cache
        # may snapshot a request whose round ran past its stop.
        draft = runners[DRAFT] = runner(draft_cls, DRAFT, max(pass_width, 2 * spec.num_steps))
        draft.model.set_embed_and_head(*runners[TARGET].model.get_embed_and_head())
        if spec.hot_token_ids is not None:
            draft.model.use_hot_vocab(spec.hot_token_ids)
    if snapshot_slots:
        for each in runners.values():
            each.kv_pool.allocate_snapshots(snapshot_slots)
    narrow_bytes = 0
    if capture is not None and capture.narrow_weights:  # after the draft's head is in place
        captured = [r.model for r in runners.values() if r.graph_runner is not None]
        narrow_bytes = attach_narrow_copies(captured)
    if narrow_bytes:
        logger.info(
            "captured steps read bf16 copies of fp32 weights bf16 holds exactly (and products "
            "of many rows their AMX tile layout where the CPU has AMX): %.1f MiB",
            narrow_bytes / 2**20,
        )
    return runners


def build_worker(
    model_config: ModelConfig,
    slot_table: SlotTable,
    spec: SpeculativeConfig | None,
    eos_ids: set[int],
    generator: torch.Generator | None,
    device: str = "cpu",
    progress: bool = False,
    mapping: Mapping | None = None,
    broadcaster=None,
    snapshot_slots: int = 0,
    capture: CaptureConfig | None = None,
    max_pass_rows: int | None = None,
) -> tuple[ModelRunner, PlainWorker | NextNWorker]:
    """(target runner, worker). The model classes come from the checkpoint's architectures.
    On rank 0 of a replica, `broadcaster` sends every forward to the other ranks; `capture`
    replays decode, verify and draft steps from captured graphs; `max_pass_rows` bounds a
    draft pass over rows it skipped (the prefill chunk budget)."""
    runners = build_runners(
        model_config, slot_table, spec, mapping, device, progress, snapshot_slots, capture
    )
    for runner in runners.values():
        runner.broadcaster = broadcaster
    target = runners[TARGET]
    if not spec:
        return target, PlainWorker(target, eos_ids, generator)
    drafter = MTPDrafter(runners[DRAFT], spec.num_steps)
    return target, NextNWorker(target, drafter, spec, eos_ids, generator, max_pass_rows)


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
