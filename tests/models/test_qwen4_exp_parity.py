# SPDX-License-Identifier: Apache-2.0
"""Qwen4Exp target logits against transformers' Qwen4ExpForCausalLM (fp32).

Sequences run past `indexer_budget + ratio - 1 = 19` visible tokens so the QSA selection is
really used (dense attention differs by ~0.1 there), with PLE on and off and the output
gate given explicitly. Tolerance as for DeepSeek-V4: fp32 on both sides, differing only in
reduction order and in the chunked vs recurrent delta-rule schedule (`tests/models/parity.py`).
"""

from __future__ import annotations

import pytest
import torch

from runtime.cache import PagedTokenAllocator, ReqToTokenPool, SlotTable
from runtime.configs.model_config import ModelConfig
from runtime.core.forward_mode import ForwardMode
from runtime.execution.model_input import ModelInput
from tests.models.parity import (
    ATOL,
    assert_prefill_matches_transformers,
    assert_ragged_extend_matches,
    hf_logits,
    make_runner,
)
from tests.runners import assert_decode_matches, load_runner
from tests.tiny_checkpoints import (
    build_tiny_qwen4_exp_checkpoint,
    make_hf_qwen4_exp_model,
    save_released_checkpoint,
    tiny_qwen4_exp_config,
)

VOCAB = 128


def token_ids(n, seed, eos_every=0):
    ids = torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))
    if eos_every:
        ids[eos_every::eos_every] = 1  # EOS resets the PLE n-gram context
    return ids


@pytest.fixture(scope="module", params=["ple", "no_ple"])
def qwen(request, tmp_path_factory):
    overrides = {} if request.param == "ple" else {"ple_layer_ids": []}
    return build_tiny_qwen4_exp_checkpoint(
        tmp_path_factory.mktemp(f"qwen_{request.param}"), seed=3, **overrides
    )


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefill_matches_transformers(qwen, page_size):
    path, hf = qwen
    assert_prefill_matches_transformers(path, hf, token_ids(45, seed=1, eos_every=13), page_size)


def test_decode_step_by_step_matches_full_sequence(qwen):
    path, hf = qwen
    runner, table = make_runner(path, page_size=3)
    ids = token_ids(40, seed=2, eos_every=17)
    ref = hf_logits(hf, ids)
    assert_decode_matches(runner, table, ids, ref, ATOL)


def test_ragged_batch_and_chunked_prefill(qwen):
    path, hf = qwen
    runner, table = make_runner(path, page_size=4)
    lengths, cached, extend = [41, 30, 22, 50], [17, 29, 0, 9], [24, 1, 22, 30]
    seqs = [token_ids(n, seed=10 + i, eos_every=11 if i == 3 else 0) for i, n in enumerate(lengths)]
    reqs = [table.open_request() for _ in lengths]
    for req, seq, done in zip(reqs, seqs, cached):
        table.reserve(req, len(seq))
        start = 0
        for chunk in (5, 7, 100):  # earlier chunks of various sizes
            n = min(chunk, done - start)
            if n > 0:
                runner.forward(
                    ModelInput(ForwardMode.EXTEND, seq[start : start + n], [req], [start], [n])
                )
                start += n
    assert_ragged_extend_matches(runner, hf, seqs, reqs, cached, extend)


def test_silu_output_gate(tmp_path):
    path, hf = build_tiny_qwen4_exp_checkpoint(tmp_path / "silu", seed=4, output_gate_type="silu")
    assert_prefill_matches_transformers(path, hf, token_ids(25, seed=5))


@pytest.fixture(scope="module")
def tied_qwen(tmp_path_factory):
    """An indexer whose queries are zero scores every block exactly 0, so the whole selection
    is decided by how top-k breaks ties (relu makes such ties common in trained models)."""
    config = tiny_qwen4_exp_config()
    hf = make_hf_qwen4_exp_model(config, seed=6)
    query_rows = config["indexer_n_heads"] * config["indexer_head_dim"]
    with torch.no_grad():
        for layer in hf.model.layers:
            indexer = getattr(getattr(layer, "self_attn", None), "indexer", None)
            if indexer is not None:
                indexer.index_qk_proj.weight[:query_rows] = 0
    state = {k: v.clone().contiguous() for k, v in hf.state_dict().items()}
    return save_released_checkpoint(tmp_path_factory.mktemp("ties"), config, state), hf


def test_qsa_ties_break_as_transformers_does(tied_qwen):
    path, hf = tied_qwen
    assert_prefill_matches_transformers(path, hf, token_ids(45, seed=7))


def test_qsa_ties_in_uniform_verify_rows_break_as_transformers_does(tied_qwen):
    """The fixed-shape path of decode, verify and draft steps (rows `[bs, q]`, keys laid out
    by position and padded past the longest request): three requests of different lengths,
    four verify rows each, every row's selection decided by ties alone."""
    path, hf = tied_qwen
    config = ModelConfig.from_path(path, "float32")
    table = SlotTable(ReqToTokenPool(4, 128), PagedTokenAllocator(96, 4))
    runner = load_runner(config, table, max_tokens_per_pass=4)
    seqs = [token_ids(n, seed=20 + n) for n in (27, 44, 61)]
    reqs = [table.open_request() for _ in seqs]
    for req, seq in zip(reqs, seqs):
        table.reserve(req, len(seq))
        runner.forward(ModelInput(ForwardMode.EXTEND, seq[:-4], [req], [0], [len(seq) - 4]))
    out = runner.forward(
        ModelInput(
            ForwardMode.TARGET_VERIFY,
            torch.cat([s[-4:] for s in seqs]),
            reqs,
            [len(s) - 4 for s in seqs],
            [4] * len(seqs),
            logits_row_indices=None,
        )
    )
    want = torch.cat([hf_logits(hf, s)[-4:] for s in seqs])
    torch.testing.assert_close(out.next_token_logits, want, atol=ATOL, rtol=0)
