# SPDX-License-Identifier: Apache-2.0
"""Random tiny configurations of both families, served the ways a user can serve them.

The other engine tests fix one configuration per family. Here each seed draws another
(layer kinds and counts, heads, windows and compression ratios, experts and top-k,
hyper-connection streams, PLE layers, n-grams, vocabulary sizes), a page size, capture
buckets and a draft length, and a staggered batch of prompts. Eager plain decoding,
captured plain decoding and captured NEXTN (fused rounds, measured speculation policy,
rounds step by step with speculation off in larger batches) must all give transformers'
greedy tokens. Dynamo's eager backend stands in for inductor (guards, static shapes and
padding behave the same; the numerics of inductor's kernels are the captured-step tests'
business), which keeps a seed to seconds. `slow`: several minutes in all.
"""

from __future__ import annotations

import random

import pytest
import torch

from runtime import Engine
from runtime.configs.capture import DISABLE_ENV
from tests.engine.test_captured_steps import staggered_generate
from tests.engine.test_engine import hf_greedy
from tests.tiny_checkpoints import (
    build_tiny_qwen4_exp_mtp_checkpoint,
    build_tiny_v4_mtp_checkpoint,
)

pytestmark = pytest.mark.slow


def v4_overrides(r: random.Random) -> dict:
    layers = r.randint(1, 5)
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    heads = r.choice([2, 4, 8])
    experts = r.choice([4, 8, 16])
    return dict(
        vocab_size=r.choice([61, 97, 130]),
        hidden_size=r.choice([32, 48, 64]),
        moe_intermediate_size=r.choice([8, 16, 24]),
        num_hidden_layers=layers,
        layer_types=[r.choice(kinds) for _ in range(layers)],
        num_attention_heads=heads,
        head_dim=r.choice([16, 32]),
        qk_rope_head_dim=r.choice([4, 8]),
        q_lora_rank=r.choice([16, 24]),
        o_groups=r.choice([g for g in (1, 2, 4) if heads % g == 0]),
        o_lora_rank=r.choice([8, 12]),
        sliding_window=r.choice([4, 8, 12, 16, 32]),
        # the runtime tells the two compressed kinds apart by their ratio
        compress_rates={
            "compressed_sparse_attention": r.choice([2, 4, 8]),
            "heavily_compressed_attention": r.choice([16, 32]),
        },
        num_hash_layers=r.randint(0, min(2, layers)),
        index_n_heads=r.choice([4, 16]),
        index_head_dim=r.choice([8, 16]),
        index_topk=r.choice([1, 2, 3, 5, 8]),
        n_routed_experts=experts,
        n_shared_experts=r.choice([1, 2]),
        num_experts_per_tok=r.choice([k for k in (1, 2, 3, 4) if k <= experts]),
        hc_mult=r.choice([1, 2, 4]),
    )


def qwen_overrides(r: random.Random) -> dict:
    """Within what transformers' config accepts: an attention layer (its `generate` needs
    one), at least two hyper-connection streams, PLE on linear-attention layers only,
    the rotary part no wider than the QSA index head."""
    layers = r.randint(1, 5)
    kinds = [r.choice(["linear_attention", "full_attention"]) for _ in range(layers)]
    if "full_attention" not in kinds:
        kinds[r.randrange(layers)] = "full_attention"
    linear = [i + 1 for i, kind in enumerate(kinds) if kind == "linear_attention"]
    heads = r.choice([2, 4, 8])
    key_heads = r.choice([1, 2])
    head_dim, rotary = r.choice([16, 32]), r.choice([0.25, 0.5, 1.0])
    ratio = r.choice([2, 4, 8])
    return dict(
        vocab_size=r.choice([100, 128, 200]),
        hidden_size=r.choice([32, 64]),
        num_hidden_layers=layers,
        layer_types=kinds,
        num_attention_heads=heads,
        num_key_value_heads=r.choice([k for k in (1, 2, 4) if heads % k == 0]),
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": rotary,
        },
        linear_num_key_heads=key_heads,
        linear_num_value_heads=r.choice([v for v in (2, 4) if v % key_heads == 0]),
        linear_key_head_dim=r.choice([8, 16]),
        linear_value_head_dim=r.choice([8, 16]),
        linear_conv_kernel_dim=r.choice([2, 3, 4]),
        num_experts=r.choice([4, 8]),
        num_experts_per_tok=r.choice([1, 2, 3]),
        moe_intermediate_size=r.choice([16, 32]),
        shared_expert_intermediate_size=r.choice([16, 32]),
        hc_count=r.choice([2, 4]),
        hc_lowrank=r.choice([4, 8]),
        indexer_n_heads=r.choice([4, 8]),
        indexer_head_dim=r.choice([d for d in (8, 16, 32) if d >= head_dim * rotary]),
        indexer_budget=ratio * r.choice([1, 2, 4]),
        indexer_compress_ratio=ratio,
        ple_layer_ids=sorted(r.sample(linear, r.randint(0, min(2, len(linear))))),
        ple_conv_kernel_size=r.choice([2, 4]),
        ngram_size=r.choice([2, 3]),
        heads_per_ngram=r.choice([4, 8]),
    )


FAMILIES = {
    "deepseek_v4": (v4_overrides, build_tiny_v4_mtp_checkpoint),
    "qwen4_exp": (qwen_overrides, build_tiny_qwen4_exp_mtp_checkpoint),
}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_random_configs_serve_transformers_greedy_tokens(
    family, seed, tmp_path, monkeypatch, eager_dynamo
):
    overrides, build = FAMILIES[family]
    r = random.Random(f"{family}-{seed}")
    config = overrides(r)
    path, hf, _ = build(tmp_path / "ckpt", seed=seed, **config)
    g = torch.Generator().manual_seed(seed)
    count = r.randint(1, 6)
    prompts = [
        torch.randint(
            2, config["vocab_size"], (r.choice([1, 3, 9, 17, 30, 47, 70]),), generator=g
        ).tolist()
        for _ in range(count)
    ]
    lengths = [r.randint(1, 40) for _ in range(count)]
    waits = [r.randint(0, 3) for _ in range(count)]
    expected = [hf_greedy(hf, ids, n) for ids, n in zip(prompts, lengths)]

    monkeypatch.delenv(DISABLE_ENV, raising=False)
    common = dict(model_path=str(path), dtype="float32", page_size=r.choice([1, 2, 4, 8, 16]))
    captured = dict(
        cuda_graph_bs=sorted(r.sample([1, 2, 3, 4, 8], r.randint(1, 3))),
        capture_compile="inline",
    )
    nextn = dict(speculative_algorithm="NEXTN", speculative_num_steps=r.randint(1, 4))
    variants = {
        "eager plain": dict(disable_cuda_graph=True),
        "captured plain": captured,
        "captured NEXTN, fused rounds": {
            **captured,
            **nextn,
            "speculative_disable_by_batch_size": "none",
        },
        "captured NEXTN, measured policy": {**captured, **nextn},
        "captured NEXTN, rounds step by step": {
            **captured,
            **nextn,
            "disable_fused_nextn_round": True,
            "speculative_disable_by_batch_size": 2,
        },
    }
    for name, settings in variants.items():
        engine = Engine(**common, **settings)
        outputs = staggered_generate(engine, prompts, lengths, waits)
        assert outputs == expected, (name, config, settings)
