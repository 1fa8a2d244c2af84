# SPDX-License-Identifier: Apache-2.0
"""`Engine(tp_size=2, ...)` (rank 0 here, rank 1 a spawned process on gloo) against the
one-rank engine: greedy NEXTN output token for token, the same acceptance counters (the
draft sees the same hidden states on both ranks), and seeded sampling draw for draw."""

from __future__ import annotations

import json

import pytest

from runtime.configs.capture import DISABLE_ENV
from runtime.engine.engine import Engine
from tests.tiny_checkpoints import build_tiny_qwen4_exp_mtp_checkpoint, build_tiny_v4_mtp_checkpoint

PROMPTS = [[5, 9, 3, 17, 22, 8, 41, 7, 13, 2, 30, 11, 19, 6, 27, 33, 4, 15, 21], [3] * 26, [7, 8]]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
SEEDED = [
    {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 16, "sampling_seed": 11 + i}
    for i in range(len(PROMPTS))
]
UNSEEDED = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}


def run(path, **parallel):
    engine = Engine(
        model_path=str(path),
        dtype="float32",
        speculative_algorithm="NEXTN",
        skip_tokenizer_init=True,
        max_total_tokens=2048,
        max_running_requests=8,
        random_seed=5,  # the engine generator (requests without a seed of their own)
        **parallel,
    )
    try:
        greedy = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        stats = engine.stats()
        seeded = engine.generate(input_ids=PROMPTS, sampling_params=SEEDED)
        unseeded = engine.generate(input_ids=PROMPTS, sampling_params=UNSEEDED)
        memory = engine.rank_memory
    finally:
        engine.shutdown()
    ids = [[r["output_ids"] for r in batch] for batch in (greedy, seeded, unseeded)]
    return ids, (stats.spec_verify_rounds, stats.spec_emitted_tokens), memory


def check_tp2_equals_tp1(path, **parallel):
    ids, spec, memory = run(path, **parallel)
    ref_ids, ref_spec, ref_memory = run(path)
    assert ids[0] == ref_ids[0]  # greedy
    assert spec == ref_spec  # same drafts proposed and accepted
    assert ids[1] == ref_ids[1]  # per-request seeds
    assert ids[2] == ref_ids[2]  # the engine's seeded generator
    assert [m.rank for m in memory] == [0, 1] and len(ref_memory) == 1
    assert all(m.weights < ref_memory[0].weights for m in memory)


def test_deepseek_v4_tp2_ep2_nextn_equals_one_rank(tmp_path):
    path = build_tiny_v4_mtp_checkpoint(tmp_path, seed=4)[0]
    check_tp2_equals_tp1(path, tp_size=2, ep_size=2)


@pytest.mark.slow
def test_qwen4_exp_tp2_nextn_equals_one_rank(tmp_path):
    path = build_tiny_qwen4_exp_mtp_checkpoint(tmp_path, seed=4)[0]
    check_tp2_equals_tp1(path, tp_size=2)


def two_turns(path, **options):
    """Each prompt, then a second turn resending it with its answer: the prefix cache's
    snapshot restores and page copies run on every rank (`ModelRunner.apply`)."""
    engine = Engine(
        model_path=str(path),
        dtype="float32",
        speculative_algorithm="NEXTN",
        skip_tokenizer_init=True,
        max_total_tokens=2048,
        max_running_requests=8,
        page_size=4,
        **options,
    )
    try:
        first = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        again = [p + r["output_ids"] + [9, 10, 11] for p, r in zip(PROMPTS, first, strict=True)]
        second = engine.generate(input_ids=again, sampling_params=GREEDY)
        stats = engine.stats()
    finally:
        engine.shutdown()
    return (
        [r["output_ids"] for r in first + second],
        [r["meta_info"]["cached_tokens"] for r in second],
        (stats.spec_verify_rounds, stats.spec_emitted_tokens),
    )


def test_prefix_cache_resumes_on_every_rank(tmp_path):
    path = build_tiny_v4_mtp_checkpoint(tmp_path, seed=4)[0]
    tp2 = two_turns(path, tp_size=2)
    assert tp2[1] == [len(p) + GREEDY["max_new_tokens"] - 1 for p in PROMPTS]
    assert tp2 == two_turns(path)
    assert tp2[0] == two_turns(path, disable_radix_cache=True)[0]


