# SPDX-License-Identifier: Apache-2.0
"""The `n` fan-out: ids `rid-k`, seeds offset by the choice index, written once; and the
HTTP layer reads engine state only through its published snapshots."""

from __future__ import annotations

import ast
from pathlib import Path

from runtime.core.sampling_params import SamplingParams
from runtime.engine.fanout import fan_out

SERVER = Path(__file__).resolve().parents[2] / "runtime" / "server"


def test_one_choice_keeps_its_id_and_seed():
    params = SamplingParams(sampling_seed=5)
    assert fan_out(params, "abc") == [("abc", params)]


def test_n_choices_get_indexed_ids_and_offset_seeds():
    params = SamplingParams(n=3, sampling_seed=100, temperature=0.7)
    choices = fan_out(params, "abc")
    assert [rid for rid, _ in choices] == ["abc-0", "abc-1", "abc-2"]
    assert [p.sampling_seed for _, p in choices] == [100, 101, 102]
    assert all(p.n == 1 and p.temperature == 0.7 for _, p in choices)
    assert (params.n, params.sampling_seed) == (3, 100)  # the caller's copy is untouched


def test_unseeded_choices_stay_unseeded():
    assert [p.sampling_seed for _, p in fan_out(SamplingParams(n=2), "x")] == [None, None]


def test_no_server_module_reads_scheduler_internals():
    """Routes run on the event loop; only the engine loop thread may touch the scheduler."""
    offenders = []
    for path in SERVER.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("scheduler", "slot_table"):
                offenders.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert not offenders, offenders
