# SPDX-License-Identifier: Apache-2.0
"""NEXTN on Qwen4Exp is lossless: greedy equals plain greedy, sampling reproduces the plain
distribution, and after each round the recurrent states (Gated DeltaNet conv + state), the
PLE rings, the QSA key cache and the attention KV equal what plain processing leaves."""

from __future__ import annotations

import pytest
import torch

from runtime import Engine
from runtime.core.request import Req
from runtime.core.sampling_params import SamplingParams
from runtime.core.step_io import Chunk
from tests.engine.test_nextn import OracleDrafter, run_batches
from tests.engine.test_nextn_exactness import MTPThenOracle, exact_marginals, fit_pvalues
from tests.tiny_checkpoints import build_tiny_qwen4_exp_mtp_checkpoint

GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}


def prompts(count, seed, low=3, high=40, vocab=128):
    g = torch.Generator().manual_seed(seed)
    out = [
        torch.randint(2, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(low, high, (count,), generator=g)
    ]
    for p in out[::3]:  # some EOS inside prompts: the PLE context restarts there
        p[len(p) // 2] = 1
    return out


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    return build_tiny_qwen4_exp_mtp_checkpoint(tmp_path_factory.mktemp("qwen_nextn"), seed=9)[0]


@pytest.fixture(scope="module")
def reference(qwen_ckpt):
    engine = Engine(
        model_path=str(qwen_ckpt), dtype="float32", page_size=4, max_running_requests=32
    )
    batch = prompts(21, seed=1)
    long = {**GREEDY, "max_new_tokens": GREEDY["max_new_tokens"] + 10}
    outs = engine.generate(input_ids=batch, sampling_params=long)
    return batch, {tuple(p): p + o["output_ids"] for p, o in zip(batch, outs)}


def nextn(path, steps, page_size=4, **kw):
    return Engine(
        model_path=str(path),
        dtype="float32",
        page_size=page_size,
        max_running_requests=16,
        speculative_algorithm="NEXTN",
        speculative_num_steps=steps,
        **kw,
    )


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_nextn_equals_plain(qwen_ckpt, reference, steps, page_size):
    batch, refs = reference
    engine = nextn(qwen_ckpt, steps, page_size)
    engine.worker.drafter = MTPThenOracle(
        engine.worker.drafter, OracleDrafter(steps, refs, noise=0.3, seed=steps, vocab=128)
    )
    start = engine.slot_table.allocator.available_tokens()
    outputs = run_batches(engine, batch)
    for prompt, out in zip(batch, outputs):
        assert out["output_ids"] == refs[tuple(prompt)][len(prompt) : len(prompt) + 48]
    assert engine.flush_cache()  # the prefix cache gives back every page it kept
    assert engine.slot_table.allocator.available_tokens() == start
    assert 1.3 < engine.avg_spec_accept_length < steps + 1


def test_real_qwen_mtp_draft_is_lossless(qwen_ckpt, reference):
    batch, refs = reference
    engine = nextn(qwen_ckpt, 3, chunked_prefill_size=16)
    for prompt, out in zip(batch, run_batches(engine, batch)):
        assert out["output_ids"] == refs[tuple(prompt)][len(prompt) : len(prompt) + 48]


def test_missing_mtp_weights_fail_clearly(tmp_path):
    from tests.tiny_checkpoints import build_tiny_qwen4_exp_checkpoint

    path, _ = build_tiny_qwen4_exp_checkpoint(tmp_path / "no_mtp", seed=2)
    with pytest.raises(ValueError, match=r"no MTP weights.*drop --speculative-algorithm"):
        nextn(path, 3)


# -- sampling distribution ---------------------------------------------------------------


def test_sampling_matches_the_plain_distribution(tmp_path):
    vocab = 8
    path, target, _ = build_tiny_qwen4_exp_mtp_checkpoint(
        tmp_path / "v8", seed=13, vocab_size=vocab
    )
    prompt = [5, 3, 7, 2, 6, 4, 2, 3, 5]
    params = {"temperature": 1.0, "top_p": 0.9}
    engine = nextn(path, 2, max_total_tokens=3000 * 24, random_seed=7)
    engine.scheduler.max_running_requests = 3000
    out = engine.generate(
        input_ids=[prompt] * 3000,
        sampling_params={**params, "max_new_tokens": 3, "ignore_eos": True},
    )
    assert sum(engine.worker.stats.accepted_at) > 0
    tokens = torch.tensor([r["output_ids"] for r in out])
    import tests.engine.test_nextn_exactness as exact

    old = exact.VOCAB
    exact.VOCAB = vocab
    try:
        pvalues = fit_pvalues(tokens, exact_marginals(target, prompt, params))
    finally:
        exact.VOCAB = old
    assert min(pvalues) > 1e-3, pvalues


# -- rollback ------------------------------------------------------------------------------


def live_rows(engine, slot: int, committed: int) -> dict[str, torch.Tensor]:
    """Every cache row a later step can read, for positions < `committed`."""
    out = {}
    table = engine.slot_table.req_to_token[slot]
    slots = table[:committed]
    for name, runner in (("target", engine.runner), ("draft", engine.worker.drafter.runner)):
        pool = runner.kv_pool
        for layer in pool.k_cache:
            out[f"{name}.k.{layer}"] = pool.k_cache[layer][slots]
            out[f"{name}.v.{layer}"] = pool.v_cache[layer][slots]
            out[f"{name}.index.{layer}"] = pool.index_cache[layer][slots]
        req = torch.tensor([slot])
        for layer in pool.conv_state:
            pos = torch.arange(max(0, committed - pool.layout.conv_kernel + 1), committed)
            out[f"{name}.conv.{layer}"] = pool.conv_state[layer][
                slot * pool.conv_ring + pos % pool.conv_ring
            ]
            out[f"{name}.ssm.{layer}"] = pool.ssm_state[layer][req]
        for layer in pool.ple_tokens:
            pos = torch.arange(max(0, committed - pool.layout.ngram_size + 1), committed)
            out[f"{name}.ple_tokens.{layer}"] = pool.ple_tokens[layer][
                slot * pool.token_ring + pos % pool.token_ring
            ]
            pos = torch.arange(max(0, committed - pool.layout.ple_conv_span), committed)
            out[f"{name}.ple_conv.{layer}"] = pool.ple_conv[layer][
                slot * pool.ple_conv_ring + pos % pool.ple_conv_ring
            ]
    return out


def fresh_prefill_rows(engine, tokens: list[int]) -> dict[str, torch.Tensor]:
    req = Req("ref", list(tokens), SamplingParams(temperature=0))
    req.req_pool_idx = engine.slot_table.open_request()
    engine.slot_table.reserve(req.req_pool_idx, len(tokens) + engine.worker.reserve_ahead())
    engine.worker.step([Chunk(req, 0, len(tokens))], [])
    rows = live_rows(engine, req.req_pool_idx, len(tokens))
    engine.slot_table.release(req.req_pool_idx)
    return rows


def test_caches_after_every_round_equal_plain_processing(qwen_ckpt, reference):
    batch, refs = reference
    steps = 3
    engine, fresh = nextn(qwen_ckpt, steps), nextn(qwen_ckpt, steps)
    engine.worker.drafter = MTPThenOracle(
        engine.worker.drafter, OracleDrafter(steps, refs, noise=0.35, seed=2, vocab=128)
    )
    reqs = [
        Req(f"r{i}", p, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
        for i, p in enumerate(batch[:3])
    ]
    for req in reqs:
        engine.scheduler.add_request(req)
    while engine.scheduler.has_work():
        engine.scheduler.step()
        for req in engine.scheduler.running:
            got = live_rows(engine, req.req_pool_idx, req.num_cached)
            want = fresh_prefill_rows(fresh, req.all_ids[: req.num_cached])
            for key in want:
                torch.testing.assert_close(
                    got[key],
                    want[key],
                    atol=2e-5,
                    rtol=0,
                    msg=lambda m, k=key, c=req.num_cached: f"{k} after {c} tokens: {m}",
                )
    assert any(0 < m < steps and c for r in reqs for m, c in enumerate(r.spec_accept_hist))
