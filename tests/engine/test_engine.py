# SPDX-License-Identifier: Apache-2.0
"""The offline Engine end to end: greedy output equals transformers' `generate`, batching
and retraction do not change it, finish reasons and bad input behave."""

from __future__ import annotations

import pytest
import torch

from runtime import Engine
from runtime.core.errors import InvalidRequestError

GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


def prompts(count=4, seed=0, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(3, 30, (count,), generator=g)
    ]


def hf_greedy(hf_model, ids, max_new_tokens):
    out = hf_model.generate(
        torch.tensor([ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def engine(tiny_v4):
    return Engine(model_path=str(tiny_v4[0]), dtype="float32", page_size=4)


def test_greedy_batch_equals_transformers_generate(engine, tiny_v4):
    batch = prompts()
    results = engine.generate(input_ids=batch, sampling_params=GREEDY)
    for ids, result in zip(batch, results):
        assert result["output_ids"] == hf_greedy(tiny_v4[1], ids, 40)
        meta = result["meta_info"]
        assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 40
        assert meta["finish_reason"] == {"type": "length", "length": 40}


def test_retraction_under_a_small_cache_keeps_greedy_output(engine, tiny_v4):
    batch = prompts(6, seed=1)
    expected = [r["output_ids"] for r in engine.generate(input_ids=batch, sampling_params=GREEDY)]
    small = Engine(model_path=str(tiny_v4[0]), dtype="float32", page_size=2, max_total_tokens=160)
    start = small.slot_table.allocator.available_tokens()
    got = small.generate(input_ids=batch, sampling_params=GREEDY)
    assert [r["output_ids"] for r in got] == expected
    assert small.flush_cache()  # the prefix cache gives back every page it kept
    assert small.slot_table.allocator.available_tokens() == start
    assert small.slot_table.req_pool.available() == small.slot_table.req_pool.max_reqs


def test_finish_reasons(engine):
    ids = prompts(1, seed=2)[0]
    free = engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    stop = free[5]
    first = free.index(stop)
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "stop_token_ids": [stop]})
    assert out["output_ids"] == free[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    late = engine.generate(
        input_ids=ids,
        sampling_params={**GREEDY, "stop_token_ids": [stop], "min_new_tokens": first + 2},
    )
    assert len(late["output_ids"]) > first + 1
    assert (
        engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 0})[
            "output_ids"
        ]
        == []
    )


def test_eos_stops_unless_ignored(tiny_v4):
    ids = prompts(1, seed=3)[0]
    engine = Engine(model_path=str(tiny_v4[0]), dtype="float32")
    free = engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    engine.eos_ids.clear()
    engine.eos_ids.add(free[3])
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "ignore_eos": False})
    assert out["output_ids"] == free[: free.index(free[3]) + 1]
    assert engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] == free


def test_seeded_sampling_is_reproducible(engine):
    params = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 42, "ignore_eos": True}
    batch = prompts(3, seed=4)
    first = [r["output_ids"] for r in engine.generate(input_ids=batch, sampling_params=params)]
    again = [
        r["output_ids"] for r in engine.generate(input_ids=batch[::-1], sampling_params=params)
    ][::-1]
    assert first == again
    other = engine.generate(input_ids=batch[0], sampling_params={**params, "sampling_seed": 7})
    assert other["output_ids"] != first[0]


def test_bad_input_is_rejected_clearly(engine):
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        engine.generate(input_ids=[], sampling_params=GREEDY)
    with pytest.raises(InvalidRequestError, match=r"token ids in \[0, 97\)"):
        engine.generate(input_ids=[5, 97], sampling_params=GREEDY)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.generate("hello", GREEDY)
    with pytest.raises(InvalidRequestError, match="context length is 1024"):
        engine.generate(input_ids=[3] * 1024, sampling_params=GREEDY)
    with pytest.raises(InvalidRequestError, match="temperature"):
        engine.generate(input_ids=[3], sampling_params={"temperature": -0.5})


def test_missing_model_path_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine(model_path="/no/such/dir")
