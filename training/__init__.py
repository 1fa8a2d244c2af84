# SPDX-License-Identifier: Apache-2.0
"""The tiny-model trainer and draft distiller: a development tool beside the runtime, run
from a clone's root (`python -m training.train_tiny_model`, `python -m
training.distill_draft`) and not installed with the `runtime` package. It imports the
runtime; the runtime never imports it. One module per stage: `corpus` (the standard
library, its train / held-out split and the BPE tokenizer), `families` (one module per
model family: training-form model, released checkpoint names, router balancing, model-card
lines), `loop` (losses, optimiser, schedule, the training loop), `draft_distill` (the
chained draft's distillation), `export` (the checkpoint directory), `evaluation` (held-out
losses, the runtime's NEXTN speed and acceptance, transformers parity), `hot_vocab` and
`model_card` (the checkpoint's README)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
