# SPDX-License-Identifier: Apache-2.0
"""From final hidden states to next-token logits (and captured hidden states)."""

from __future__ import annotations

import torch
from torch import nn

from runtime.core.forward_context import ForwardContext
from runtime.core.forward_mode import CaptureHiddenMode
from runtime.core.model_output import LogitsProcessorOutput


class LogitsProcessor(nn.Module):
    """Takes logits at `ctx.logits_row_indices` (all rows when None).

    Hidden capture: FULL returns `aux_hidden` for every input row (the drafter needs them
    all), LAST only for the logit rows.
    """

    def forward(
        self,
        hidden: torch.Tensor,
        lm_head: nn.Module,
        ctx: ForwardContext,
        aux_hidden: torch.Tensor | None = None,
    ) -> LogitsProcessorOutput:
        rows = ctx.logits_row_indices
        selected = hidden if rows is None else hidden[rows]
        logits = lm_head.compute_logits(selected).float()
        captured = None
        mode = ctx.capture_hidden_mode
        if mode.need_capture():
            source = hidden if aux_hidden is None else aux_hidden
            captured = source if mode is CaptureHiddenMode.FULL or rows is None else source[rows]
        return LogitsProcessorOutput(logits, captured)
