# SPDX-License-Identifier: Apache-2.0
"""`--speculative-disable-by-batch-size` (vLLM's `speculative_disable_by_batch_size`): decode
steps of at least that many requests run as plain decoding, and the draft catches up over
the rows it skipped once the batch shrinks (prompts prefilled meanwhile included).

The output stays exactly plain decoding's (greedy, and seeded sampling where no step
speculates); after catching up, the draft proposes what it would have proposed had it never
been skipped (its cache holds the same rows), for both model families.
"""

from __future__ import annotations

import pytest

from runtime import Engine
from runtime.configs.capture import DISABLE_ENV
from runtime.execution.graph_runner import StepState
from runtime.speculative.speculation_policy import FixedLimit, MeasuredSpeculation
from tests.engine.test_nextn import make_prompts

NUM_PROMPTS = 12


def engine_of(path, **kw) -> Engine:
    return Engine(model_path=str(path), dtype="float32", page_size=4, max_running_requests=16, **kw)


def nextn_of(path, limit=None, **kw) -> Engine:
    return engine_of(
        path,
        speculative_algorithm="NEXTN",
        speculative_num_steps=3,
        speculative_disable_by_batch_size=limit,
        **kw,
    )


def staggered_params(temperature=0.0, seed=None):
    """Output lengths 10..65: the batch shrinks one request at a time, crossing any limit.
    Lengths past the draft's window (8) and several compress boundaries."""
    extra = {} if seed is None else {"sampling_seed": seed}
    return [
        {"temperature": temperature, "max_new_tokens": 10 + 5 * i, "ignore_eos": True, **extra}
        for i in range(NUM_PROMPTS)
    ]


@pytest.fixture(scope="module")
def greedy_reference(checkpoint):
    prompts = make_prompts(NUM_PROMPTS, seed=1)
    outs = engine_of(checkpoint).generate(input_ids=prompts, sampling_params=staggered_params())
    return prompts, [o["output_ids"] for o in outs]


def record_proposals(engine) -> dict:
    """(prompt, first chained position) -> (drafts, whether the draft ran over the newest
    target step's rows only, False for a catch-up) of every proposal the drafter makes."""
    seen = {}
    drafter = engine.worker.drafter
    draft = drafter.draft

    def recording(batch):
        out = draft(batch)
        for b, drafts in enumerate(out):
            if drafts is not None:
                key = (tuple(batch.reqs[b].prompt_ids), batch.first_chain_position(b))
                seen[key] = (drafts, batch.from_latest_target)
        return out

    drafter.draft = recording
    return seen


@pytest.mark.parametrize("limit", [1, 3, 6])
def test_greedy_output_is_plain_decoding_across_the_switch(checkpoint, greedy_reference, limit):
    prompts, reference = greedy_reference
    engine = nextn_of(checkpoint, limit)
    outs = engine.generate(input_ids=prompts, sampling_params=staggered_params())
    assert [o["output_ids"] for o in outs] == reference
    stats = engine.worker.stats
    if limit == 1:
        assert stats.verify_rounds == 0  # never speculates
    else:
        assert stats.verify_rounds > 0  # and speculated once the batch was small
        assert all(o["meta_info"]["spec_verify_ct"] >= 0 for o in outs)
    assert not engine.worker.undrafted  # rows of finished requests are dropped


def test_a_draft_pass_over_skipped_rows_queues_no_compile(checkpoint, monkeypatch):
    """A catch-up is a draft extend over as many rows per request as the plain steps it
    missed, so each count of rows is a captured step of its own that no warm-up meets;
    compiled on first use, one such step stopped a benchmark's timed batch for 30 s.
    These passes take a step that is ready or run eagerly, and queue no compile. Here a
    request speculates alone, decodes plainly beside a second one (limit 2), then
    speculates alone again after catching up. (Compiles are stubbed: what gets queued is
    what is checked.)"""
    prompts = make_prompts(2, seed=3)
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in (30, 5)]
    plain = engine_of(checkpoint).generate(input_ids=prompts, sampling_params=params)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    engine = nextn_of(checkpoint, limit=2, cuda_graph_bs=[1, 2], capture_compile="inline")
    queued = []
    for runner in (engine.runner, engine.worker.drafter.runner):

        def schedule(step):  # as a compile that never ends: every step runs eagerly
            queued.append(step.key.describe())
            step.state = StepState.COMPILING

        monkeypatch.setattr(runner.graph_runner.compiler, "schedule", schedule)
    proposals = record_proposals(engine)
    reqs = [engine.make_request(ids, p) for ids, p in zip(prompts, params, strict=True)]
    engine.add_request(reqs[0])
    for _ in range(3):  # prefill, then rounds alone
        engine.step()
    rounds_alone = engine.worker.stats.verify_rounds
    engine.add_request(reqs[1])
    while engine.has_work():
        engine.step()
    assert [list(r.output_ids) for r in reqs] == [o["output_ids"] for o in plain]
    assert rounds_alone > 0 and engine.worker.stats.verify_rounds > rounds_alone
    assert any(not latest for _, latest in proposals.values())  # the first one caught up
    assert queued and not [name for name in queued if name.startswith("draft")], queued


