# SPDX-License-Identifier: Apache-2.0
"""NEXTN speculative decoding is lossless: greedy output equals plain greedy decoding, for
both families (DeepSeek-V4 and Qwen4Exp, over a `family` fixture), with a partly right
oracle drafter and with the real MTP draft; acceptance, metrics and settings behave.
(test_nextn_exactness.py: the sampled distribution and the caches after every round.)"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from runtime import Engine
from runtime.core.request import Req
from runtime.core.sampling_params import SamplingParams
from runtime.speculative.drafter import MTPDrafter
from tests.engine.conftest import FAMILIES
from tests.tiny_checkpoints import (
    build_tiny_qwen4_exp_checkpoint,
    build_tiny_qwen4_exp_mtp_checkpoint,
    build_tiny_v4_mtp_checkpoint,
)

GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}


def make_prompts(count, seed, low=3, high=40, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(low, high, (count,), generator=g)
    ]


def prompts_with_eos(count, seed, vocab):
    """`make_prompts`, with an EOS (id 1) inside every third prompt: Qwen4Exp's PLE n-gram
    context restarts there."""
    out = make_prompts(count, seed, vocab=vocab)
    for p in out[::3]:
        p[len(p) // 2] = 1
    return out


@dataclass(frozen=True)
class NextnFamily:
    """What differs between the families in the lossless-greedy tests."""

    build: Callable  # (path, seed) -> (path, transformers target, transformers MTP holder)
    seed: int
    vocab: int
    prompts: Callable[[int, int], list[list[int]]]  # (count, seed) -> prompts
    greedy_steps: tuple[int, ...]
    # the greedy test's oracle also runs the real draft first (its caches written as usual)
    oracle_after_mtp: bool
    real_draft_engine: dict  # engine arguments of the real-draft test


NEXTN_FAMILIES = {
    "deepseek_v4": NextnFamily(
        build=build_tiny_v4_mtp_checkpoint,
        seed=7,
        vocab=97,
        prompts=make_prompts,
        greedy_steps=(1, 2, 3, 4),
        oracle_after_mtp=False,
        real_draft_engine={"page_size": 1},
    ),
    "qwen4_exp": NextnFamily(
        build=build_tiny_qwen4_exp_mtp_checkpoint,
        seed=9,
        vocab=128,
        prompts=lambda count, seed: prompts_with_eos(count, seed, vocab=128),
        greedy_steps=(1, 2, 3),
        oracle_after_mtp=True,
        real_draft_engine={"chunked_prefill_size": 16},
    ),
}


@pytest.fixture(scope="module")
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    """family -> its tiny MTP checkpoint and plain greedy references, each made on first
    use and shared by every test of this module."""
    made: dict = {}

    def checkpoint(family: str):
        if ("ckpt", family) not in made:
            spec = NEXTN_FAMILIES[family]
            path = tmp_path_factory.mktemp(f"nextn_{family}")
            made["ckpt", family] = spec.build(path, seed=spec.seed)[0]
        return made["ckpt", family]

    def reference(family: str):
        if ("reference", family) not in made:
            made["reference", family] = plain_reference_of(
                checkpoint(family), NEXTN_FAMILIES[family].prompts(21, 1)
            )
        return made["reference", family]

    return checkpoint, reference


@pytest.fixture(scope="module")
def mtp_ckpt(family_checkpoints):
    """The DeepSeek-V4 checkpoint of the tests that run on one family."""
    return family_checkpoints[0]("deepseek_v4")


class OracleDrafter:
    """Proposes the plain greedy continuation (optionally corrupted with probability
    `noise`, which makes acceptance partial and exercises rollback)."""

    def __init__(self, steps, references: dict[tuple, list[int]], noise=0.0, seed=0, vocab=97):
        self.steps, self.references, self.noise, self.vocab = steps, references, noise, vocab
        self.rng = random.Random(seed)

    def committed(self, req, prefix, next_tokens, gather_row):
        return req.all_ids[: prefix + 1] + next_tokens[: gather_row + 1]

    def draft(self, batch):
        out = []
        for b, start in enumerate(batch.row_starts()):
            if not batch.propose[b]:
                out.append(None)
                continue
            req, n = batch.reqs[b], batch.extend_lens[b]
            rows = batch.next_tokens[start : start + n].tolist()
            seq = self.committed(req, batch.prefix_lens[b], rows, batch.gather_rows[b])
            reference = self.references[tuple(req.prompt_ids)]
            proposal = (reference[len(seq) :] + [0] * self.steps)[: self.steps]
            out.append(
                [
                    self.rng.randrange(self.vocab) if self.rng.random() < self.noise else t
                    for t in proposal
                ]
            )
        return out


class GarbageDrafter(OracleDrafter):
    def draft(self, batch):
        return [[self.rng.randrange(self.vocab) for _ in range(self.steps)] for _ in batch.reqs]


class MTPThenOracle:
    """Runs the real MTP draft (so its caches are written as usual) but proposes the
    oracle's partly-right tokens, so that rounds accept some drafts and reject others."""

    def __init__(self, mtp, oracle):
        self.mtp, self.oracle, self.runner = mtp, oracle, mtp.runner

    def draft(self, batch):
        self.mtp.draft(batch)
        return self.oracle.draft(batch)


