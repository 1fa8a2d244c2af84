# SPDX-License-Identifier: Apache-2.0
"""NEXTN exactness beyond greedy, for both families (DeepSeek-V4 and Qwen4Exp, over a
`family` fixture): the sampled-token distribution equals plain sampling's, and after every
round each cache holds exactly what plain processing of the committed tokens leaves
(DeepSeek-V4: window KV, compressed entries, compressor and indexer states; Qwen4Exp: the
Gated DeltaNet conv and recurrent states, the PLE rings, the QSA key cache and the KV)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from scipy.stats import chisquare

from runtime import Engine
from runtime.core.request import Req
from runtime.core.sampling_params import SamplingParams
from runtime.core.step_io import Chunk
from runtime.execution.sampler import SamplingBatch, target_probs
from runtime.speculative import nextn_worker
from runtime.speculative.acceptance import VerifyResult
from tests.engine.test_nextn import MTPThenOracle, OracleDrafter, make_prompts, prompts_with_eos
from tests.tiny_checkpoints import build_tiny_qwen4_exp_mtp_checkpoint, build_tiny_v4_mtp_checkpoint

VOCAB = 8


@dataclass(frozen=True)
class SamplingFamily:
    """What differs between the families in the sampled-distribution test."""

    build: Callable  # (path, seed, vocab_size=) -> (path, transformers target, MTP holder)
    seed: int
    prompt: Callable[[], list[int]]
    random_seed: int  # the engine's


SAMPLING_FAMILIES = {
    "deepseek_v4": SamplingFamily(
        build_tiny_v4_mtp_checkpoint,
        seed=12,
        prompt=lambda: make_prompts(1, seed=4, vocab=VOCAB, low=9, high=10)[0],
        random_seed=1234,
    ),
    "qwen4_exp": SamplingFamily(
        build_tiny_qwen4_exp_mtp_checkpoint,
        seed=13,
        prompt=lambda: [5, 3, 7, 2, 6, 4, 2, 3, 5],
        random_seed=7,
    ),
}


@pytest.fixture(scope="module")
def small_vocab_of(tmp_path_factory):
    """family -> (path, transformers target) of its 8-token checkpoint, built on first use."""
    made: dict = {}

    def get(family: str):
        if family not in made:
            spec = SAMPLING_FAMILIES[family]
            path, target, _ = spec.build(
                tmp_path_factory.mktemp(f"v8_{family}"), seed=spec.seed, vocab_size=VOCAB
            )
            made[family] = path, target
        return made[family]

    return get


@pytest.fixture(scope="module")
def small_vocab(small_vocab_of):
    return small_vocab_of("deepseek_v4")


def exact_marginals(hf_model, prompt, params):
    """Exact distributions of the 1st, 2nd and 3rd sampled token under `params`."""
    batch = SamplingBatch.from_params([SamplingParams.from_dict(params)], VOCAB)

    def probs(ids):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1:]
        return target_probs(logits, batch)[0].double()

    p1 = probs(prompt)
    p2 = torch.stack([probs(prompt + [a]) for a in range(VOCAB)])  # [a, b]
    p3 = torch.stack(
        [torch.stack([probs(prompt + [a, b]) for b in range(VOCAB)]) for a in range(VOCAB)]
    )
    joint2 = p1.unsqueeze(1) * p2
    return p1, joint2.sum(0), (joint2.unsqueeze(-1) * p3).sum((0, 1))


def sampled_tokens(path, prompt, params, count, steps=2, random_seed=1234, **engine_args):
    engine = Engine(
        model_path=str(path),
        dtype="float32",
        page_size=4,
        max_running_requests=count,
        max_total_tokens=count * 24,
        random_seed=random_seed,
        speculative_algorithm="NEXTN",
        speculative_num_steps=steps,
        **engine_args,
    )
    out = engine.generate(
        input_ids=[prompt] * count,
        sampling_params={**params, "max_new_tokens": 3, "ignore_eos": True},
    )
    assert engine.worker.stats.verify_rounds > 0 and sum(engine.worker.stats.accepted_at) > 0
    return torch.tensor([r["output_ids"] for r in out])


def fit_pvalues(tokens, marginals):
    pvalues = []
    for position, expected in enumerate(marginals):
        observed = torch.bincount(tokens[:, position], minlength=VOCAB).double()
        support = expected > 1e-12
        assert observed[~support].sum() == 0, f"token {position + 1} outside the target's support"
        exp = expected[support] / expected[support].sum() * tokens.shape[0]
        pvalues.append(chisquare(observed[support].numpy(), exp.numpy()).pvalue)
    return pvalues


CONFIGS = [
    {"temperature": 1.0},
    {"temperature": 1.0, "top_p": 0.7},
    {"temperature": 0.8, "top_k": 3},
]


@pytest.mark.parametrize(
    "family, params",
    [("deepseek_v4", params) for params in CONFIGS]
    + [("qwen4_exp", {"temperature": 1.0, "top_p": 0.9})],
)
def test_nextn_sampling_matches_the_plain_distribution(small_vocab_of, family, params):
    path, hf_model = small_vocab_of(family)
    spec = SAMPLING_FAMILIES[family]
    prompt = spec.prompt()
    tokens = sampled_tokens(path, prompt, params, count=3000, random_seed=spec.random_seed)
    pvalues = fit_pvalues(tokens, exact_marginals(hf_model, prompt, params))
    assert min(pvalues) > 1e-3, pvalues


def test_a_hot_vocabulary_draft_keeps_the_plain_distribution(small_vocab, tmp_path):
    """With `--speculative-token-map` the draft proposes from 3 of the 8 tokens: the tokens
    it cannot propose are reached only through rejections, and the sampled distribution is
    still the target's."""
    path, hf_model = small_vocab
    table = tmp_path / "freq.json"
    table.write_text("[0, 2, 5]")
    params = CONFIGS[0]
    prompt = make_prompts(1, seed=4, vocab=VOCAB, low=9, high=10)[0]
    tokens = sampled_tokens(path, prompt, params, count=3000, speculative_token_map=str(table))
    pvalues = fit_pvalues(tokens, exact_marginals(hf_model, prompt, params))
    assert min(pvalues) > 1e-3, pvalues


