# SPDX-License-Identifier: Apache-2.0
"""What a model forward hands back to the runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # [R, vocab] fp32, one row per requested input row
    hidden_states: torch.Tensor | None = None  # [T or R, D] captured hidden, when asked
