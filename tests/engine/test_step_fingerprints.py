# SPDX-License-Identifier: Apache-2.0
"""The file names of stored steps (`step_store.fingerprint`) in real engines: stable while an
engine serves and from one engine to the next of the same configuration (or a second start
would never find its steps), different when the caches' layout differs (or it would load a
step traced for other shapes).

No compiles: the steps are met by real batches and left pending (they run eagerly); each
fingerprint is taken on the padding batch the compile would trace.
"""

from __future__ import annotations

import pytest
import torch

from runtime import Engine
from runtime.configs.capture import DISABLE_ENV
from runtime.engine.capture_warmup import captured_runners
from runtime.execution.step_compiler import StepCompiler
from runtime.execution.step_store import fingerprint
from tests.engine.test_captured_steps import prompts_of, staggered_generate

NEXTN = {"speculative_algorithm": "NEXTN", "speculative_disable_by_batch_size": "none"}


def fingerprints(engine) -> dict:
    prints = {}
    for runner in captured_runners(engine):
        graph_runner = runner.graph_runner
        for key, step in list(graph_runner.compiler.steps.items()):
            with torch.inference_mode():
                args = graph_runner.compiler.padding_args(step)
            prints[(runner.role, key)] = fingerprint(
                step.fn, args, graph_runner.compiler.options(), key.describe()
            )
    return prints


@pytest.mark.parametrize("spec", [{}, NEXTN], ids=["plain", "nextn"])
def test_fingerprints_hold_while_serving_and_across_engines(checkpoint, monkeypatch, spec):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.setattr(StepCompiler, "schedule", lambda self, step: None)  # stay eager
    prompts = prompts_of((5, 23, 40, 11), seed=3)
    lengths = [12, 6, 15, 9]

    def serve(**overrides):
        config = dict(model_path=str(checkpoint), dtype="float32", page_size=4, **spec)
        engine = Engine(**{**config, **overrides}, cuda_graph_bs=[1, 2, 4])
        staggered_generate(engine, prompts, lengths)
        return engine

    engine = serve()
    first = fingerprints(engine)
    kinds = {key.recipe or key.mode.name for _, key in first}
    assert kinds >= ({"DECODE"} if not spec else {"TARGET_VERIFY", "nextn round"}), kinds
    staggered_generate(engine, prompts, lengths)  # more traffic: counters, caches, snapshots
    assert fingerprints(engine) == first
    assert fingerprints(serve()) == first  # a second start finds every step
    other_layout = fingerprints(serve(page_size=8))
    assert other_layout.keys() == first.keys()
    assert not set(other_layout.values()) & set(first.values())