@pytest.mark.parametrize("chunk", [None, 7])
def test_drafts_after_catching_up_equal_uninterrupted_drafts(checkpoint, greedy_reference, chunk):
    """At every point both engines proposed from (same request, same length), the drafts are
    equal, including each proposal made right after the draft caught up over skipped rows:
    its cache holds exactly what it would hold had it run every step. The skipped rows
    include prompts prefilled while the batch was over the limit (in chunks of 7 tokens
    too, so a prompt's later chunks defer to the catch-up after its earlier ones, in steps
    where other prompts' chunks are drafted at once)."""
    prompts, reference = greedy_reference
    always = nextn_of(checkpoint, chunked_prefill_size=chunk)
    uninterrupted = record_proposals(always)
    always.generate(input_ids=prompts, sampling_params=staggered_params())
    switching = nextn_of(checkpoint, limit=4, chunked_prefill_size=chunk)
    proposals = record_proposals(switching)
    outs = switching.generate(input_ids=prompts, sampling_params=staggered_params())
    assert [o["output_ids"] for o in outs] == reference
    caught_up = [key for key, (_, latest) in proposals.items() if not latest]
    # requests 1..3 of the batch each caught up once, where the uninterrupted engine also
    # proposed (it may have jumped past a catch-up's position with accepted drafts)
    assert sum(key in uninterrupted for key in caught_up) >= 3
    common = [key for key in proposals if key in uninterrupted]
    assert all(proposals[key][0] == uninterrupted[key][0] for key in common)