def nextn_engine(path, steps=3, page_size=4, **kw):
    return Engine(
        model_path=str(path),
        dtype="float32",
        page_size=page_size,
        max_running_requests=16,
        speculative_algorithm="NEXTN",
        speculative_num_steps=steps,
        **kw,
    )


def plain_reference_of(path, prompts):
    """Plain greedy outputs (2 extra rounds long, for the oracle) of `prompts`."""
    engine = Engine(model_path=str(path), dtype="float32", page_size=4, max_running_requests=32)
    long = {**GREEDY, "max_new_tokens": GREEDY["max_new_tokens"] + 10}
    outputs = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=long)]
    return prompts, {tuple(p): p + o for p, o in zip(prompts, outputs)}


@pytest.fixture(scope="module")
def plain_reference(family_checkpoints):
    """The DeepSeek-V4 references of the tests that run on one family."""
    return family_checkpoints[1]("deepseek_v4")


def run_batches(engine, prompts, sizes=(1, 4, 16)):
    outputs, start = [], 0
    for size in sizes:
        batch = prompts[start : start + size]
        outputs += engine.generate(input_ids=batch, sampling_params=GREEDY)
        start += size
    return outputs


@pytest.mark.parametrize(
    "family, steps",
    [(f, steps) for f in FAMILIES for steps in NEXTN_FAMILIES[f].greedy_steps],
    indirect=["family"],
)
@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_nextn_equals_plain_greedy(family, family_checkpoints, steps, page_size):
    """21 prompts (3-39 tokens) + 48 new tokens: for DeepSeek-V4 past the window (8) and
    several compress boundaries (4, 16), for Qwen4Exp past the QSA budget, with EOS inside
    some prompts; in batches of 1, 4 and 16, with a partially right drafter (Qwen4Exp's
    runs the real draft first, so the recurrent draft caches roll back too)."""
    spec = NEXTN_FAMILIES[family]
    path = family_checkpoints[0](family)
    prompts, references = family_checkpoints[1](family)
    engine = nextn_engine(path, steps, page_size)
    oracle = OracleDrafter(steps, references, noise=0.3, seed=steps, vocab=spec.vocab)
    if spec.oracle_after_mtp:
        oracle = MTPThenOracle(engine.worker.drafter, oracle)
    engine.worker.drafter = oracle
    start_free = engine.slot_table.allocator.available_tokens()
    outputs = run_batches(engine, prompts)
    for prompt, out in zip(prompts, outputs):
        assert out["output_ids"] == references[tuple(prompt)][len(prompt) : len(prompt) + 48]
    assert engine.flush_cache()  # the prefix cache gives back every page it kept
    assert engine.slot_table.allocator.available_tokens() == start_free
    assert engine.slot_table.req_pool.available() == engine.slot_table.req_pool.max_reqs
    assert 1.3 < engine.avg_spec_accept_length < steps + 1


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_real_mtp_draft_is_lossless(family, family_checkpoints):
    prompts, references = family_checkpoints[1](family)
    engine = nextn_engine(
        family_checkpoints[0](family), steps=3, **NEXTN_FAMILIES[family].real_draft_engine
    )
    assert isinstance(engine.worker.drafter, MTPDrafter)
    outputs = run_batches(engine, prompts)
    for prompt, out in zip(prompts, outputs):
        assert out["output_ids"] == references[tuple(prompt)][len(prompt) : len(prompt) + 48]


