# SPDX-License-Identifier: Apache-2.0
"""Bucket keys: which captured step, if any, runs a batch (`StepKeys.step_key`).

A step is capturable when every request runs the same number of rows (decode and chained
draft steps: 1; target verify and the draft over verified rows: the runner's
`verify_width`) and its batch fits a bucket (`CaptureConfig.buckets`). A `StepKey` names one
graph: the step's kind (mode, rows per request, logits and hidden layout, draft step index,
a whole draft round's step count or a caller's recipe) and its bucket, the smallest that
holds the batch. Keys only describe; compiling and running them is `step_compiler`'s and
`graph_runner`'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.execution.model_input import ModelInput

CAPTURED_MODES = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)
LOGITS_ALL, LOGITS_PER_REQUEST = "all rows", "one row per request"


@dataclass(frozen=True)
class StepKey:
    mode: ForwardMode
    rows_per_req: int
    bucket: int
    capture_hidden: CaptureHiddenMode
    logits: str  # LOGITS_ALL or LOGITS_PER_REQUEST
    hidden_input: bool
    spec_step_idx: int
    # > 0: a whole draft round in one graph (`GraphRunner.try_draft_round`): the extend over
    # verified rows, then `draft_steps - 1` chained steps, greedy picks in between
    draft_steps: int = 0
    recipe: str = ""  # a step its caller defines (`StepRecipe.name`, `GraphRunner.try_recipe`)

    def describe(self) -> str:
        rows = "" if self.rows_per_req == 1 else f" x {self.rows_per_req} rows"
        if self.recipe:
            return f"{self.recipe} bs {self.bucket}{rows}"
        if self.draft_steps:
            return f"draft round ({self.draft_steps} steps) bs {self.bucket}{rows}"
        step = f" step {self.spec_step_idx}" if self.spec_step_idx else ""
        return f"{self.mode.name.lower()}{step} bs {self.bucket}{rows}"


class StepKeys:
    """The keys of one runner's captured steps. `runner`: read at each call for its
    `verify_width` and its model's `canonical_spec_step` (draft step indices that share one
    graph)."""

    def __init__(self, buckets, runner):
        self.buckets, self.runner = buckets, runner

    def bucket_for(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def step_key(self, inp: ModelInput) -> StepKey | None:
        """The captured step that runs `inp`, or None when it must run eagerly."""
        if inp.forward_mode not in CAPTURED_MODES:
            return None
        lens = inp.extend_lens
        q = lens[0] if lens else 0
        # decode and chained draft steps run one row per request, verify rounds and the draft
        # over them the full speculative width; other uniform batches (a draft extend over
        # equally short prompts) are rare enough to run eagerly instead of compiling for them
        wanted = 1 if inp.forward_mode is ForwardMode.DECODE else self.runner.verify_width
        if q != wanted or any(n != q for n in lens):
            return None
        bucket = self.bucket_for(len(lens))
        if bucket is None:
            return None
        rows = logits_rows_of(inp, q)
        if rows is None:
            logits = LOGITS_ALL
        elif len(rows) == len(lens):
            logits = LOGITS_PER_REQUEST
        else:
            return None
        canonical = getattr(self.runner.model, "canonical_spec_step", None)
        return StepKey(
            inp.forward_mode,
            q,
            bucket,
            inp.capture_hidden_mode,
            logits,
            inp.captured_hidden_states is not None,
            inp.spec_step_idx if canonical is None else canonical(inp.spec_step_idx),
        )

    def round_key(self, inp: ModelInput, num_steps: int) -> StepKey | None:
        """The captured draft round that runs the draft's extend `inp` and `num_steps - 1`
        chained steps after it, or None (not a uniform extend over verified rows with one
        logits row per request and the hidden state of that row)."""
        key = self.step_key(inp)
        if (
            key is None
            or key.mode is not ForwardMode.DRAFT_EXTEND
            or key.logits != LOGITS_PER_REQUEST
            or key.capture_hidden is not CaptureHiddenMode.LAST
            or not key.hidden_input
            or num_steps < 1
        ):
            return None
        return dataclasses.replace(key, draft_steps=num_steps)


def logits_rows_of(inp: ModelInput, rows_per_req: int) -> list[int] | None:
    """The rows `inp` wants logits for (None: all)."""
    rows = inp.logits_row_indices
    if isinstance(rows, torch.Tensor):
        return rows.tolist()
    if rows is None or isinstance(rows, (list, tuple)):
        return rows
    # the runner's default: each request's last row for a draft extend, every row otherwise
    if inp.forward_mode is not ForwardMode.DRAFT_EXTEND:
        return None
    return [(b + 1) * rows_per_req - 1 for b in range(len(inp.extend_lens))]