def test_a_step_drafts_some_prompt_chunks_and_defers_others(checkpoint, monkeypatch):
    """Five requests start together (speculation off at 3), the long prompt's first chunks
    defer; the short ones finish, and while its remaining chunks still defer (the draft
    reads the rows before them), the prompt chunks of two new requests in the same steps
    are drafted at once. Greedy output is plain decoding's, and every proposal made where
    an always-speculating engine also proposed equals its."""
    import runtime.speculative.nextn_worker as nextn_worker

    mixed = []
    real_rows = nextn_worker.chunk_rows
    monkeypatch.setattr(
        nextn_worker,
        "chunk_rows",
        lambda chunks, picked: mixed.append(len(picked)) or real_rows(chunks, picked),
    )
    prompts = make_prompts(4, seed=2, low=5, high=6) + make_prompts(1, seed=3, low=40, high=41)
    prompts += make_prompts(2, seed=4, low=6, high=7)
    lengths = [4, 4, 4, 4, 30, 20, 20]

    def run(engine):
        reqs = [
            engine.make_request(p, {"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
            for p, n in zip(prompts, lengths)
        ]
        for req in reqs[:5]:
            engine.add_request(req)
        for _ in range(3):
            engine.step()
        for req in reqs[5:]:
            engine.add_request(req)
        while engine.has_work():
            engine.step()
        return [list(r.output_ids) for r in reqs]

    reference = run(engine_of(checkpoint, chunked_prefill_size=7))
    always = nextn_of(checkpoint, chunked_prefill_size=7)
    uninterrupted = record_proposals(always)
    assert run(always) == reference
    switching = nextn_of(checkpoint, limit=3, chunked_prefill_size=7)
    proposals = record_proposals(switching)
    assert run(switching) == reference
    if switching.worker.drafter.runner.model.kv_reach is not None:
        assert mixed  # a draft pass over part of a step's chunks
    common = [key for key in proposals if key in uninterrupted]
    assert len(common) >= len(prompts)
    assert all(proposals[key][0] == uninterrupted[key][0] for key in common)


@pytest.mark.parametrize("chunk", [None, 3])
def test_requests_that_never_speculate_cost_no_draft_pass_without_a_prefix_cache(
    checkpoint, greedy_reference, chunk
):
    """Speculation off for every step and no prefix cache to keep a draft state for: the
    prompts' draft passes are deferred to a catch-up that never comes, so the draft never
    runs, and the output is plain decoding's. In chunks of 3 tokens the first steps carry
    only partial prompts (nothing decoding, nothing completing): those defer too."""
    prompts, reference = greedy_reference
    engine = nextn_of(checkpoint, limit=1, disable_radix_cache=True, chunked_prefill_size=chunk)
    if engine.worker.drafter.runner.model.kv_reach is None:
        pytest.skip("a draft that reads every row drafts each prompt at once")
    proposals = record_proposals(engine)
    calls = []
    recording = engine.worker.drafter.draft
    engine.worker.drafter.draft = lambda batch: calls.append(batch) or recording(batch)
    outs = engine.generate(input_ids=prompts, sampling_params=staggered_params())
    assert [o["output_ids"] for o in outs] == reference
    assert calls == [] and proposals == {}
    assert not engine.worker.undrafted


def test_seeded_sampling_without_speculation_is_plain_sampling(checkpoint):
    """Steps that do not speculate sample as plain decoding does: with every step over the
    limit, seeded sampled output is plain decoding's, token for token."""
    prompts = make_prompts(6, seed=3)
    params = staggered_params(temperature=0.9, seed=11)[:6]
    plain = engine_of(checkpoint, random_seed=5).generate(input_ids=prompts, sampling_params=params)
    nextn = nextn_of(checkpoint, limit=1, random_seed=5)
    outs = nextn.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]


def test_constrained_requests_catch_up_under_their_grammars():
    """Requests with a regex, an EBNF and a JSON schema on the embedded model, with
    speculation off from 3 requests on: each decodes plainly while all three run, the
    draft catches up under each grammar as they finish, and the greedy output is plain
    decoding's (the catch-up drafts are grammatical, so they are accepted)."""
    import json

    from tests.server.test_clients import EBNF, REGEX, SCHEMA

    prompts = ["def add(a, b):\n", "class Foo:\n    def __init__(self):\n        ", "settings = "]
    grammars = [{"regex": REGEX}, {"ebnf": EBNF}, {"json_schema": json.dumps(SCHEMA)}]
    params = [{"temperature": 0, "max_new_tokens": n, **g} for n, g in zip((6, 24, 40), grammars)]
    common = dict(dtype="float32", constrained_json_disable_any_whitespace=True)
    plain = Engine(**common).generate(prompts, params)
    nextn = Engine(**common, speculative_algorithm="NEXTN", speculative_disable_by_batch_size=3)
    outs = nextn.generate(prompts, params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    assert outs[2]["meta_info"]["spec_verify_ct"] > 0  # it speculated after catching up
    assert nextn.worker.stats.avg_accept_length > 1.5


def test_the_prefix_cache_keeps_the_rows_the_draft_skipped(checkpoint):
    """A first turn decodes without speculation. As it finishes, a window-only draft does
    not run: its newest rows go with the state the prefix cache keeps. A second turn
    resends it with a few more tokens, resumes from that state and speculates: the draft
    runs over those rows before it first proposes, and the second turn's drafts and output
    equal those of an engine that speculated through the first turn (a draft reading every
    row runs over the rows as the first turn finishes instead)."""
    prompt = make_prompts(1, seed=5, low=20, high=21)[0]
    first = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}

    def second_turn(limit):
        engine = nextn_of(checkpoint, limit)
        passes = []
        draft = engine.worker.drafter.draft
        engine.worker.drafter.draft = lambda batch: passes.append(batch) or draft(batch)
        answer = engine.generate(input_ids=prompt, sampling_params=first)["output_ids"]
        snapshots = engine.scheduler.prefix_cache.tree._snapshots_by_age()
        owed = [(s.position, s.owed_draft_rows) for s in snapshots if s.owed_draft_rows]
        first_turn = (len(passes), owed)
        engine.worker.policy = FixedLimit(None)  # the second turn speculates
        proposals = record_proposals(engine)
        out = engine.generate(input_ids=prompt + answer + [5, 6], sampling_params=first)
        assert out["meta_info"]["cached_tokens"] >= len(prompt) + len(answer) - 4
        assert not engine.worker.undrafted
        drafts = {key: drafted for key, (drafted, _) in proposals.items()}
        return out["output_ids"], drafts, first_turn

    ids, proposals, (passes, owed) = second_turn(limit=1)
    reference_ids, reference, _ = second_turn(limit=None)
    reach = nextn_of(checkpoint).worker.drafter.runner.model.kv_reach
    if reach is not None:
        assert passes == 0
        ((position, rows),) = owed  # the finishing snapshot's: the newest `reach` rows
        assert len(rows.following) == reach == rows.hidden.shape[0]
        assert rows.start + reach == position == len(prompt) + 30 - 1
    else:
        assert passes > 0 and owed == []
    assert ids == reference_ids
    assert proposals == reference


def test_a_snapshot_taken_mid_prompt_keeps_the_rows_the_draft_skipped(checkpoint):
    """A prompt prefills in chunks of 16 (the snapshot interval) while another request
    decodes without speculation, so its chunks defer their draft pass and the snapshots
    taken between them owe the draft their rows. A second request sharing 33 of its tokens
    resumes at 32 and speculates (its first proposal reads the draft's rows up to 6
    positions back): its drafts and output equal those of an engine that ran the draft
    over every chunk as it prefilled."""
    long, short = make_prompts(2, seed=7, low=50, high=51)
    other = long[:33] + [3]
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (8, 40)]

    def second_request(limit):
        engine = nextn_of(checkpoint, limit, radix_snapshot_interval=16)
        engine.generate(input_ids=[long, short[:5]], sampling_params=params)
        mid_prompt = {
            s.position: s.owed_draft_rows
            for s in engine.scheduler.prefix_cache.tree._snapshots_by_age()
            if s.position in (16, 32)
        }
        engine.worker.policy = FixedLimit(None)  # the second request speculates
        proposals = record_proposals(engine)
        out = engine.generate(input_ids=other, sampling_params=params[0])
        assert out["meta_info"]["cached_tokens"] == 32
        drafts = {key: drafted for key, (drafted, _) in proposals.items()}
        return out["output_ids"], drafts, mid_prompt

    ids, proposals, mid_prompt = second_request(limit=1)
    reference_ids, reference, drafted = second_request(limit=None)
    assert sorted(mid_prompt) == sorted(drafted) == [16, 32]
    assert all(rows is None for rows in drafted.values())
    reach = nextn_of(checkpoint).worker.drafter.runner.model.kv_reach
    if reach is not None:
        assert [(rows.start, len(rows.following)) for _, rows in sorted(mid_prompt.items())] == [
            (16 - reach, reach),
            (32 - reach, reach),
        ]
    assert ids == reference_ids
    assert len(proposals) >= 2 and proposals == reference


