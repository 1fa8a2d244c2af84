# SPDX-License-Identifier: Apache-2.0
"""The prefix cache changes nothing but the work done: for both families, plain and NEXTN,
output with the cache on equals output with it off (greedy tokens, and the logprobs of
every output token), and NEXTN's acceptance after a hit equals that without the cache
(the MTP draft's state is cached with the target's). Resume points cover a prefix ending
mid-page, at a window boundary, at a compression-block boundary and inside a Gated DeltaNet
chunk; a NEXTN round that ran past max_new_tokens; eviction under a tight pool; requests
sharing a prefix while one is retracted; `n > 1`; requests branching off a shared prompt
(the real MTP draft proposes exactly as without the cache). Request slots, pages, snapshot
slots and node locks all return to their start."""

from __future__ import annotations

import math

import pytest
import torch

from runtime import Engine
from tests.engine.test_nextn import OracleDrafter
from tests.engine.test_nextn_exactness import MTPThenOracle
from tests.tiny_checkpoints import build_tiny_qwen4_exp_mtp_checkpoint, build_tiny_v4_mtp_checkpoint

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        "v4": build_tiny_v4_mtp_checkpoint(tmp_path_factory.mktemp("v4_radix"), seed=31)[0],
        "qwen": build_tiny_qwen4_exp_mtp_checkpoint(tmp_path_factory.mktemp("q_radix"), seed=32)[0],
    }


def make_engine(path, cache: bool, spec: bool, **kw) -> Engine:
    options = dict(
        model_path=str(path),
        dtype="float32",
        page_size=4,
        max_running_requests=8,
        disable_radix_cache=not cache,
        radix_snapshot_interval=0,
    )
    if spec:
        options.update(speculative_algorithm="NEXTN", speculative_num_steps=3)
    return Engine(**{**options, **kw})


@pytest.fixture(scope="module")
def engines(checkpoints):
    """One engine per (family, NEXTN, cache on), built on first use and reused (flushed)."""
    built: dict = {}

    def get(family: str, spec: bool, cache: bool) -> Engine:
        key = (family, spec, cache)
        if key not in built:
            built[key] = make_engine(checkpoints[family], cache, spec)
        engine = built[key]
        assert engine.flush_cache()
        return engine

    return get


def prompt(length: int, seed: int, vocab: int = 90) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def check_counts_return(engine: Engine) -> None:
    """Nothing running and nothing leaked: request slots free, no node locked, every page
    and snapshot slot either free or held by the cache, and all free after a flush."""
    table, cache = engine.slot_table, engine.prefix_cache
    capacity = table.allocator.capacity_tokens
    assert not engine.has_work()
    assert table.req_pool.available() == table.req_pool.max_reqs
    if cache.enabled:
        assert cache.tree.locked_nodes() == 0 and not cache._locks and not cache._cuts
        held = cache.tree.cached_pages() * table.page_size
        assert table.allocator.available_tokens() + held == capacity
        assert cache.snapshots.available() + cache.tree.num_snapshots() == cache.snapshots.num_slots
    assert engine.flush_cache()
    assert table.allocator.available_tokens() == capacity
    if cache.enabled:
        assert cache.snapshots.available() == cache.snapshots.num_slots
        assert cache.tree.cached_pages() == 0


def cache_pools(engine: Engine) -> list:
    pools = [engine.runner.kv_pool]
    if engine.spec_config:
        pools.append(engine.worker.drafter.runner.kv_pool)
    return pools


def poison_free_request_slots(engine: Engine) -> None:
    """Overwrite the per-request state (rings, recurrent state) of every free request slot
    in the target and draft pools, so a resumed request is right only if the cache restored
    all of it."""
    g = torch.Generator().manual_seed(0)
    for pool in cache_pools(engine):
        for idx in engine.slot_table.req_pool._free:
            for view in pool.request_state(idx):
                noise = torch.randint(0, 50, view.shape, generator=g)
                view.copy_(noise if not view.is_floating_point() else noise.to(view.dtype) / 7)


def two_turns(engine: Engine, first: list[int], k: int, suffix: list[int], more: int = 12):
    """Turn 1 `first` -> k tokens; turn 2 resends turn 1 and its answer, plus `suffix`."""
    one = engine.generate(input_ids=first, sampling_params={**GREEDY, "max_new_tokens": k})
    poison_free_request_slots(engine)
    second = first + one["output_ids"] + suffix
    two = engine.generate(
        input_ids=second,
        sampling_params={**GREEDY, "max_new_tokens": more},
        return_logprob=True,
    )
    return one, two


