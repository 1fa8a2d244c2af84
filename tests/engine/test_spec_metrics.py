# SPDX-License-Identifier: Apache-2.0
"""Speculation counters stay truthful while the speculation policy pauses speculation.

A request's tokens come from its prefill (the first), from verify rounds, and from decode
steps the policy ran plainly (`--speculative-disable-by-batch-size`). `spec_accept_length`
is over the rounds alone (accepted drafts + 1 per round, so within `[1, steps + 1]`),
absent before the first round; `spec_plain_decode_tokens` counts the plain steps' tokens.
The oracle is the worker itself, watched from outside: which requests each plain step and
each verify round served, and what each round accepted. `/get_server_info` and `/metrics`
must add up to the per-request figures.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict

import pytest
from fastapi.testclient import TestClient

from runtime import Engine
from runtime.engine.async_engine import AsyncEngine
from runtime.server.app import create_app
from runtime.server.metrics import ServerMetrics
from runtime.server_args import ServerArgs
from tests.engine.test_nextn import make_prompts

STEPS = 3


def nextn_engine(path, limit) -> Engine:
    return Engine(
        model_path=str(path),
        dtype="float32",
        page_size=4,
        max_running_requests=16,
        speculative_algorithm="NEXTN",
        speculative_num_steps=STEPS,
        speculative_disable_by_batch_size=limit,
    )


def watch_worker(engine) -> tuple[Counter, dict]:
    """(plain steps per request id, per request id the list of drafts each round accepted),
    as the worker runs them."""
    worker = engine.worker
    plain, rounds = Counter(), defaultdict(list)
    decode_plain, round_outputs = worker._decode_plain, worker._round_outputs

    def plain_step(reqs):
        plain.update(r.rid for r in reqs)
        return decode_plain(reqs)

    def round_step(reqs, drafts, result, *rest):
        for req, m in zip(reqs, result.num_accepted.tolist()):
            rounds[req.rid].append(m)
        return round_outputs(reqs, drafts, result, *rest)

    worker._decode_plain, worker._round_outputs = plain_step, round_step
    return plain, rounds


def run_switching(engine, max_new=(40, 12)) -> list:
    """One request speculates alone, a second joins (2 >= the limit: plain steps), finishes,
    and the first speculates again. The requests, finished."""
    prompts = make_prompts(2, seed=3)
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in max_new]
    reqs = [engine.make_request(ids, p) for ids, p in zip(prompts, params, strict=True)]
    engine.add_request(reqs[0])
    for _ in range(3):  # its prefill, then rounds alone
        engine.step()
    engine.add_request(reqs[1])
    while engine.has_work():
        engine.step()
    return reqs


def meta_of(engine, req) -> dict:
    return engine.result(req)["meta_info"]


def test_accept_length_is_over_rounds_and_plain_tokens_are_counted(checkpoint):
    engine = nextn_engine(checkpoint, limit=2)
    plain, rounds = watch_worker(engine)
    reqs = run_switching(engine)
    assert plain[reqs[0].rid] > 0 and rounds[reqs[0].rid]  # both kinds of step ran
    for req in reqs:
        meta, accepted = meta_of(engine, req), rounds[req.rid]
        assert meta["spec_plain_decode_tokens"] == plain[req.rid]
        assert meta["spec_verify_ct"] == len(accepted)
        hist = meta["spec_accept_histogram"]
        assert hist == [accepted.count(m) for m in range(STEPS + 1)]
        if not accepted:
            assert "spec_accept_length" not in meta
            assert meta["completion_tokens"] == 1 + plain[req.rid]
            continue
        length = meta["spec_accept_length"]
        assert 1.0 <= length <= STEPS + 1
        recount = sum((m + 1) * count for m, count in enumerate(hist)) / sum(hist)
        assert length == pytest.approx(recount)
        assert length == pytest.approx(sum(m + 1 for m in accepted) / len(accepted))
        # prefill's token, every plain step's, every round's (the last one may be cut)
        emitted = 1 + plain[req.rid] + sum(m + 1 for m in accepted)
        assert emitted - STEPS <= meta["completion_tokens"] <= emitted
    stats = engine.stats()
    assert stats.spec_plain_decode_tokens == sum(plain.values())
    assert stats.spec_verify_rounds == sum(len(a) for a in rounds.values())
    total = sum(m + 1 for a in rounds.values() for m in a)
    assert stats.avg_spec_accept_length == pytest.approx(total / stats.spec_verify_rounds)


def test_no_accept_length_where_no_round_ran(checkpoint):
    engine = nextn_engine(checkpoint, limit=1)  # every decode step runs plainly
    plain, rounds = watch_worker(engine)
    reqs = run_switching(engine, max_new=(9, 6))
    assert not rounds
    for req in reqs:
        meta = meta_of(engine, req)
        assert meta["spec_verify_ct"] == 0 and "spec_accept_length" not in meta
        assert meta["spec_plain_decode_tokens"] == plain[req.rid] == meta["completion_tokens"] - 1
    stats = engine.stats()
    assert stats.avg_spec_accept_length is None and stats.spec_verify_rounds == 0
    assert stats.spec_plain_decode_tokens == 9 - 1 + 6 - 1


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_server_info_and_metrics_add_up_to_the_requests(checkpoint):
    """Requests of staggered lengths together over a limit of 3: the batch decodes plainly
    while it is large and speculates once it is small."""
    engine = nextn_engine(checkpoint, limit=3)
    metrics = ServerMetrics("tiny")
    runner = AsyncEngine(engine, on_step=metrics.observe_step)
    try:
        client = TestClient(create_app(runner, ServerArgs(model_path=str(checkpoint)), metrics))
        prompts = make_prompts(5, seed=4)
        params = [
            {"temperature": 0.0, "max_new_tokens": 6 + 8 * i, "ignore_eos": True}
            for i in range(len(prompts))
        ]
        outs = client.post("/generate", json={"input_ids": prompts, "sampling_params": params})
        assert outs.status_code == 200, outs.text
        metas = [o["meta_info"] for o in outs.json()]
        rounds = sum(m["spec_verify_ct"] for m in metas)
        round_tokens = sum(
            (k + 1) * n for m in metas for k, n in enumerate(m["spec_accept_histogram"])
        )
        plain_tokens = sum(m["spec_plain_decode_tokens"] for m in metas)
        assert rounds > 0 and plain_tokens > 0
        state = client.get("/get_server_info").json()["internal_states"][0]
        assert state["spec_verify_rounds"] == rounds
        assert state["spec_emitted_tokens"] == round_tokens
        assert state["spec_plain_decode_tokens"] == plain_tokens
        assert state["avg_spec_accept_length"] == pytest.approx(round_tokens / rounds)
        assert 1.0 <= state["avg_spec_accept_length"] <= STEPS + 1
        text = client.get("/metrics").text
        assert metric(text, "sglang:spec_verify_rounds_total") == rounds
        assert metric(text, "sglang:spec_round_tokens_total") == round_tokens
        assert metric(text, "sglang:spec_plain_decode_tokens_total") == plain_tokens
        assert metric(text, "sglang:spec_accept_length") == pytest.approx(round_tokens / rounds)
    finally:
        runner.shutdown()
