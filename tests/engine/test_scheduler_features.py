# SPDX-License-Identifier: Apache-2.0
"""Scheduler and sampling features through the engine, each against plain decoding or a
direct statement: chunked prefill, stop strings inside speculative runs, penalties,
min_new_tokens, logprobs and aborts."""

from __future__ import annotations

import pytest
import torch

from runtime import Engine
from runtime.core.request import Req
from runtime.core.sampling_params import SamplingParams
from runtime.execution.penalties import RowHistory, adjust_logits
from tests.engine.test_nextn import OracleDrafter
from tests.tiny_checkpoints import build_tiny_v4_mtp_checkpoint, save_char_tokenizer

PROMPTS = ["def fib(n): return n", "hello world, hello", "x = [i for i in range(3)]", "abc"]
GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = build_tiny_v4_mtp_checkpoint(tmp_path_factory.mktemp("features"), seed=31)[0]
    save_char_tokenizer(path, 97)
    return path


def engine(path, **kw):
    return Engine(model_path=str(path), dtype="float32", page_size=4, **kw)


@pytest.fixture(scope="module")
def plain(ckpt):
    return engine(ckpt)


@pytest.fixture(scope="module")
def reference(plain):
    """Plain greedy continuations (long enough for an oracle drafter)."""
    long = {**GREEDY, "max_new_tokens": GREEDY["max_new_tokens"] + 12}
    outs = plain.generate(PROMPTS, long)
    return {
        tuple(plain.tokenize(p)): plain.tokenize(p) + o["output_ids"] for p, o in zip(PROMPTS, outs)
    }


def oracle_engine(path, reference, steps=3, **kw):
    e = engine(path, speculative_algorithm="NEXTN", speculative_num_steps=steps, **kw)
    e.worker.drafter = OracleDrafter(steps, reference)
    return e


@pytest.mark.parametrize("spec", [False, True])
def test_chunked_prefill_mixed_with_decode_keeps_output(ckpt, plain, reference, spec):
    expected = [o["output_ids"] for o in plain.generate(PROMPTS, GREEDY)]
    e = (
        oracle_engine(ckpt, reference, chunked_prefill_size=3)
        if spec
        else engine(ckpt, chunked_prefill_size=3)
    )
    # staggered arrivals: later prompts are prefilled in chunks while earlier ones decode
    reqs = [e.make_request(e.tokenize(p), GREEDY) for p in PROMPTS]
    steps = 0
    for req in reqs:
        e.add_request(req)
        for _ in range(3):
            e.step()
            steps += 1
    while e.has_work():
        e.step()
    assert [r.output_ids for r in reqs] == expected


def test_stop_strings_inside_accepted_runs(ckpt, plain, reference):
    """With full acceptance every round emits 4 tokens; a stop ending anywhere in a run
    must cut the text there and emit no token after the one completing it."""
    e = oracle_engine(ckpt, reference)
    for prompt in PROMPTS[:3]:
        free = plain.generate(prompt, GREEDY)
        text = free["text"]
        for start, length in ((5, 3), (10, 2), (13, 4)):
            stop = text[start : start + length]
            cut = text.index(stop)
            out = e.generate(prompt, {**GREEDY, "stop": stop})
            assert out["text"] == text[:cut]
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
            # tokens stop at the one that completed the stop string (1 char per token here)
            assert out["output_ids"] == free["output_ids"][: cut + length]
            trimmed = e.generate(prompt, {**GREEDY, "stop": stop, "no_stop_trim": True})
            assert trimmed["text"] == text[: cut + length]


def test_penalty_formulas():
    req = Req(
        "r",
        [5, 6],
        SamplingParams(
            frequency_penalty=0.5,
            presence_penalty=0.25,
            repetition_penalty=1.5,
            min_new_tokens=5,
            stop_token_ids=[2],
        ),
    )
    req.output_ids = [3, 3, 7]
    logits = torch.tensor([[1.0, -1.0, 0.5, 2.0, 0.3, 1.2, -0.6, 0.9]])
    out = adjust_logits(logits, [RowHistory(req, (7,))], eos_ids={1})[0]
    expected = logits[0].clone()
    counts = {3: 2, 7: 2}
    for token, count in counts.items():
        expected[token] -= 0.5 * count + 0.25
    for token in (3, 5, 6, 7):  # prompt and output tokens
        expected[token] = expected[token] / 1.5 if expected[token] > 0 else expected[token] * 1.5
    expected[1] = expected[2] = float(
        "-inf"
    )  # 4 tokens so far (3 + 1 tentative) < 5: EOS, stop ids banned
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(
    "params", [{"repetition_penalty": 1.3}, {"frequency_penalty": 0.8, "presence_penalty": 0.4}]
)
def test_penalties_are_lossless_under_nextn(ckpt, plain, reference, params):
    """Greedy with penalties: verify row j must see drafts d1..dj as history, else NEXTN
    output would drift from plain decoding."""
    p = {**GREEDY, **params}
    expected = [o["output_ids"] for o in plain.generate(PROMPTS, p)]
    assert expected != [o["output_ids"] for o in plain.generate(PROMPTS, GREEDY)]  # they matter
    e = engine(ckpt, speculative_algorithm="NEXTN", speculative_num_steps=3)
    penalised_reference = {
        tuple(plain.tokenize(q)): plain.tokenize(q) + o for q, o in zip(PROMPTS, expected)
    }
    e.worker.drafter = OracleDrafter(3, penalised_reference, noise=0.25)
    assert [o["output_ids"] for o in e.generate(PROMPTS, p)] == expected
    assert e.avg_spec_accept_length > 1.5