def assert_same_result(on: dict, off: dict) -> None:
    assert on["output_ids"] == off["output_ids"]
    lp_on = [lp for lp, _, _ in on["meta_info"]["output_token_logprobs"]]
    lp_off = [lp for lp, _, _ in off["meta_info"]["output_token_logprobs"]]
    assert torch.allclose(torch.tensor(lp_on), torch.tensor(lp_off), atol=2e-4, rtol=0)
    if "spec_verify_ct" in off["meta_info"]:  # the draft proposes exactly as without the cache
        assert on["meta_info"]["spec_verify_ct"] == off["meta_info"]["spec_verify_ct"]
        assert on["meta_info"]["spec_accept_histogram"] == off["meta_info"]["spec_accept_histogram"]


# V4 test config: page 4, window 8, compress ratios 4 and 16 (unit 16); Qwen: GDN chunks of
# 64 tokens. The resume point of turn 2 is turn 1's length minus one.
RESUME_POINTS = {
    "mid_page": 30,  # 30 % 4 == 2, and inside a V4 CSA block and an HCA block
    "window_boundary": 40,  # 40 % 8 == 0 (and % 16 == 8: inside an HCA block)
    "block_boundary": 32,  # a boundary of both compress ratios (the tree's unit)
    "inside_gdn_chunk": 70,  # 70 % 64 == 6
}


@pytest.mark.parametrize("family", ["v4", "qwen"])
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "nextn"])
@pytest.mark.parametrize("where", list(RESUME_POINTS))
def test_two_turn_chat_resumes_at_turn_one_end_with_identical_output(engines, family, spec, where):
    resume = RESUME_POINTS[where]
    k = 9  # with NEXTN the last round of turn 1 usually runs past max_new_tokens
    first = prompt(resume - k + 1, seed=resume)
    suffix = prompt(7, seed=resume + 1)
    off = two_turns(engines(family, spec, cache=False), first, k, suffix)
    engine = engines(family, spec, cache=True)
    on = two_turns(engine, first, k, suffix)
    assert on[0]["output_ids"] == off[0]["output_ids"]
    assert on[0]["meta_info"]["cached_tokens"] == 0
    assert on[1]["meta_info"]["cached_tokens"] == resume
    assert_same_result(on[1], off[1])
    check_counts_return(engine)


@pytest.mark.parametrize("family", ["v4", "qwen"])
def test_snapshots_at_prefill_chunk_points_serve_a_diverging_prompt(checkpoints, family):
    """Prefill chunks end at multiples of the snapshot interval; a prompt sharing 45 tokens
    resumes at 32, the deepest snapshot before it diverges."""
    shared = prompt(50, seed=5)
    other = shared[:45] + prompt(10, seed=6)
    outputs = {}
    for cache in (False, True):
        engine = make_engine(checkpoints[family], cache, spec=True, radix_snapshot_interval=16)
        engine.generate(input_ids=shared, sampling_params={**GREEDY, "max_new_tokens": 3})
        outputs[cache] = engine.generate(
            input_ids=other, sampling_params={**GREEDY, "max_new_tokens": 16}, return_logprob=True
        )
    assert outputs[True]["meta_info"]["cached_tokens"] == 32
    assert_same_result(outputs[True], outputs[False])
    check_counts_return(engine)


@pytest.mark.parametrize("family", ["v4", "qwen"])
def test_evicted_prefix_is_prefilled_again_under_a_tight_pool(checkpoints, family):
    """Each conversation's first turn leaves ~48 cached tokens in a 160-token pool: later
    ones evict the oldest, whose second turn then prefills from scratch."""
    firsts = [prompt(40, seed=100 + i) for i in range(5)]
    suffix = prompt(5, seed=99)
    results = {}
    for cache in (False, True):
        engine = make_engine(checkpoints[family], cache, spec=True, max_total_tokens=160)
        answers = [
            engine.generate(input_ids=f, sampling_params={**GREEDY, "max_new_tokens": 8})
            for f in firsts
        ]
        again = [0, 4]  # the oldest (evicted) and the newest (still cached)
        results[cache] = [
            engine.generate(
                input_ids=firsts[i] + answers[i]["output_ids"] + suffix,
                sampling_params={**GREEDY, "max_new_tokens": 10},
                return_logprob=True,
            )
            for i in again
        ]
        if cache:
            stats = engine.stats()
            assert stats.cache_evicted_tokens > 0 and stats.cache_evicted_snapshots > 0
            check_counts_return(engine)
    evicted, kept = results[True]
    assert evicted["meta_info"]["cached_tokens"] < 16 and kept["meta_info"]["cached_tokens"] == 47
    for on, off in zip(results[True], results[False]):
        assert_same_result(on, off)


