# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding under retraction and tight limits (issue 14 C).

Against plain decoding with a large pool: NEXTN output is the same whatever the page size,
the chunk size and the pool (from one that barely fits the longest request to one that
holds all of them), with retractions in the middle of prefills and of decodes; every slot
comes back. Seeded sampling gives the same tokens with and without retraction, in both
modes; prompt logprobs survive a retraction mid-prefill; a request that exactly fits the
pool is served in full under NEXTN too.
"""

from __future__ import annotations

import pytest
import torch

from runtime import Engine
from tests.engine.test_nextn import make_prompts
from tests.tiny_checkpoints import build_tiny_qwen4_exp_mtp_checkpoint, build_tiny_v4_mtp_checkpoint

NEW_TOKENS = 40
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
STEPS = 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_v4_mtp_checkpoint(tmp_path_factory.mktemp("retraction"), seed=5)[0]


@pytest.fixture(scope="module")
def prompts():
    """Six prompts of 6-45 tokens: a chunk of 16 ends anywhere in them."""
    return make_prompts(6, seed=4, low=6, high=46)


@pytest.fixture(scope="module")
def plain_reference(ckpt, prompts):
    engine = Engine(model_path=str(ckpt), dtype="float32", page_size=4)
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]


def engine_for(ckpt, spec: bool, **kw) -> Engine:
    extra = dict(speculative_algorithm="NEXTN", speculative_num_steps=STEPS) if spec else {}
    return Engine(model_path=str(ckpt), dtype="float32", max_running_requests=8, **kw, **extra)


def just_fitting_pool(prompts, page_size: int) -> int:
    """The smallest pool (whole pages) that holds the longest request alone."""
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    return -(-longest // page_size) * page_size


def run_all(engine: Engine, prompts, params) -> list:
    """Every prompt queued at once, run to the end; asserts every slot came back."""
    table = engine.slot_table
    assert engine.flush_cache()
    free_tokens, free_slots = table.allocator.available_tokens(), table.req_pool.available()
    reqs = [engine.make_request(p, params) for p in prompts]
    for req in reqs:
        engine.add_request(req)
    while engine.has_work():
        engine.step()
    assert engine.flush_cache()  # the prefix cache gives back every page it kept
    assert table.allocator.available_tokens() == free_tokens
    assert table.req_pool.available() == free_slots
    return reqs


def check_matrix_case(ckpt, prompts, plain_reference, page_size, chunk, pool):
    engine = engine_for(
        ckpt, True, page_size=page_size, chunked_prefill_size=chunk, max_total_tokens=pool
    )
    reqs = run_all(engine, prompts, GREEDY)
    assert [r.finish_reason.type for r in reqs] == ["length"] * len(reqs)
    assert [r.output_ids for r in reqs] == plain_reference
    return engine.scheduler.num_retractions


MATRIX = [
    (page, chunk, pool)
    for page in (1, 4, 16)
    for chunk in (1, 7, 16)
    for pool in ("just-fitting", "half", "roomy")
]
# the crash of issue 14 (page 16, chunk 16, a pool that barely fits), and two other shapes
FAST = {(16, 16, "just-fitting"), (4, 7, "half"), (1, 16, "half")}


@pytest.mark.parametrize(
    "page_size,chunk,pool",
    [case if case in FAST else pytest.param(*case, marks=pytest.mark.slow) for case in MATRIX],
)
def test_nextn_under_retraction_equals_plain(
    ckpt, prompts, plain_reference, page_size, chunk, pool
):
    """Pools: one that holds only the longest request (requests are retracted mid-prefill
    and mid-decode), half of what all need at once, and all of it."""
    fit = just_fitting_pool(prompts, page_size)
    total = sum(len(p) + NEW_TOKENS + 2 * STEPS for p in prompts)
    size = {"just-fitting": fit, "half": max(fit, total // 2), "roomy": 2 * total}[pool]
    size = -(-size // page_size) * page_size
    retractions = check_matrix_case(ckpt, prompts, plain_reference, page_size, chunk, size)
    if pool == "just-fitting":
        assert retractions > 0


def test_a_request_that_fits_the_pool_exactly_is_served_in_full(ckpt):
    """Pool 60, prompt 20 + 40 new tokens: plain decoding gets its 40 tokens; NEXTN's
    verify slack past the request's last position must not cost it any."""
    prompt = make_prompts(1, seed=9, low=20, high=21)[0]
    for spec in (False, True):
        engine = engine_for(ckpt, spec, page_size=1, max_total_tokens=60)
        (req,) = run_all(engine, [prompt], GREEDY)
        assert req.finish_reason.type == "length" and len(req.output_ids) == NEW_TOKENS