def scripted_bucket(n: int) -> int:
    return 4 if n <= 4 else 16


def scripted_seconds(bucket: int, speculated: bool) -> float:
    """A device where a round of the large bucket costs ten plain steps and a round of the
    small one half of one."""
    return (0.100 if bucket == 16 else 0.005) if speculated else 0.010


class ScriptedDevice(MeasuredSpeculation):
    """Measured (and calibrated) costs replaced by the device's above; the choice is the
    policy's own. `calibration_counts`: how many timings of each mode a calibration handed in."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.calibration_counts = {}

    def calibrate(self, bucket, round_seconds, plain_seconds):
        self.calibration_counts[bucket] = (len(round_seconds), len(plain_seconds))
        n = len(round_seconds)
        rounds, plain = scripted_seconds(bucket, True), scripted_seconds(bucket, False)
        super().calibrate(bucket, [rounds] * n, [plain] * n)

    def record(self, batch_size, speculated, seconds, **kw):
        seconds = scripted_seconds(scripted_bucket(batch_size), speculated)
        super().record(batch_size, speculated, seconds, **kw)


def record_modes(worker) -> list[tuple[int, bool]]:
    """(decode batch size, whether it speculates) of every step with decode rows."""
    modes = []
    step = worker.step

    def recording(prefill, decode):
        if decode:
            modes.append((len(decode), worker.speculates(decode)))
        return step(prefill, decode)

    worker.step = recording
    return modes


def test_a_measured_policy_decodes_plainly_where_rounds_cost_more_and_output_stays_plain(
    checkpoint, greedy_reference
):
    """The default policy (`auto`) fed step times of a device where a round of the large
    bucket costs ten plain steps and a round of the small ones half of one: the large bucket
    decodes plainly after its probe (probing rounds again every period), the small ones
    speculate, the draft catches up at each switch, and the greedy output is plain
    decoding's. The engine's stats report each bucket's choice."""
    from itertools import groupby

    prompts, reference = greedy_reference
    engine = nextn_of(checkpoint, "auto")
    worker = engine.worker
    worker.policy = ScriptedDevice(scripted_bucket, warmup=2, probe=2, period=6)
    modes = record_modes(worker)
    outs = engine.generate(input_ids=prompts, sampling_params=staggered_params())
    assert [o["output_ids"] for o in outs] == reference
    # a step is timed from the end of the one before when both decode only, in the same
    # mode and bucket: 3 rounds time 2 (warm-up), 3 plain steps 2 (the probe)
    large = [speculated for n, speculated in modes if n > 4]
    assert large[:3] == [True] * 3 and large[3:6] == [False] * 3, large
    # then plain steps, and a probe after every 6 timed: a round that catches the draft up
    # (untimed) and 2 timed rounds
    rounds_in_a_row = [len(list(run)) for speculated, run in groupby(large[6:]) if speculated]
    assert rounds_in_a_row and max(rounds_in_a_row) <= 3, large
    assert large[6:].count(False) >= 6 * (len(rounds_in_a_row) - 1)
    # rounds pay in the small bucket: plain steps only in its probes
    small = [speculated for n, speculated in modes if n <= 4]
    plain_in_a_row = [len(list(run)) for speculated, run in groupby(small) if not speculated]
    assert max(plain_in_a_row) <= 3 and small.count(True) >= 2 * small.count(False), small
    stats = engine.stats()
    assert stats.spec_buckets["16"]["speculates"] is False
    assert stats.spec_buckets["16"]["plain_ms"] == 10.0
    assert stats.spec_buckets["4"]["speculates"] is True
    assert stats.spec_plain_decode_tokens == sum(n for n, speculated in modes if not speculated)
    assert stats.spec_verify_rounds > 0
    assert not worker.undrafted