@pytest.mark.parametrize("family", ["v4", "qwen"])
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "nextn"])
def test_concurrent_requests_sharing_a_prefix_while_one_is_retracted(checkpoints, family, spec):
    """Six requests sharing 40 tokens arrive together in a pool too small for all of them:
    the followers wait for the first to cache the shared part, then the pool runs out and
    requests are retracted (their state goes to the cache) and resumed."""
    shared = prompt(40, seed=7)
    prompts = [shared + prompt(6, seed=200 + i) for i in range(6)]
    params = {**GREEDY, "max_new_tokens": 40}
    outs = {}
    for cache in (False, True):
        engine = make_engine(
            checkpoints[family], cache, spec, max_total_tokens=224, chunked_prefill_size=32
        )
        outs[cache] = engine.generate(input_ids=prompts, sampling_params=params)
        if cache:
            assert engine.scheduler.num_retractions > 0
            assert engine.stats().cache_hit_tokens >= 5 * 39
            assert [o["meta_info"]["cached_tokens"] for o in outs[cache]][1:] == [39] * 5
            check_counts_return(engine)
    assert [o["output_ids"] for o in outs[True]] == [o["output_ids"] for o in outs[False]]


@pytest.mark.parametrize("family", ["v4", "qwen"])
def test_n_choices_share_the_prompt_prefill(engines, family):
    """The n choices of one prompt: the first prefills it, the others resume at its last
    token, and every choice equals the single greedy answer."""
    ids = prompt(41, seed=8)
    engine = engines(family, True, cache=True)
    single = engines(family, True, cache=False).generate(
        input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 12}
    )
    choices = engine.generate(
        input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 12, "n": 4}
    )
    assert [c["output_ids"] for c in choices] == [single["output_ids"]] * 4
    assert [c["meta_info"]["cached_tokens"] for c in choices] == [0, 40, 40, 40]
    check_counts_return(engine)


def test_identical_prompts_prefilled_together_share_pages_mid_flight(checkpoints):
    """Two identical prompts prefilled in the same steps (no waiting): each caches at every
    chunk point, the second finds the first's pages there, frees its own copies and reads
    the tree's from then on; outputs stay exact."""
    ids = prompt(70, seed=9)
    params = {**GREEDY, "max_new_tokens": 10}
    ref = make_engine(checkpoints["qwen"], False, spec=False).generate(
        input_ids=ids, sampling_params=params
    )
    engine = make_engine(
        checkpoints["qwen"], True, spec=False, chunked_prefill_size=64, radix_snapshot_interval=16
    )
    engine.prefix_cache.min_shared_prefix = math.inf  # no waiting: both prefill together
    start = engine.slot_table.allocator.available_pages()
    both = engine.generate(input_ids=[ids, ids], sampling_params=params)
    assert [b["output_ids"] for b in both] == [ref["output_ids"]] * 2
    held = engine.prefix_cache.tree.cached_pages()
    assert held < 2 * 70 // 4  # one copy of the shared pages, not two
    assert engine.slot_table.allocator.available_pages() == start - held
    check_counts_return(engine)


def test_prompt_logprobs_are_computed_not_served_from_the_cache(checkpoints):
    """A request asking for prompt logprobs from position 20 resumes no later than the row
    that scores token 20 (here: the chunk-point snapshot at 16, not the one at 32)."""
    ids = prompt(40, seed=10)
    params = {**GREEDY, "max_new_tokens": 4}
    ask = dict(return_logprob=True, logprob_start_len=20)
    results = {}
    for cache in (False, True):
        engine = make_engine(checkpoints["v4"], cache, spec=False, radix_snapshot_interval=16)
        engine.generate(input_ids=ids, sampling_params=params)
        results[cache] = engine.generate(input_ids=ids, sampling_params=params, **ask)
        plain = engine.generate(input_ids=ids, sampling_params=params)
    assert results[True]["meta_info"]["cached_tokens"] == 16
    assert plain["meta_info"]["cached_tokens"] == 32
    got = [lp for lp, _, _ in results[True]["meta_info"]["input_token_logprobs"]]
    want = [lp for lp, _, _ in results[False]["meta_info"]["input_token_logprobs"]]
    assert len(got) == 20 and torch.allclose(torch.tensor(got), torch.tensor(want), atol=2e-4)
    assert_same_result(results[True], results[False])
    check_counts_return(engine)


