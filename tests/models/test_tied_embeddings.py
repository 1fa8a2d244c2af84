# SPDX-License-Identifier: Apache-2.0
"""Checkpoints with `tie_word_embeddings`, as transformers' `save_pretrained` writes them
(no `lm_head.weight`: the head is the embedding), load for every model family: logits,
greedy tokens plain and with NEXTN against transformers, and the MTP draft scores with
the tied head too."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from runtime import Engine
from tests.engine.test_engine import hf_greedy
from tests.models.test_deepseek_v4_parity import assert_prefill_matches_transformers
from tests.tiny_checkpoints import build_tied_checkpoint

VOCAB = {"deepseek_v4": 97, "qwen4_exp": 128}
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=sorted(VOCAB))
def tied(request, tmp_path_factory):
    family = request.param
    path, hf = build_tied_checkpoint(family, tmp_path_factory.mktemp(f"tied_{family}"), seed=4)
    return family, path, hf


def prompts(family: str, count: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(2, VOCAB[family], (n,), generator=g).tolist() for n in (5, 17, 30)][
        :count
    ]


def test_checkpoint_has_no_head_and_prefill_logits_match_transformers(tied):
    family, path, hf = tied
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # what makes the load need the tie
    ids = torch.tensor(prompts(family)[2])
    assert_prefill_matches_transformers(path, hf, ids, page_size=4)


@pytest.mark.parametrize("speculative", [None, "NEXTN"])
def test_greedy_tokens_equal_transformers(tied, speculative):
    family, path, hf = tied
    spec = {"speculative_algorithm": speculative, "speculative_num_steps": 2} if speculative else {}
    engine = Engine(model_path=str(path), dtype="float32", page_size=4, **spec)
    batch = prompts(family)
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    results = engine.generate(input_ids=batch, sampling_params=params)
    for ids, result in zip(batch, results):
        assert result["output_ids"] == hf_greedy(hf, ids, NEW_TOKENS)
    target = engine.runner.model
    embed = target.model.embed_tokens.weight
    assert target.lm_head.weight is embed
    if speculative:
        assert engine.worker.stats.verify_rounds > 0
        draft = engine.worker.drafter.runner.model
        assert draft.lm_head.weight is embed and draft.model.embed_tokens.weight is embed


def test_tied_checkpoint_that_also_holds_the_head_ignores_it(tied, tmp_path):
    """A tied checkpoint written with a (stale) `lm_head.weight` as well: transformers ties
    after loading, so the head is the embedding all the same."""
    from safetensors.torch import load_file, save_file

    family, path, hf = tied
    for item in path.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    state = load_file(str(path / "model.safetensors"))
    state["lm_head.weight"] = torch.zeros_like(state["model.embed_tokens.weight"])
    save_file(state, str(tmp_path / "model.safetensors"))
    assert_prefill_matches_transformers(tmp_path, hf, torch.tensor(prompts(family)[1]))