@pytest.mark.parametrize("spec,pool", [(False, 64), (True, 72)])
def test_prompt_logprobs_survive_a_retraction_mid_prefill(ckpt, spec, pool):
    """A 45-token prompt, prefilled 2 tokens a step, is retracted part-way (a shorter
    request decoding beside it runs out of pages): it still returns one logprob per
    prompt token, equal to those of a run without retraction, and the same output."""
    short = make_prompts(1, seed=3, low=6, high=7)[0]
    long = make_prompts(1, seed=6, low=45, high=46)[0]
    options = dict(return_logprob=True, logprob_start_len=0)

    def run(max_total_tokens):
        engine = engine_for(
            ckpt, spec, page_size=4, chunked_prefill_size=2, max_total_tokens=max_total_tokens
        )
        first = engine.make_request(short, GREEDY)
        second = engine.make_request(long, {**GREEDY, "max_new_tokens": 10}, **options)
        engine.add_request(first)
        engine.add_request(second)
        retracted_mid_prefill = False
        while engine.has_work():
            cached, retractions = second.num_cached, second.num_retractions
            engine.step()
            if second.num_retractions > retractions and 0 < cached < len(long):
                retracted_mid_prefill = True
        return second, retracted_mid_prefill

    calm, calm_retracted = run(4096)
    busy, busy_retracted = run(pool)
    assert busy_retracted and not calm_retracted
    assert [t for _, t in busy.input_token_logprobs] == long
    assert busy.input_token_logprobs[0][0] is None
    torch.testing.assert_close(
        torch.tensor([lp for lp, _ in busy.input_token_logprobs[1:]]),
        torch.tensor([lp for lp, _ in calm.input_token_logprobs[1:]]),
        atol=1e-4,
        rtol=0,
    )
    assert busy.output_ids == calm.output_ids


def test_qwen4_exp_draft_reaches_the_end_of_the_context_with_block_length_16(tmp_path):
    """Qwen4Exp's draft remembers its QSA block choice per block of 16 positions; near the
    end of the context its chained steps run past the last whole block (an IndexError in
    `recall_selection` before): NEXTN must give plain decoding's tokens up to the end."""
    path = build_tiny_qwen4_exp_mtp_checkpoint(
        tmp_path, seed=2, indexer_compress_ratio=16, indexer_budget=32
    )[0]
    prompt = make_prompts(1, seed=1, low=40, high=41, vocab=128)[0]
    params = {**GREEDY, "max_new_tokens": 60}  # prompt + new tokens = the whole context
    outputs = []
    for spec in (False, True):
        engine = engine_for(path, spec, page_size=4, context_length=100)
        (req,) = run_all(engine, [prompt], params)
        assert req.finish_reason.type == "length"
        outputs.append(req.output_ids)
    assert outputs[0] == outputs[1]


def seeded(seed: int) -> dict:
    return {
        "temperature": 1.5,
        "max_new_tokens": NEW_TOKENS,
        "ignore_eos": True,
        "sampling_seed": seed,
    }


@pytest.mark.parametrize("spec", [False, True])
def test_seeded_sampling_does_not_depend_on_retraction_or_batch(ckpt, prompts, spec):
    """Each prompt sampled with its own seed (temperature 1.5): alone with a large pool,
    then all together in a pool so small that requests are retracted and resumed: the
    same tokens."""
    prompts = prompts[:4]
    seeds = list(range(100, 100 + len(prompts)))
    alone = []
    for prompt, seed in zip(prompts, seeds):
        engine = engine_for(ckpt, spec, page_size=4)
        (req,) = run_all(engine, [prompt], seeded(seed))
        alone.append(req.output_ids)
    engine = engine_for(
        ckpt,
        spec,
        page_size=4,
        chunked_prefill_size=7,
        max_total_tokens=just_fitting_pool(prompts, 4),
    )
    table = engine.slot_table
    start = table.allocator.available_tokens(), table.req_pool.available()
    reqs = [engine.make_request(p, seeded(s)) for p, s in zip(prompts, seeds)]
    for req in reqs:
        engine.add_request(req)
    while engine.has_work():
        engine.step()
    assert engine.scheduler.num_retractions > 0
    assert engine.flush_cache()
    assert (table.allocator.available_tokens(), table.req_pool.available()) == start
    assert [r.output_ids for r in reqs] == alone


def test_n_copies_with_a_seed_differ_and_reproduce(ckpt, prompts):
    """`n > 1` with `sampling_seed`: copy k samples with seed + k, so the copies differ,
    and the whole request reproduces."""
    engine = engine_for(ckpt, False, page_size=4)
    params = {**seeded(7), "n": 4, "max_new_tokens": 12}
    first = engine.generate(input_ids=prompts[0], sampling_params=params)
    again = engine.generate(input_ids=prompts[0], sampling_params=params)
    outputs = [r["output_ids"] for r in first]
    assert len(outputs) == 4 and len({tuple(o) for o in outputs}) == 4
    assert outputs == [r["output_ids"] for r in again]
    single = engine.generate(input_ids=prompts[0], sampling_params={**params, "n": 1})
    assert single["output_ids"] == outputs[0]


@pytest.mark.parametrize("page_size,chunk,pool", [(16, 16, "just-fitting"), (4, 7, "half")])
def test_speculation_off_in_large_batches_under_retraction_equals_plain(
    ckpt, prompts, plain_reference, page_size, chunk, pool
):
    """With speculation off from 3 requests on, requests are retracted while decoding
    without speculation (the draft catches up over their rows before the prefix cache keeps
    their state, and they resume with that round's drafts) and while speculating."""
    fit = just_fitting_pool(prompts, page_size)
    total = sum(len(p) + NEW_TOKENS + 2 * STEPS for p in prompts)
    size = {"just-fitting": fit, "half": max(fit, total // 2)}[pool]
    engine = engine_for(
        ckpt,
        True,
        page_size=page_size,
        chunked_prefill_size=chunk,
        max_total_tokens=-(-size // page_size) * page_size,
        speculative_disable_by_batch_size=3,
    )
    reqs = run_all(engine, prompts, GREEDY)
    assert [r.output_ids for r in reqs] == plain_reference
    assert engine.scheduler.num_retractions > 0
    assert engine.worker.stats.verify_rounds > 0 and not engine.worker.undrafted