def test_oracle_drafter_is_fully_accepted(mtp_ckpt, plain_reference):
    prompts, references = plain_reference
    engine = nextn_engine(mtp_ckpt, steps=3)
    engine.worker.drafter = OracleDrafter(3, references)
    out = engine.generate(input_ids=prompts[:4], sampling_params=GREEDY)
    for r in out:
        meta = r["meta_info"]
        hist = meta["spec_accept_histogram"]
        assert hist[:3] == [0, 0, 0] and hist[3] == meta["spec_verify_ct"]
        # 1 token from prefill, then 4 per round; the last round is cut at max_new_tokens
        assert meta["spec_verify_ct"] == 12 and meta["spec_accept_length"] == 4.0
    assert engine.worker.stats.acceptance_rate_per_position() == [1.0, 1.0, 1.0]


def test_garbage_drafter_is_rejected_without_changing_output(mtp_ckpt, plain_reference):
    prompts, references = plain_reference
    engine = nextn_engine(mtp_ckpt, steps=3)
    engine.worker.drafter = GarbageDrafter(3, references)
    out = engine.generate(input_ids=prompts[:4], sampling_params=GREEDY)
    for prompt, r in zip(prompts, out):
        assert r["output_ids"] == references[tuple(prompt)][len(prompt) : len(prompt) + 48]
    assert engine.avg_spec_accept_length < 1.1


def test_metrics_are_consistent(mtp_ckpt, plain_reference):
    prompts, references = plain_reference
    engine = nextn_engine(mtp_ckpt, steps=2)
    engine.worker.drafter = OracleDrafter(2, references, noise=0.4, seed=3)
    for r in engine.generate(
        input_ids=prompts[:6], sampling_params={**GREEDY, "max_new_tokens": 200}
    ):
        meta = r["meta_info"]
        hist = meta["spec_accept_histogram"]
        assert sum(hist) == meta["spec_verify_ct"]
        emitted = 1 + sum((m + 1) * count for m, count in enumerate(hist))
        assert emitted - 2 <= meta["completion_tokens"] <= emitted  # the last round may be cut
        # over the rounds alone: accepted drafts + 1 per round (the prefill's token is not one)
        assert meta["spec_accept_length"] == pytest.approx((emitted - 1) / meta["spec_verify_ct"])
        assert 1.0 <= meta["spec_accept_length"] <= 3.0 and meta["spec_plain_decode_tokens"] == 0