def test_min_new_tokens_bans_eos(ckpt):
    e = engine(ckpt)
    free = e.generate(PROMPTS[0], GREEDY)["output_ids"]
    e.eos_ids.clear()
    e.eos_ids.add(free[2])
    assert len(e.generate(PROMPTS[0], {**GREEDY, "ignore_eos": False})["output_ids"]) == 3
    out = e.generate(PROMPTS[0], {**GREEDY, "ignore_eos": False, "min_new_tokens": 10})[
        "output_ids"
    ]
    assert len(out) >= 10 and free[2] not in out[:9]


def test_logprobs_match_between_plain_and_nextn(ckpt, plain, reference):
    kw = dict(return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
    a = plain.generate(PROMPTS[0], GREEDY, **kw)["meta_info"]
    b = oracle_engine(ckpt, reference).generate(PROMPTS[0], GREEDY, **kw)["meta_info"]
    assert [t for _, t, _ in a["output_token_logprobs"]] == [
        t for _, t, _ in b["output_token_logprobs"]
    ]
    torch.testing.assert_close(
        torch.tensor([lp for lp, _, _ in a["output_token_logprobs"]]),
        torch.tensor([lp for lp, _, _ in b["output_token_logprobs"]]),
        atol=1e-4,
        rtol=0,
    )
    prompt_len = a["prompt_tokens"]
    assert len(a["input_token_logprobs"]) == prompt_len and a["input_token_logprobs"][0][0] is None
    torch.testing.assert_close(
        torch.tensor([lp for lp, _, _ in a["input_token_logprobs"][1:]]),
        torch.tensor([lp for lp, _, _ in b["input_token_logprobs"][1:]]),
        atol=1e-4,
        rtol=0,
    )
    # the logprob of the greedy token is the largest one
    for (lp, _, _), top in zip(a["output_token_logprobs"], a["output_top_logprobs"]):
        assert lp == pytest.approx(top[0][0], abs=1e-6)


def test_prompt_logprobs_equal_a_direct_forward(plain):
    ids = plain.tokenize(PROMPTS[1])
    out = plain.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        logprob_start_len=2,
    )
    entries = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in entries] == ids[2:]
    from runtime.core.forward_mode import ForwardMode
    from runtime.execution.model_input import ModelInput

    table = plain.slot_table
    req = table.open_request()
    table.reserve(req, len(ids))
    logits = plain.runner.forward(
        ModelInput(
            ForwardMode.EXTEND,
            torch.tensor(ids),
            [req],
            [0],
            [len(ids)],
            logits_row_indices=list(range(len(ids))),
        )
    ).next_token_logits
    table.release(req)
    direct = torch.log_softmax(logits, -1)[torch.arange(1, len(ids) - 1), torch.tensor(ids[2:])]
    torch.testing.assert_close(
        torch.tensor([lp for lp, _, _ in entries]), direct, atol=1e-5, rtol=0
    )


def test_abort_frees_waiting_and_running_requests(ckpt):
    e = engine(ckpt, max_running_requests=2)
    start = e.slot_table.allocator.available_tokens()
    reqs = [e.make_request(e.tokenize(p), GREEDY) for p in PROMPTS]
    for req in reqs:
        e.add_request(req)
    e.step()
    e.step()
    assert len(e.scheduler.running) == 2 and len(e.scheduler.waiting) == 2
    assert e.abort(reqs[0].rid).finish_reason.type == "abort"  # running
    assert e.abort(reqs[3].rid).finish_reason.type == "abort"  # waiting
    assert e.abort("no-such-request") is None
    while e.has_work():
        e.step()
    assert reqs[1].finish_reason.type == reqs[2].finish_reason.type == "length"
    assert e.flush_cache()  # the prefix cache gives back every page it kept
    assert e.slot_table.allocator.available_tokens() == start
    assert e.slot_table.req_pool.available() == 2


def test_nextn_steps_mix_prefill_chunks_with_verify_rounds(ckpt, plain, reference):
    """A prompt arriving while others decode is prefilled in the same steps as their verify
    rounds (decoding does not pause), and every output stays the plain greedy one."""
    expected = [o["output_ids"] for o in plain.generate(PROMPTS, GREEDY)]
    e = oracle_engine(ckpt, reference, chunked_prefill_size=3)
    mixed = []
    step = e.worker.step

    def counting_step(prefill, decode):
        mixed.append(bool(prefill) and bool(decode))
        return step(prefill, decode)

    e.worker.step = counting_step
    reqs = [e.make_request(e.tokenize(p), GREEDY) for p in PROMPTS]
    for req in reqs:
        e.add_request(req)
        for _ in range(3):
            e.step()
    while e.has_work():
        e.step()
    assert [r.output_ids for r in reqs] == expected
    assert sum(mixed) >= 3