def test_biased_acceptance_is_detected(small_vocab, monkeypatch):
    """Accepting every draft (a classic bug) makes tokens 2-3 follow the drafter; the same
    statistical check must reject it, or the test above would prove nothing."""
    path, hf_model = small_vocab

    def accept_all(logits, drafts, sampling, positions, generator=None):
        bs, steps = drafts.shape
        last = logits.view(bs, steps + 1, -1)[:, -1]
        return VerifyResult(torch.full((bs,), steps), last.argmax(-1))

    monkeypatch.setattr(nextn_worker, "verify", accept_all)
    prompt = make_prompts(1, seed=4, vocab=VOCAB, low=9, high=10)[0]
    params = CONFIGS[0]
    tokens = sampled_tokens(path, prompt, params, count=3000)
    pvalues = fit_pvalues(tokens, exact_marginals(hf_model, prompt, params))
    assert pvalues[0] > 1e-3  # the first token comes from plain prefill sampling
    assert min(pvalues[1:]) < 1e-6, pvalues


# ----------------------------------------------------------------------------------------
# rollback: the caches after each round


def deepseek_v4_live_rows(engine, req_pool_idx: int, committed: int) -> dict[str, torch.Tensor]:
    """Every cache row a later step can still read, for positions < `committed`."""
    out = {}
    for name, runner in (("target", engine.runner), ("draft", engine.worker.drafter.runner)):
        pool = runner.kv_pool
        window = pool.layout.sliding_window
        positions = torch.arange(max(0, committed - window + 1), committed)
        req = torch.full_like(positions, req_pool_idx)
        for layer, buf in enumerate(pool.swa_kv):
            out[f"{name}.swa.{layer}"] = buf[pool.swa_loc(req, positions)]
        for layer, ratio in enumerate(pool.layout.compress_ratios):
            if ratio <= 1:
                continue
            starts = torch.arange(committed // ratio) * ratio
            rows = pool.compressed_loc(ratio, engine.slot_table.req_to_token[req_pool_idx, starts])
            overlap = 2 if ratio == 4 else 1
            state_pos = torch.arange(max(0, (committed // ratio + 1 - overlap) * ratio), committed)
            state_rows = pool.state_loc(ratio, torch.full_like(state_pos, req_pool_idx), state_pos)
            out[f"{name}.compressed.{layer}"] = pool.compressed_kv[layer][rows]
            out[f"{name}.state.{layer}"] = pool.compressor_state[layer][state_rows]
            if layer in pool.indexer_k:
                out[f"{name}.index_k.{layer}"] = pool.indexer_k[layer][rows]
                out[f"{name}.index_state.{layer}"] = pool.indexer_state[layer][state_rows]
    return out


def qwen4_exp_live_rows(engine, slot: int, committed: int) -> dict[str, torch.Tensor]:
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


ROLLBACK_ROWS = {"deepseek_v4": deepseek_v4_live_rows, "qwen4_exp": qwen4_exp_live_rows}


def fresh_prefill_rows(engine, family: str, tokens: list[int]) -> dict[str, torch.Tensor]:
    """Caches after prefilling `tokens` from scratch (target + draft extend)."""
    req = Req("ref", list(tokens), SamplingParams(temperature=0))
    req.req_pool_idx = engine.slot_table.open_request()
    engine.slot_table.reserve(req.req_pool_idx, len(tokens) + engine.worker.reserve_ahead())
    engine.worker.step([Chunk(req, 0, len(tokens))], [])
    rows = ROLLBACK_ROWS[family](engine, req.req_pool_idx, len(tokens))
    engine.slot_table.release(req.req_pool_idx)
    return rows


@dataclass(frozen=True)
class RollbackFamily:
    """What differs between the families in the caches-after-every-round test."""

    build: Callable
    seed: int
    prompts: Callable[[], list[list[int]]]
    max_new_tokens: int
    oracle_seed: int
    vocab: int


ROLLBACK_FAMILIES = {
    "deepseek_v4": RollbackFamily(
        build_tiny_v4_mtp_checkpoint,
        seed=8,
        prompts=lambda: make_prompts(3, seed=6, low=10, high=30),
        max_new_tokens=50,
        oracle_seed=1,
        vocab=97,
    ),
    "qwen4_exp": RollbackFamily(
        build_tiny_qwen4_exp_mtp_checkpoint,
        seed=9,
        prompts=lambda: prompts_with_eos(21, 1, vocab=128)[:3],
        max_new_tokens=40,
        oracle_seed=2,
        vocab=128,
    ),
}


@pytest.mark.parametrize(
    "family, steps", [("deepseek_v4", 2), ("deepseek_v4", 3), ("qwen4_exp", 3)]
)
def test_caches_after_every_round_equal_plain_processing(tmp_path, family, steps):
    spec = ROLLBACK_FAMILIES[family]
    path = spec.build(tmp_path / "c", seed=spec.seed)[0]
    prompts = spec.prompts()
    plain = Engine(model_path=str(path), dtype="float32", page_size=4)
    references = {
        tuple(p): p + r["output_ids"]
        for p, r in zip(
            prompts,
            plain.generate(
                input_ids=prompts,
                sampling_params={"temperature": 0, "max_new_tokens": 60, "ignore_eos": True},
            ),
        )
    }

    def spec_engine():
        return Engine(
            model_path=str(path),
            dtype="float32",
            page_size=4,
            speculative_algorithm="NEXTN",
            speculative_num_steps=steps,
        )

    engine, reference = spec_engine(), spec_engine()
    engine.worker.drafter = MTPThenOracle(
        engine.worker.drafter,
        OracleDrafter(steps, references, noise=0.35, seed=spec.oracle_seed, vocab=spec.vocab),
    )
    reqs = [
        Req(
            f"r{i}",
            p,
            SamplingParams(temperature=0, max_new_tokens=spec.max_new_tokens, ignore_eos=True),
        )
        for i, p in enumerate(prompts)
    ]
    for req in reqs:
        engine.scheduler.add_request(req)
    while engine.scheduler.has_work():
        engine.scheduler.step()
        for req in engine.scheduler.running:
            committed = req.num_cached
            got = ROLLBACK_ROWS[family](engine, req.req_pool_idx, committed)
            want = fresh_prefill_rows(reference, family, req.all_ids[:committed])
            for key in want:
                torch.testing.assert_close(
                    got[key],
                    want[key],
                    atol=2e-5,
                    rtol=0,
                    msg=lambda m, k=key, c=committed: f"{k} after {c} tokens: {m}",
                )
    assert sum(1 for r in reqs for m, c in enumerate(r.spec_accept_hist) if 0 < m < steps and c) > 0
    for req in reqs:
        assert req.all_ids == references[tuple(req.prompt_ids)][: len(req.all_ids)]