class RecordingMTPThenOracle(MTPThenOracle):
    """Proposes the oracle's tokens but records what the real MTP draft proposed."""

    def __init__(self, mtp, oracle):
        super().__init__(mtp, oracle)
        self.real: list = []

    def draft(self, batch):
        self.real.append(self.mtp.draft(batch))
        return self.oracle.draft(batch)


@pytest.mark.parametrize("family", ["v4", "qwen"])
@pytest.mark.parametrize("steps,k,extra", [(3, 7, 6), (5, 3, 0)])
def test_round_past_the_stop_is_cached_at_the_stop(checkpoints, family, steps, k, extra):
    """Drafts the target always accepts make every round emit steps + 1 tokens, so turn 1's
    last round runs past max_new_tokens (by 2 and 4 tokens): its snapshot is the state after
    the verify row of its last kept token (the recurrent state from the verify pass's
    per-row states), and the draft's rings, which its chained steps wrote further, still
    hold that position's window: turn 2's real MTP proposals equal those without the cache.
    With no new tokens in turn 2 its first draft row reads the oldest row of that window."""
    first, suffix = prompt(30, seed=11), prompt(extra, seed=12)
    plain = make_engine(checkpoints[family], False, spec=False)
    turn1 = plain.generate(input_ids=first, sampling_params={**GREEDY, "max_new_tokens": 40})
    second = first + turn1["output_ids"][:k] + suffix
    turn2 = plain.generate(input_ids=second, sampling_params={**GREEDY, "max_new_tokens": 40})
    references = {
        tuple(first): first + turn1["output_ids"],
        tuple(second): second + turn2["output_ids"],
    }
    results, proposals = {}, {}
    for cache in (False, True):
        engine = make_engine(checkpoints[family], cache, spec=True, speculative_num_steps=steps)
        drafter = RecordingMTPThenOracle(
            engine.worker.drafter, OracleDrafter(steps, references, noise=0.0, vocab=90)
        )
        engine.worker.drafter = drafter
        results[cache] = two_turns(engine, first, k, suffix)
        proposals[cache] = drafter.real[2:]  # turn 2's (after turn 1's prefill and round)
        if cache:
            rounds = engine.worker.stats.verify_rounds
            assert engine.worker.stats.emitted_tokens == rounds * (steps + 1)
            assert rounds * (steps + 1) > (k - 1) + 11  # rounds ran past max_new_tokens
            check_counts_return(engine)
    on, off = results[True], results[False]
    assert on[0]["output_ids"] == off[0]["output_ids"] == turn1["output_ids"][:k]
    assert on[1]["meta_info"]["cached_tokens"] == len(first) + k - 1
    assert_same_result(on[1], off[1])
    assert proposals[True] == proposals[False]


class RecordingDrafter:
    """The real MTP draft, its proposals recorded (None ones, of chunks that only fill the
    draft's cache, left out)."""

    def __init__(self, mtp):
        self.runner, self.mtp, self.proposals = mtp.runner, mtp, []

    def draft(self, batch):
        out = self.mtp.draft(batch)
        self.proposals += [d for d in out if d is not None]
        return out


@pytest.mark.parametrize("family", ["v4", "qwen"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_requests_branching_off_a_shared_prefix_draft_as_without_the_cache(
    checkpoints, family, page_size
):
    """Five requests share 8 to 24 tokens of a prompt, then diverge; snapshots every 8
    tokens, 5 draft steps. A request branching off at `s` shares pages up to `s - 1` only:
    the MTP draft's row at `s - 1` was computed with the token at `s`, which differs (a
    Qwen4Exp draft keeps its rows in the shared pages). Each request's tokens, verify
    rounds, acceptance histogram and every proposal of the real draft are a cold run's."""
    base = prompt(40, seed=13)
    shares = [8, 12, 17, 21, 24]
    prompts = [
        base[:n] + [base[n] % 89 + 1] + prompt(6, seed=300 + i) for i, n in enumerate(shares)
    ]
    runs = {}
    for cache in (False, True):
        engine = make_engine(
            checkpoints[family],
            cache,
            spec=True,
            page_size=page_size,
            radix_snapshot_interval=8,
            speculative_num_steps=5,
        )
        drafter = engine.worker.drafter = RecordingDrafter(engine.worker.drafter)
        runs[cache] = []
        for ids in prompts:
            drafter.proposals = []
            out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 24})
            runs[cache].append((out, drafter.proposals))
        if cache:
            check_counts_return(engine)
    assert sum(out["meta_info"]["cached_tokens"] for out, _ in runs[True]) > 0
    for (on, drafts_on), (off, drafts_off) in zip(runs[True], runs[False]):
        assert on["output_ids"] == off["output_ids"]
        for key in ("spec_verify_ct", "spec_accept_histogram"):
            assert on["meta_info"][key] == off["meta_info"][key]
        assert drafts_on == drafts_off