def test_a_calibrated_policy_decodes_plainly_from_the_first_large_rounds(
    checkpoint, greedy_reference
):
    """`calibrate_speculation` runs made-up requests as many as each bucket holds, both modes
    in turn, and hands the policy each bucket's step times; it leaves the speculation
    counters and the prefix cache as they were. With the scripted device above as the
    prior, the large bucket decodes plainly from its first round's acceptance on (no
    warm-up rounds, no probe before a period), the small one speculates, and the greedy
    output is still plain decoding's."""
    from itertools import groupby

    from runtime.engine.speculation_calibration import calibrate_speculation

    prompts, reference = greedy_reference
    engine = nextn_of(checkpoint, "auto")
    worker = engine.worker
    policy = worker.policy = ScriptedDevice(scripted_bucket, warmup=2, probe=2, period=1000)
    before = engine.stats()
    times = calibrate_speculation(engine, [4, 16], steps=3)
    assert set(times) == {4, 16} and times[16] == {"round_ms": 100.0, "plain_ms": 10.0}
    counts = policy.calibration_counts
    assert all(rounds >= 3 and plain >= 3 for rounds, plain in counts.values()), counts
    after = engine.stats()
    assert (after.spec_verify_rounds, after.spec_plain_decode_tokens) == (
        before.spec_verify_rounds,
        before.spec_plain_decode_tokens,
    )
    assert after.cache_tokens == 0
    modes = record_modes(worker)
    outs = engine.generate(input_ids=prompts, sampling_params=staggered_params())
    assert [o["output_ids"] for o in outs] == reference
    large = [speculated for n, speculated in modes if n > 4]
    assert large[0] and not any(large[1:]), large
    small = [speculated for n, speculated in modes if n <= 4]
    assert all(small), small
    assert [speculated for speculated, _ in groupby(s for _, s in modes)] == [True, False, True]