def test_bad_speculative_settings_fail_clearly(mtp_ckpt, tiny_v4, tmp_path):
    with pytest.raises(ValueError, match="topk 1"):
        nextn_engine(mtp_ckpt, speculative_eagle_topk=2)
    with pytest.raises(ValueError, match="unknown --speculative-algorithm 'MEDUSA'"):
        Engine(model_path=str(mtp_ckpt), speculative_algorithm="MEDUSA")
    # a checkpoint whose config promises an MTP layer but ships no mtp.* tensors
    with pytest.raises(ValueError, match=r"no MTP \(NextN\) weights.*drop --speculative-algorithm"):
        nextn_engine(tiny_v4[0])
    # a checkpoint without any MTP layer in its config
    import json
    import shutil

    shutil.copytree(tiny_v4[0], tmp_path / "c")
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (tmp_path / "c" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no MTP \\(NextN\\) draft layer"):
        nextn_engine(tmp_path / "c")


def test_qwen4_exp_missing_mtp_weights_fail_clearly(tmp_path):
    """(DeepSeek-V4's case is in `test_bad_speculative_settings_fail_clearly`.)"""
    path, _ = build_tiny_qwen4_exp_checkpoint(tmp_path / "no_mtp", seed=2)
    with pytest.raises(ValueError, match=r"no MTP weights.*drop --speculative-algorithm"):
        nextn_engine(path, 3)


def test_draft_token_count_mismatch_is_corrected(mtp_ckpt, caplog):
    engine = nextn_engine(mtp_ckpt, steps=2, speculative_num_draft_tokens=7)
    assert engine.spec_config.num_draft_tokens == 3
    assert "using 3 (steps + 1)" in caplog.text


def test_draft_extend_runs_only_the_window_of_a_long_prompt(mtp_ckpt, monkeypatch):
    """The tiny draft is window-only: its extend over a prompt keeps the last `window` rows
    per request, and proposes exactly what a draft extend over every row proposes."""

    def run(skip_rows: bool):
        engine = Engine(model_path=mtp_ckpt, dtype="float32", speculative_algorithm="NEXTN")
        drafter = engine.worker.drafter
        window = drafter.runner.model.kv_reach
        if not skip_rows:
            monkeypatch.setattr(drafter, "_rows_to_skip", lambda batch: [0] * batch.batch_size)
        extend_rows, proposals = [], []
        forward, draft = drafter.runner.forward, drafter.draft

        def recording_forward(inp):
            if inp.forward_mode.name == "DRAFT_EXTEND":
                extend_rows.append(list(inp.extend_lens))
            return forward(inp)

        def recording_draft(*args, **kwargs):
            out = draft(*args, **kwargs)
            proposals.append(out)
            return out

        monkeypatch.setattr(drafter.runner, "forward", recording_forward)
        monkeypatch.setattr(drafter, "draft", recording_draft)
        prompts = make_prompts(3, seed=11, low=3 * window, high=4 * window)
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 12})
        return window, extend_rows, proposals, [o["output_ids"] for o in outs]

    window, trimmed_rows, trimmed, trimmed_out = run(skip_rows=True)
    _, full_rows, full, full_out = run(skip_rows=False)
    assert max(full_rows[0]) > 3 * window - 1 >= window == max(trimmed_rows[0])
    assert trimmed == full and trimmed_out == full_out


def test_drafts_travel_back_through_the_worker_output(mtp_ckpt, monkeypatch):
    """The worker reports each round's drafts and acceptance in its `TokenOutput`s and
    leaves the request alone; the scheduler stores them for the next round."""
    engine = nextn_engine(mtp_ckpt, steps=3)
    req = Req("r", [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_new_tokens=9))
    seen = []
    step = engine.worker.step

    def recording_step(prefill, decode):
        before = req.draft_tokens, req.spec_verify_ct
        outputs = step(prefill, decode)
        assert (req.draft_tokens, req.spec_verify_ct) == before  # the worker wrote nothing
        seen.append([o for side in outputs for o in side])
        return outputs

    monkeypatch.setattr(engine.worker, "step", recording_step)
    engine.scheduler.add_request(req)
    engine.scheduler.step()  # prefill: first token and the first drafts
    [prefill] = seen[-1]
    assert prefill.num_accepted_drafts is None and len(prefill.draft_tokens) == 3
    assert req.draft_tokens == prefill.draft_tokens
    engine.scheduler.step()  # one verify round
    [round_out] = seen[-1]
    assert len(round_out.tokens) == round_out.num_accepted_drafts + 1
    assert req.draft_tokens == round_out.draft_tokens and req.spec_verify_ct == 1
    assert req.spec_accept_hist[round_out.num_accepted_drafts] == 1 == sum(req.spec_accept_hist)