@pytest.mark.parametrize("family", ["v4", "qwen"])
def test_requests_branching_off_a_shared_prefix_together_draft_as_without_the_cache(
    checkpoints, family
):
    """The same five requests prefilled together in chunks of 8 (the snapshot points, so
    both engines run the same steps): each caches its prefix at every chunk point while the
    others run, finding their pages in the tree. Every proposal of the real draft, by
    request and position, and every acceptance histogram equal those without the cache."""
    base = prompt(40, seed=13)
    shares = [8, 12, 17, 21, 24]
    prompts = [
        base[:n] + [base[n] % 89 + 1] + prompt(6, seed=300 + i) for i, n in enumerate(shares)
    ]
    runs = {}
    for cache in (False, True):
        engine = make_engine(
            checkpoints[family],
            cache,
            spec=True,
            page_size=1,
            radix_snapshot_interval=8,
            chunked_prefill_size=8,
            speculative_num_steps=5,
        )
        proposals = {}
        mtp = engine.worker.drafter
        real = mtp.draft

        def draft(batch, real=real, proposals=proposals):
            out = real(batch)
            for b, drafted in enumerate(out):
                if drafted is not None:
                    key = (tuple(batch.reqs[b].prompt_ids), batch.first_chain_position(b))
                    proposals[key] = drafted
            return out

        mtp.draft = draft
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 24})
        runs[cache] = (outs, proposals)
        if cache:
            check_counts_return(engine)
    (on, drafts_on), (off, drafts_off) = runs[True], runs[False]
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    assert [o["meta_info"]["spec_accept_histogram"] for o in on] == [
        o["meta_info"]["spec_accept_histogram"] for o in off
    ]
    assert drafts_on == drafts_off


@pytest.fixture(scope="module")
def trained():
    """The embedded tiny DeepSeek-V4 with its trained MTP draft (accept length ~2.5), and
    code prompts in its domain."""
    engines = {
        cache: Engine(
            dtype="float32",
            page_size=4,
            max_running_requests=8,
            max_total_tokens=8192,
            speculative_algorithm="NEXTN",
            disable_radix_cache=not cache,
            radix_snapshot_interval=0,
        )
        for cache in (False, True)
    }
    openings = ["import os\n\n\ndef ", "class Stack:\n    def ", "def parse(text):\n    "]
    return engines, [engines[False].tokenize(o) for o in openings]


def test_trained_draft_proposes_after_a_hit_exactly_as_without_the_cache(trained):
    """Three three-turn conversations; every turn after the first resumes from the previous
    turn's snapshot. Tokens, logprobs, verify rounds and acceptance histograms per turn are
    those of the cache-off engine, and so is the engine-wide accept length."""
    engines, openings = trained
    lengths, results = {}, {}
    for cache, engine in engines.items():
        assert engine.flush_cache()
        before = (engine.worker.stats.emitted_tokens, engine.worker.stats.verify_rounds)
        turns, resumes = [], []
        for history in openings:
            resume = 0
            for turn in range(3):
                poison_free_request_slots(engine)
                out = engine.generate(
                    input_ids=history,
                    sampling_params={**GREEDY, "max_new_tokens": 16 + 3 * turn},
                    return_logprob=True,
                )
                turns.append(out)
                resumes.append(resume)
                resume = len(history) + len(out["output_ids"]) - 1  # the next turn's
                history = history + out["output_ids"] + engine.tokenize(f"\n# step {turn}\n")
        stats = engine.worker.stats
        lengths[cache] = (stats.emitted_tokens - before[0]) / (stats.verify_rounds - before[1])
        results[cache] = turns
        if cache:
            assert engine.stats().cache_hit_rate > 0.5
            check_counts_return(engine)
    for on, off, resume in zip(results[True], results[False], resumes):
        assert on["meta_info"]["cached_tokens"] == resume
        assert_same_result(on, off)
    assert lengths[False] > 1.8  # a draft worth checking
    assert lengths[True] == pytest.approx(lengths[False], abs=1e-9)
