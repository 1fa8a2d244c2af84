# SPDX-License-Identifier: Apache-2.0
"""Test helper: a `ModelRunner` over a freshly loaded checkpoint (what the engine does)."""

from __future__ import annotations

from runtime.cache.slot_table import SlotTable
from runtime.configs.model_config import ModelConfig
from runtime.execution.model_runner import ModelRunner
from runtime.model_loader.build import load_model


def load_runner(
    config: ModelConfig,
    table: SlotTable,
    max_tokens_per_pass: int = 1,
    model_cls: type | None = None,
) -> ModelRunner:
    model = load_model(config, model_cls, progress=False)
    return ModelRunner(model, config, table, max_tokens_per_pass)
