# SPDX-License-Identifier: Apache-2.0
"""The `EntryClass` registry: every exported class is a target or an MTP draft on the
shared base, and every target names a registered draft for NEXTN."""

from __future__ import annotations

import inspect

from runtime.models.base import DraftModel, TargetModel
from runtime.models.registry import model_classes


def test_entry_classes_are_targets_or_drafts_on_the_shared_base():
    classes = model_classes()
    assert {
        "DeepseekV4ForCausalLM",
        "DeepseekV4ForCausalLMNextN",
        "Qwen4ExpForCausalLM",
        "Qwen4ExpForConditionalGeneration",
        "Qwen4ExpMTP",
    } <= set(classes)
    for name, cls in classes.items():
        assert issubclass(cls, (TargetModel, DraftModel)), name
        assert list(inspect.signature(cls.forward).parameters) == [
            "self",
            "ctx",
            "input_ids",
            "captured_hidden_states",
            "spec_step_idx",
        ], name
        if issubclass(cls, TargetModel):
            assert issubclass(classes[cls.draft_architecture], DraftModel), name
