# SPDX-License-Identifier: Apache-2.0
"""A benchmark's timed run names every captured step that compiled while it ran: a step
whose state changed since the run began (a compile the warm-up left to the traffic), not
the steps ready before it nor those seen but never compiled."""

from __future__ import annotations

from types import SimpleNamespace

from scripts.bench.warmup import compiled_since, step_states


class Steps:
    capturable = True

    def __init__(self, steps: dict[str, str]):
        self.steps = steps

    def compiled_steps(self):
        return [(name, state, 1.0) for name, state in self.steps.items()]


def engine_with(target: dict[str, str], draft: dict[str, str]):
    drafter = SimpleNamespace(runner=SimpleNamespace(graph_runner=Steps(draft)))
    return SimpleNamespace(
        runner=SimpleNamespace(graph_runner=Steps(target)),
        worker=SimpleNamespace(speculation=SimpleNamespace(drafter=drafter)),
    )


def test_a_timed_run_names_the_steps_that_compiled_during_it():
    engine = engine_with(
        {"decode bucket 16": "ready", "verify bucket 2": "pending"},
        {"draft bucket 2": "pending", "draft bucket 16": "ready"},
    )
    before = step_states(engine)
    assert compiled_since(engine, before) == []
    engine.runner.graph_runner.steps["verify bucket 2"] = "compiling"
    engine.worker.speculation.drafter.runner.graph_runner.steps["draft bucket 2"] = "ready"
    engine.runner.graph_runner.steps["decode bucket 4"] = "failed"  # first seen during the run
    assert compiled_since(engine, before) == [
        "decode bucket 4 (failed)",
        "draft bucket 2 (ready)",
        "verify bucket 2 (compiling)",
    ]
    # the same step name in the target and the draft are two steps
    engine.runner.graph_runner.steps["draft bucket 2"] = "pending"
    assert "draft bucket 2 (ready)" in compiled_since(engine, before)