@pytest.mark.slow
def test_a_replica_captures_its_steps_in_lockstep(tmp_path, monkeypatch, capfd):
    """A tp-2 / ep-2 replica with capture on (the default; bucket 4): both ranks compile each step
    kind together the first time a batch needs it (the collectives inside the compiled
    graphs are functional ones) and replay it, rank 1 included (it logs no failed capture);
    greedy NEXTN and plain output equal the one-rank eager engine's while the batch shrinks
    from 3 requests to 1 (padded into 4)."""
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    path = build_tiny_v4_mtp_checkpoint(tmp_path, seed=4)[0]
    common = dict(
        model_path=str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        max_total_tokens=2048,
        max_running_requests=4,
    )
    params = [{**GREEDY, "max_new_tokens": n} for n in (12, 6, 9)]
    for spec in ({}, {"speculative_algorithm": "NEXTN"}):
        engine = Engine(**common, **spec, tp_size=2, ep_size=2, cuda_graph_bs=[4])
        try:
            got = engine.generate(input_ids=PROMPTS, sampling_params=params)
            runners = [engine.runner] + ([engine.worker.drafter.runner] if spec else [])
            states = [s for r in runners for s in r.graph_runner.compiled_steps()]
        finally:
            engine.shutdown()
        assert states and all(state == "ready" for _, state, _ in states), states
        one_rank = Engine(**common, **spec, disable_cuda_graph=True)
        reference = one_rank.generate(input_ids=PROMPTS, sampling_params=params)
        assert [r["output_ids"] for r in got] == [r["output_ids"] for r in reference], spec
    assert "failed, it runs eagerly" not in capfd.readouterr().err  # rank 1 captured too


def test_catching_up_after_speculation_off_matches_one_rank(tmp_path):
    """With speculation off from 3 requests on, the replica decodes plainly until the first
    request finishes, then the draft catches up over rows gathered across earlier steps
    (their hidden states travel to rank 1 with the forward): output and acceptance equal
    the one-rank engine's."""
    path = build_tiny_v4_mtp_checkpoint(tmp_path, seed=4)[0]
    params = [{**GREEDY, "max_new_tokens": n} for n in (8, 20, 30)]

    def staggered(**parallel):
        engine = Engine(
            model_path=str(path),
            dtype="float32",
            speculative_algorithm="NEXTN",
            speculative_disable_by_batch_size=3,
            skip_tokenizer_init=True,
            max_total_tokens=2048,
            max_running_requests=8,
            **parallel,
        )
        try:
            out = engine.generate(input_ids=PROMPTS, sampling_params=params)
            stats = engine.stats()
        finally:
            engine.shutdown()
        return [r["output_ids"] for r in out], (stats.spec_verify_rounds, stats.spec_emitted_tokens)

    tp2, tp1 = staggered(tp_size=2), staggered()
    assert tp2 == tp1 and tp1[1][0] > 0


def test_hot_vocabulary_draft_matches_one_rank(tmp_path):
    """`--speculative-token-map` with every table token in rank 0's half of the vocabulary
    (rank 1's slice of the hot head is empty): the replica proposes exactly the one-rank
    engine's drafts, all from the table, and its output is plain decoding's."""
    from tests.engine.test_token_map import proposals_of

    path = build_tiny_v4_mtp_checkpoint(tmp_path, seed=4)[0]
    table = tmp_path / "freq.json"
    table.write_text(json.dumps(list(range(3, 45, 2))))

    def drafts(**options):
        engine = Engine(
            model_path=str(path),
            dtype="float32",
            skip_tokenizer_init=True,
            max_total_tokens=2048,
            max_running_requests=8,
            **options,
        )
        try:
            seen = proposals_of(engine) if options.get("speculative_algorithm") else []
            out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        finally:
            engine.shutdown()
        return [r["output_ids"] for r in out], seen

    hot = dict(speculative_algorithm="NEXTN", speculative_token_map=str(table))
    tp2, tp1, plain = drafts(**hot, tp_size=2), drafts(**hot), drafts()
    assert tp2 == tp1 and tp1[0] == plain[0]
    assert tp1[1] and {t for p in tp1[1] for t in p} <= set(range(3, 45, 2))
