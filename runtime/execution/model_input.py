# SPDX-License-Identifier: Apache-2.0
"""`ModelInput` (one forward's worth of work, in scheduler terms) and `HiddenRows` (where a
draft's captured hidden states came from): the plain types both runners read.

`ModelRunner` runs a `ModelInput` eagerly and `GraphRunner` pads it into a captured step;
both import these from here, so neither imports the other for them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode


class _Rows(enum.Enum):
    DEFAULT = "default"  # an enum member: still itself after pickling to another rank


# `ModelInput.logits_row_indices` left unset: the rows its forward mode scores by default
DEFAULT_ROWS = _Rows.DEFAULT

TARGET, DRAFT = "target", "draft"  # runner roles (`HiddenRows.source`, `ModelRunner.role`)


@dataclass(frozen=True)
class HiddenRows:
    """Where `captured_hidden_states` came from: rows `rows` (None: all) of the hidden
    states of the latest forward of the runner with role `source`. Every rank holds those
    (they are replicated), so another rank rebuilds the tensor instead of receiving it."""

    source: str
    rows: torch.Tensor | None = None

    def take(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.rows is None else hidden[self.rows.to(hidden.device)]


@dataclass
class ModelInput:
    """One forward's worth of work, in scheduler terms (no tensors of the model)."""

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T] new tokens, request after request
    req_pool_indices: list[int]
    prefix_lens: list[int]  # tokens of each request already in the cache
    extend_lens: list[int]  # new tokens of each request in `input_ids`
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    captured_hidden_states: torch.Tensor | None = None  # draft input: target hidden per row
    logits_row_indices: object = field(default=DEFAULT_ROWS)  # rows to score; default by mode
    spec_step_idx: int = 0
    hidden_rows: HiddenRows | None = None  # provenance of `captured_hidden_states`
