# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V4 target logits against transformers' DeepseekV4ForCausalLM (fp32).

Tolerance: `tests/models/parity.py` (fp32 on both sides, reduction order only).
"""

from __future__ import annotations

import pytest
import torch

from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.execution.model_input import ModelInput
from tests.models.parity import (
    ATOL,
    all_rows,
    assert_prefill_matches_transformers,
    assert_ragged_extend_matches,
    hf_logits,
    make_runner,
    random_ids,
)
from tests.runners import assert_decode_matches


@pytest.mark.parametrize("fixture", ["tiny_v4", "tiny_v4_hc2"])
@pytest.mark.parametrize("page_size", [1, 6])
def test_prefill_logits_match_transformers(request, fixture, page_size):
    path, hf = request.getfixturevalue(fixture)
    assert_prefill_matches_transformers(path, hf, random_ids(70, seed=1), page_size)


@pytest.mark.parametrize("page_size", [1, 4])
def test_token_by_token_decode_matches_full_sequence(tiny_v4, page_size):
    """56 steps: 7x the window (8), 3.5x the HCA rate (16), 14 CSA blocks with top-3 selection."""
    path, hf = tiny_v4
    runner, table = make_runner(path, page_size)
    ids = random_ids(56, seed=2)
    ref = hf_logits(hf, ids)
    assert_decode_matches(runner, table, ids, ref, ATOL)


def test_chunked_prefill_equals_one_shot(tiny_v4):
    path, hf = tiny_v4
    runner, table = make_runner(path, page_size=3)
    ids = random_ids(61, seed=3)
    ref = hf_logits(hf, ids)
    req = table.open_request()
    table.reserve(req, len(ids))
    start = 0
    for chunk in (5, 11, 1, 17, 27):  # chunk edges inside and across compress blocks
        out = runner.forward(
            ModelInput(
                ForwardMode.EXTEND,
                ids[start : start + chunk],
                [req],
                [start],
                [chunk],
                logits_row_indices=all_rows(chunk),
            )
        )
        torch.testing.assert_close(
            out.next_token_logits, ref[start : start + chunk], atol=ATOL, rtol=0
        )
        start += chunk


@pytest.mark.parametrize("page_size", [1, 5])
def test_ragged_batch_matches_each_request_alone(tiny_v4_hc2, page_size):
    """One forward holding a mid-prefill chunk, a decode row, a fresh prompt and a long extend."""
    path, hf = tiny_v4_hc2
    runner, table = make_runner(path, page_size)
    lengths, cached, extend = [50, 37, 23, 61], [20, 36, 0, 30], [15, 1, 23, 31]
    seqs = [random_ids(n, seed=10 + i) for i, n in enumerate(lengths)]
    reqs = [table.open_request() for _ in lengths]
    for req, seq, done in zip(reqs, seqs, cached):
        table.reserve(req, len(seq))
        if done:
            runner.forward(ModelInput(ForwardMode.EXTEND, seq[:done], [req], [0], [done]))
    assert_ragged_extend_matches(runner, hf, seqs, reqs, cached, extend)


@pytest.mark.parametrize("page_size", [1, 5])
def test_batch_of_fresh_prompts_matches_each_request_alone(tiny_v4, page_size):
    """First prefill chunks only (every key is one of the forward's own rows): prompts
    shorter than a tile's key window (the window is cut to the longest prompt), short
    tiles padded, and one prompt past the window."""
    path, hf = tiny_v4
    runner, table = make_runner(path, page_size)
    seqs = [random_ids(n, seed=20 + n) for n in (3, 12, 37, 20)]
    reqs = [table.open_request() for _ in seqs]
    for req, seq in zip(reqs, seqs):
        table.reserve(req, len(seq))
    lens = [len(s) for s in seqs]
    out = runner.forward(
        ModelInput(
            ForwardMode.EXTEND,
            torch.cat(seqs),
            reqs,
            [0] * len(seqs),
            lens,
            logits_row_indices=all_rows(sum(lens)),
        )
    )
    rows = out.next_token_logits.split(lens)
    for seq, logits in zip(seqs, rows):
        torch.testing.assert_close(logits, hf_logits(hf, seq), atol=ATOL, rtol=0)


def test_hidden_capture_is_the_pre_head_streams(tiny_v4):
    """FULL capture returns [T, hc*H] streams; hc_head + norm + head of them gives the logits."""
    path, hf = tiny_v4
    runner, table = make_runner(path)
    ids = random_ids(20, seed=4)
    req = table.open_request()
    table.reserve(req, len(ids))
    out = runner.forward(
        ModelInput(
            ForwardMode.EXTEND,
            ids,
            [req],
            [0],
            [len(ids)],
            capture_hidden_mode=CaptureHiddenMode.FULL,
        )
    )
    config = hf.config
    assert out.hidden_states.shape == (len(ids), config.hc_mult * config.hidden_size)
    streams = out.hidden_states.view(len(ids), config.hc_mult, config.hidden_size).unsqueeze(0)
    with torch.no_grad():
        logits = hf.lm_head(hf.model.norm(hf.model.hc_head(streams)))[0]
    torch.testing.assert_close(out.next_token_logits[0], logits[-1], atol=ATOL, rtol=0)


def test_loads_transformers_save_pretrained_naming(tiny_v4, tmp_path):
    path, hf = tiny_v4
    hf.save_pretrained(tmp_path)
    assert_prefill_matches_transformers(tmp_path, hf, random_ids(30, seed=5))


def test_loads_raw_state_dict_module_names(tiny_v4, tmp_path):
    """A checkpoint written straight from `state_dict()` (transformers module names)."""
    from safetensors.torch import save_file

    path, hf = tiny_v4
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(
        {k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors")
    )
    assert_prefill_matches_transformers(tmp_path, hf, random_ids(25, seed=6))


def test_indexer_ties_break_the_same_way_in_any_batch(tmp_path):
    """With 2 indexer heads, relu often zeroes whole scores and top-k meets exact ties; the
    selection must not depend on what else is in the batch (else speculative verify, whose
    batch differs from plain decode, would not be lossless)."""
    from tests.tiny_checkpoints import build_tiny_v4_checkpoint

    path, _ = build_tiny_v4_checkpoint(tmp_path / "ties", seed=11, index_n_heads=2)
    runner, table = make_runner(path, page_size=4)
    seqs = [random_ids(n, seed=20 + n) for n in (31, 45, 9, 38)]
    alone = []
    for seq in seqs:
        req = table.open_request()
        table.reserve(req, len(seq))
        alone.append(
            runner.forward(
                ModelInput(
                    ForwardMode.EXTEND,
                    seq,
                    [req],
                    [0],
                    [len(seq)],
                    logits_row_indices=all_rows(len(seq)),
                )
            ).next_token_logits
        )
        table.release(req)
    reqs = [table.open_request() for _ in seqs]
    for req, seq in zip(reqs, seqs):
        table.reserve(req, len(seq))
    out = runner.forward(
        ModelInput(
            ForwardMode.EXTEND,
            torch.cat(seqs),
            reqs,
            [0] * 4,
            [len(s) for s in seqs],
            logits_row_indices=all_rows(sum(len(s) for s in seqs)),
        )
    )
    torch.testing.assert_close(out.next_token_logits, torch.cat(alone), atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def all_tied_v4(tmp_path_factory):
    """A tiny V4 whose indexer queries are zero: every index score is exactly 0, so each CSA
    selection among more than `index_topk` (3) entries is decided by tie-breaking alone."""
    from tests.tiny_checkpoints import (
        make_hf_v4_model,
        released_state_dict,
        save_released_checkpoint,
        tiny_v4_config,
    )

    config = tiny_v4_config(index_n_heads=2)
    hf = make_hf_v4_model(config, seed=5)
    for layer in hf.model.layers:
        compressor = getattr(layer.self_attn, "compressor", None)
        if compressor is not None and hasattr(compressor, "indexer"):
            compressor.indexer.q_b_proj.weight.data.zero_()
    state = released_state_dict(hf.state_dict(), config["moe_intermediate_size"])
    return save_released_checkpoint(tmp_path_factory.mktemp("tied"), config, state), hf


def test_all_tied_indexer_prefill_matches_transformers(all_tied_v4):
    path, hf = all_tied_v4
    assert_prefill_matches_transformers(path, hf, random_ids(45, seed=8), page_size=4)


def test_all_tied_indexer_greedy_follows_transformers_generate(all_tied_v4):
    from runtime import Engine

    path, hf = all_tied_v4
    engine = Engine(model_path=str(path), dtype="float32", page_size=4)
    prompts = [random_ids(n, seed=30 + n).tolist() for n in (21, 37, 14)]
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    results = engine.generate(input_ids=prompts, sampling_params=greedy)
    for ids, result in zip(prompts, results):
        prompt = torch.tensor([ids])
        with torch.no_grad():
            out = hf.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=24,
                do_sample=False,
                pad_token_id=0,
            )
        assert result["output_ids"] == out[0, len(ids) :].tolist()


# other shapes of the architecture ----------------------------------------------------------

OTHER_CONFIGS = {
    # CSA at ratio 2 (not 4) and HCA at 8: the layer's kind, not its ratio, decides the
    # overlapping compressor windows and the indexer
    "csa2_hca8": dict(
        sliding_window=6,
        index_topk=4,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
    ),
    # HCA at a lower ratio than CSA, two shared experts (transformers builds one of the
    # routed width), top-1 routing, wider heads in more output groups, no hash layer
    "csa8_hca4": dict(
        num_hidden_layers=3,
        layer_types=[
            "compressed_sparse_attention",
            "sliding_attention",
            "heavily_compressed_attention",
        ],
        compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 4},
        num_attention_heads=8,
        o_groups=4,
        head_dim=32,
        qk_rope_head_dim=16,
        num_experts_per_tok=1,
        n_shared_experts=2,
        num_hash_layers=0,
        scoring_func="sigmoid",
    ),
    # one residual stream, every MLP hashed
    "hc1_all_hash": dict(hc_mult=1, num_hash_layers=4, sliding_window=5),
}


@pytest.fixture(scope="module", params=sorted(OTHER_CONFIGS))
def other_v4(request, tmp_path_factory):
    from tests.tiny_checkpoints import build_tiny_v4_checkpoint

    overrides = OTHER_CONFIGS[request.param]
    return build_tiny_v4_checkpoint(tmp_path_factory.mktemp(request.param), seed=2, **overrides)


def test_other_configs_prefill_and_decode_match_transformers(other_v4):
    """Whole-prompt prefill in pages of 3, then each row decoded one by one in a fresh
    request: every row's logits equal transformers' on the full sequence."""
    path, hf = other_v4
    ids = random_ids(60, seed=3)
    assert_prefill_matches_transformers(path, hf, ids, page_size=3)
    runner, table = make_runner(path, page_size=3)
    ref = hf_logits(hf, ids)
    assert_decode_matches(runner, table, ids, ref, ATOL)


def test_equal_csa_and_hca_ratios_are_refused_by_name(tmp_path):
    from tests.tiny_checkpoints import build_tiny_v4_checkpoint

    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 4}
    path, _ = build_tiny_v4_checkpoint(tmp_path, compress_rates=rates)
    with pytest.raises(ValueError, match="compress_rates"):
        make_runner(path)
