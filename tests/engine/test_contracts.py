# SPDX-License-Identifier: Apache-2.0
"""The named contracts hold for what an engine actually builds: both families' cache pools
(target and draft) are `KVPool`s, both workers are `Worker`s, and only the speculative one
has a speculation facet (`runtime.core.kv_pool`, `runtime.core.worker`)."""

from __future__ import annotations

from runtime import Engine
from runtime.core.kv_pool import KVPool
from runtime.core.worker import SpeculationFacet, Worker


def test_speculative_engine_meets_the_contracts(checkpoint):
    engine = Engine(model_path=str(checkpoint), dtype="float32", speculative_algorithm="NEXTN")
    worker = engine.worker
    assert isinstance(worker, Worker)
    assert isinstance(worker.speculation, SpeculationFacet)
    assert worker.speculation.needs_drafts
    for runner in (engine.runner, worker.speculation.drafter.runner):
        assert isinstance(runner.kv_pool, KVPool), type(runner.kv_pool).__name__
    engine.shutdown()


def test_plain_engine_has_no_speculation_facet(checkpoint):
    engine = Engine(model_path=str(checkpoint), dtype="float32")
    assert isinstance(engine.worker, Worker)
    assert engine.worker.speculation is None
    assert isinstance(engine.runner.kv_pool, KVPool)
    assert engine.stats().spec_verify_rounds is None  # no speculation counters at all
    engine.shutdown()
