# SPDX-License-Identifier: Apache-2.0
"""`AsyncEngine`: typed snapshots to the caller, an `EngineStats` snapshot published by the
loop thread after every step (what the HTTP routes read), calls run between steps, and a
failing step that aborts its requests without stopping the loop."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from runtime import Engine
from runtime.core.result import RequestResult
from runtime.core.stats import EngineStats
from runtime.engine.async_engine import AsyncEngine

PROMPT = [5, 9, 13, 2, 40, 41, 7]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture
def loop_engine(tiny_v4):
    engine = Engine(model_path=str(tiny_v4[0]), dtype="float32", page_size=4)
    observed = []
    runner = AsyncEngine(engine, on_step=lambda *step: observed.append(step))
    yield runner, observed
    runner.shutdown()


def test_stats_snapshot_follows_the_steps(loop_engine):
    runner, observed = loop_engine
    start = runner.stats
    assert start.is_idle and start.available_tokens == runner.info.max_total_tokens
    assert start.available_request_slots == runner.info.max_running_requests
    with pytest.raises(dataclasses.FrozenInstanceError):
        start.num_running_reqs = 3

    async def scenario():
        long = runner.engine.make_request(PROMPT, {**GREEDY, "max_new_tokens": 900})
        seen_running, flushed_while_running, snapshot = None, None, None
        async for snapshot in runner.stream(long):  # noqa: B007 - the last one is returned
            if seen_running is None:
                seen_running = runner.stats.num_running_reqs
                flushed_while_running = await runner.flush_cache()
                runner.abort(long.rid)
        return snapshot, seen_running, flushed_while_running

    last, seen_running, flushed = asyncio.run(scenario())
    assert isinstance(last, RequestResult) and last.aborted and last.completion_tokens < 900
    assert seen_running == 1 and flushed is False
    end = runner.stats
    assert end.is_idle and end.available_tokens == start.available_tokens
    assert asyncio.run(runner.flush_cache()) is True
    results, stats, _ = observed[-1]
    assert stats == end and isinstance(stats, EngineStats)
    assert all(isinstance(r, RequestResult) for r in results)


def test_loop_result_equals_the_blocking_engine(loop_engine):
    runner, _ = loop_engine

    async def run():
        return await runner.generate(runner.engine.make_request(PROMPT, GREEDY))

    result = asyncio.run(run())
    runner.shutdown()  # the engine is ours again
    expected = runner.engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert list(result.output_ids) == expected["output_ids"]
    assert result.finish_reason.to_json() == {"type": "length", "length": 12}


def test_a_failing_step_aborts_its_requests_and_the_loop_goes_on(loop_engine):
    runner, _ = loop_engine
    engine = runner.engine
    real_step = engine.step

    def broken_step():
        engine.step = real_step
        raise RuntimeError("kernel exploded")

    async def run(req):
        return await runner.generate(req)

    engine.step = broken_step
    failed = asyncio.run(run(engine.make_request(PROMPT, GREEDY)))
    assert failed.aborted and "kernel exploded" in failed.finish_reason.message
    assert "kernel exploded" in runner.last_error and runner.alive
    ok = asyncio.run(run(engine.make_request(PROMPT, GREEDY)))
    assert ok.completion_tokens == 12 and runner.stats.is_idle
