# SPDX-License-Identifier: Apache-2.0
"""Captured steps as CUDA graphs (`runtime.execution.graph_runner` on a CUDA device).

The CPU suite proves the captured steps through `torch.compile`; on a GPU the same static
steps are recorded into `torch.cuda.CUDAGraph`s and replayed. These tests run only where
CUDA is available (marked `gpu`: CI has no GPU; run them on one with
`python -m pytest -q -m gpu`). Oracle: transformers' `generate`
(on the CPU) and the eager engine on the same device.
"""

from __future__ import annotations

import json

import pytest

from runtime import Engine
from runtime.configs.capture import DISABLE_ENV
from tests.engine.conftest import FAMILIES, build_mtp_checkpoint
from tests.engine.test_captured_steps import GREEDY, prompts_of, staggered_generate
from tests.engine.test_engine import hf_greedy

pytestmark = pytest.mark.gpu

BUCKETS = [1, 4]  # 2 and 3 live requests pad into 4
NEXTN = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}


@pytest.fixture(scope="module", params=FAMILIES)
def family_checkpoint(request, tmp_path_factory):
    """(path, transformers target) of each family's tiny MTP checkpoint."""
    return build_mtp_checkpoint(request.param, tmp_path_factory.mktemp(f"cuda_{request.param}"))[:2]


@pytest.fixture
def capture_on(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)


def graphs_of(engine) -> list[tuple[str, str, float]]:
    runners = [engine.runner]
    if engine.spec_config:
        runners.append(engine.worker.drafter.runner)
    return [s for r in runners for s in r.graph_runner.compiled_steps()]


def test_cuda_eager_engine_equals_transformers(family_checkpoint):
    path, hf = family_checkpoint
    prompts = prompts_of((5, 23, 40), seed=4)
    engine = Engine(model_path=str(path), dtype="float32", device="cuda", page_size=4)
    params = [{**GREEDY, "max_new_tokens": 24}] * len(prompts)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    for ids, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(hf, ids, 24)


def test_cuda_graph_engines_equal_eager_plain(family_checkpoint, capture_on, tmp_path):
    """Plain and NEXTN engines replaying CUDA graphs (buckets 1 and 4; requests join and
    leave between replays) give the eager plain engine's greedy tokens on the same device."""
    path, _ = family_checkpoint
    prompts = prompts_of((5, 23, 40, 11, 33), seed=4)
    lengths = [30, 12, 25, 40, 18]
    common = dict(model_path=str(path), dtype="float32", device="cuda", page_size=4)
    reference = staggered_generate(Engine(**common, disable_cuda_graph=True), prompts, lengths)
    hot_table = tmp_path / "freq.json"
    hot_table.write_text(json.dumps(list(range(0, 97, 2))))
    variants = (
        {},
        NEXTN,
        {**NEXTN, "speculative_disable_by_batch_size": 3},
        {**NEXTN, "speculative_token_map": str(hot_table)},
    )
    for spec in variants:
        engine = Engine(**common, cuda_graph_bs=BUCKETS, **spec)  # the server's default mode
        assert "CUDA graphs" in engine.runner.graph_runner.describe()
        assert staggered_generate(engine, prompts, lengths) == reference, spec
        states = graphs_of(engine)
        assert states and all(s == "ready" for _, s, _ in states), states


def test_cuda_graphs_at_startup_then_seeded_sampling_repeats(family_checkpoint, capture_on):
    """`--capture-compile startup` records every bucket before serving; seeded sampled
    requests then give the eager engine's tokens (the draws hash the seed and position),
    and an engine seed (`random_seed`, a generator on the device) samples unseeded ones."""
    path, _ = family_checkpoint
    prompts = prompts_of((7, 19, 12), seed=5)
    params = [
        {
            "temperature": 0.8,
            "top_p": 0.9,
            "sampling_seed": 11 + i,
            "max_new_tokens": 20,
            "ignore_eos": True,
        }
        for i in range(len(prompts))
    ]
    common = dict(model_path=str(path), dtype="float32", device="cuda", page_size=4)
    eager = Engine(**common, disable_cuda_graph=True, random_seed=3, **NEXTN)
    expected = [o["output_ids"] for o in eager.generate(input_ids=prompts, sampling_params=params)]
    engine = Engine(
        **common, cuda_graph_bs=BUCKETS, capture_compile="startup", random_seed=3, **NEXTN
    )
    ready = graphs_of(engine)
    assert ready and all(s == "ready" for _, s, _ in ready), ready
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in got] == expected
    unseeded = [{**p, "sampling_seed": None} for p in params]
    outs = engine.generate(input_ids=prompts, sampling_params=unseeded)
    assert all(len(o["output_ids"]) == 20 for o in outs)


def test_cuda_graphs_default_model(capture_on):
    """The embedded model: fp32 captured plain and NEXTN equal eager plain; in its own
    bf16 (`--dtype auto` on a GPU) captured plain equals eager plain."""
    prompts = ["def add(a, b):\n", "import os\n\nclass Config:\n", "for i in range("]
    params = [{**GREEDY, "max_new_tokens": n} for n in (24, 40, 16)]
    for dtype, variants in (("float32", ({}, NEXTN)), ("auto", ({},))):
        eager = Engine(dtype=dtype, device="cuda", disable_cuda_graph=True)
        expected = [o["output_ids"] for o in eager.generate(prompts, params)]
        assert [len(ids) for ids in expected] == [p["max_new_tokens"] for p in params]
        for spec in variants:
            engine = Engine(dtype=dtype, device="cuda", cuda_graph_bs=BUCKETS, **spec)
            got = [o["output_ids"] for o in engine.generate(prompts, params)]
            assert got == expected, (dtype, spec)


@pytest.mark.slow
def test_cuda_graphs_over_torch_compile_equal_eager(family_checkpoint, capture_on):
    """`--enable-torch-compile`: each step is compiled by inductor, then recorded into a CUDA
    graph (about a minute per step on an H200 host); greedy tokens equal the eager
    engine's."""
    path, _ = family_checkpoint
    prompts = prompts_of((5, 23, 40), seed=4)
    lengths = [20, 12, 16]
    common = dict(model_path=str(path), dtype="float32", device="cuda", page_size=4)
    reference = staggered_generate(Engine(**common, disable_cuda_graph=True), prompts, lengths)
    engine = Engine(**common, cuda_graph_bs=[BUCKETS[-1]], enable_torch_compile=True)
    assert "torch.compile + CUDA graphs" in engine.runner.graph_runner.describe()
    assert staggered_generate(engine, prompts, lengths) == reference
    states = graphs_of(engine)
    assert states and all(s == "ready" for _, s, _ in states), states
