# SPDX-License-Identifier: Apache-2.0
"""The trainer's model card shows commands as they run today: commands recorded before the
trainer left `scripts/` (`scripts/train_tiny_model.py`, `-m scripts.distill_draft`) are
shown under `training`, and the embedded model's card says what its training.json, so
rendered, says."""

from __future__ import annotations

import json

import pytest

from runtime.engine.engine import DEFAULT_MODEL_DIR
from training.model_card import _card_reproduce_lines, current_command


@pytest.mark.parametrize(
    "recorded, shown",
    [
        (
            "scripts/train_tiny_model.py --max-minutes 60",
            "-m training.train_tiny_model --max-minutes 60",
        ),
        (
            "-m scripts.train_tiny_model --family qwen4_exp",
            "-m training.train_tiny_model --family qwen4_exp",
        ),
        ("-m scripts.distill_draft --max-minutes 55", "-m training.distill_draft --max-minutes 55"),
        ("-m training.distill_draft --seed 1", "-m training.distill_draft --seed 1"),
        ("-m scripts.distill_draftx", "-m scripts.distill_draftx"),  # not a moved module
    ],
)
def test_recorded_commands_are_shown_as_they_run_now(recorded, shown):
    assert current_command(recorded) == shown


def test_the_embedded_model_card_reproduces_with_the_training_package():
    summary = json.loads((DEFAULT_MODEL_DIR / "training.json").read_text())
    card = (DEFAULT_MODEL_DIR / "README.md").read_text()
    commands = [line for line in _card_reproduce_lines(summary) if line.startswith("python ")]
    assert len(commands) == 4 and all(" -m training." in line for line in commands)
    for line in commands:
        assert f"\n{line}\n" in card, line
