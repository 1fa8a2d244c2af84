# SPDX-License-Identifier: Apache-2.0
"""`--capture-compile startup`: every step kind the engine runs is compiled at every bucket
before the engine serves, the warm-up leaves nothing behind, and the engine then serves
plain decoding's tokens.

Compiling is stubbed (the step's eager function is kept and marked ready): what is checked
is which steps get compiled, that the padded captured path then serves every batch size,
and that the warm-up request is gone from the prefix cache; `test_captured_steps.py`
compiles for real.
"""

from __future__ import annotations

import dataclasses

import pytest

from runtime import Engine
from runtime.configs.capture import DISABLE_ENV
from runtime.execution.graph_runner import StepState
from runtime.execution.step_compiler import StepCompiler
from tests.engine.test_captured_steps import prompts_of, staggered_generate
from tests.tiny_checkpoints import build_tiny_v4_mtp_checkpoint

BUCKETS = (1, 2, 4)


@pytest.fixture(scope="module")
def v4_mtp_ckpt(tmp_path_factory):
    return build_tiny_v4_mtp_checkpoint(tmp_path_factory.mktemp("capture_startup"), seed=2)[0]


@pytest.fixture
def stubbed_compiles(monkeypatch):
    """Record each compiled step; the step keeps its eager function (no inductor here)."""
    compiled = []

    def fake_compile(self, step):
        compiled.append((self.role, step.key))
        step.fn = getattr(step.fn, "_torchdynamo_orig_callable", step.fn)
        step.state = StepState.READY

    monkeypatch.setattr(StepCompiler, "compile_step", fake_compile)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    return compiled


def kind_of(key):
    """A captured step's kind: its key without the bucket."""
    return dataclasses.replace(key, bucket=0)


@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "NEXTN"}], ids=["plain", "nextn"])
def test_startup_compiles_every_kind_at_every_bucket_then_serves(
    v4_mtp_ckpt, stubbed_compiles, spec
):
    common = dict(model_path=str(v4_mtp_ckpt), dtype="float32", page_size=4, **spec)
    prompts = prompts_of((5, 17, 9, 30, 12), seed=6)
    lengths = [14, 6, 20, 9, 11]
    reference = staggered_generate(Engine(**common, disable_cuda_graph=True), prompts, lengths)

    engine = Engine(**common, cuda_graph_bs=list(BUCKETS), capture_compile="startup")
    compiled = list(stubbed_compiles)
    kinds = {(role, kind_of(key)) for role, key in compiled}
    roles = {role for role, _ in compiled}
    assert roles == ({"target", "draft"} if spec else {"target"})
    assert len(compiled) == len(set(compiled)) == len(kinds) * len(BUCKETS)
    for role, key in compiled:  # each kind at each bucket, nothing twice
        assert {k.bucket for r, k in compiled if (r, kind_of(k)) == (role, kind_of(key))} == set(
            BUCKETS
        )
    if spec:  # greedy rounds run fused, sampled ones step by step: both compiled
        recipes = {key.recipe for _, key in compiled}
        assert recipes == {"", "nextn round"}
    assert engine.prefix_cache.stats().cached_tokens == 0  # the warm-up is forgotten
    if spec:  # the measured policy's prior: both modes timed at each bucket, none in traffic
        timed = engine.worker.policy.describe()
        assert set(timed) == {str(b) for b in BUCKETS}, timed
        for bucket in timed.values():
            assert bucket["calibrated_round_ms"] > 0 and bucket["calibrated_plain_ms"] > 0
            assert bucket["rounds"] == bucket["plain_steps"] == 0 and bucket["round_ms"] is None

    assert staggered_generate(engine, prompts, lengths) == reference
    assert stubbed_compiles == compiled  # serving compiled nothing more


def test_startup_compiles_only_the_steps_a_batch_can_meet(v4_mtp_ckpt, stubbed_compiles):
    """With speculation off from 3 requests on, the target's plain decode step compiles only
    at buckets holding 3 or more requests (4), verify rounds and the draft's steps only at
    buckets of fewer (1, 2); serving then compiles nothing and gives plain decoding's
    tokens."""
    common = dict(model_path=str(v4_mtp_ckpt), dtype="float32", page_size=4)
    prompts = prompts_of((5, 17, 9, 30, 12), seed=6)
    lengths = [14, 6, 20, 9, 11]
    reference = staggered_generate(Engine(**common, disable_cuda_graph=True), prompts, lengths)
    engine = Engine(
        **common,
        speculative_algorithm="NEXTN",
        speculative_disable_by_batch_size=3,
        cuda_graph_bs=list(BUCKETS),
        capture_compile="startup",
    )
    compiled = list(stubbed_compiles)
    plain = {k.bucket for role, k in compiled if role == "target" and k.mode.name == "DECODE"}
    speculative = {
        (role, kind_of(k))
        for role, k in compiled
        if not (role == "target" and k.mode.name == "DECODE")
    }
    assert plain == {4}
    assert {role for role, _ in speculative} == {"target", "draft"}
    for role, kind in speculative:
        assert {k.bucket for r, k in compiled if (r, kind_of(k)) == (role, kind)} == {1, 2}
    assert len(compiled) == len(set(compiled))
    assert staggered_generate(engine, prompts, lengths) == reference
    assert stubbed_compiles == compiled  # serving compiled nothing more
    assert engine.worker.stats.verify_rounds > 0  # it speculated in the small batches
