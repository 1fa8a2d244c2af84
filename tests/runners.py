# SPDX-License-Identifier: Apache-2.0
"""Test helpers: a `ModelRunner` over a freshly loaded checkpoint (what the engine does),
and a request decoded token by token against reference logits."""

from __future__ import annotations

import torch

from runtime.cache.slot_table import SlotTable
from runtime.configs.model_config import ModelConfig
from runtime.core.forward_mode import ForwardMode
from runtime.execution.model_input import ModelInput
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


def assert_decode_matches(
    runner: ModelRunner, table: SlotTable, ids: torch.Tensor, ref: torch.Tensor, atol: float
) -> None:
    """A fresh request fed `ids` one decode step at a time: step t's logits equal `ref[t]`
    (the reference's logits of the whole sequence at row t)."""
    req = table.open_request()
    table.reserve(req, len(ids))
    for t in range(len(ids)):
        out = runner.forward(ModelInput(ForwardMode.DECODE, ids[t : t + 1], [req], [t], [1]))
        torch.testing.assert_close(
            out.next_token_logits[0], ref[t], atol=atol, rtol=0, msg=lambda m, t=t: f"step {t}: {m}"
        )
