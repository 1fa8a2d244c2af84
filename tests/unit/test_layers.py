# SPDX-License-Identifier: Apache-2.0
"""Layers against transformers' DeepSeek-V4 modules or a direct re-statement of the math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

from runtime.distributed import ParallelGroup
from runtime.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from runtime.kernels.sink_attention import (
    TileKeys,
    sink_attention,
    tiled_sink_attention,
    tiled_sink_attention_bmm,
    tiled_sink_attention_flash,
    to_tiles,
)
from runtime.layers import embedding as embedding_mod
from runtime.layers import linear as linear_mod
from runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.hyper_connection import hc_head, hc_post, hc_pre
from runtime.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from runtime.layers.moe import (
    ExpertCheckpointSchema,
    FusedMoEExperts,
    MoECheckpointLoader,
    select_experts,
)
from runtime.layers.moe import experts as experts_mod
from runtime.layers.norm import RMSNorm, WeightlessRMSNorm
from runtime.layers.rotary import RotaryEmbedding, rope_inv_freq
from runtime.layers.weight_utils import WeightShapeError


def v4_config(**kw):
    base = dict(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        qk_rope_head_dim=8,
        hc_mult=4,
        rope_scaling={
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    base.update(kw)
    return DeepseekV4Config(**base)


# rotary ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["main", "compress"])
def test_interleaved_tail_rope_matches_transformers(kind):
    config = v4_config()
    hf_rope = hf_v4.DeepseekV4RotaryEmbedding(config)
    ours = RotaryEmbedding(
        config.qk_rope_head_dim, config.rope_parameters[kind], interleaved=True, rotate_tail=True
    )
    positions = torch.tensor([0, 1, 5, 63, 64, 1000, 70000])
    x = torch.randn(len(positions), 4, 16)
    cos, sin = hf_rope(x, positions.unsqueeze(0), layer_type=kind)
    expected = hf_v4.apply_rotary_pos_emb(x.unsqueeze(0).transpose(1, 2), cos, sin).transpose(1, 2)[
        0
    ]
    c, s = ours.cos_sin(positions)
    got = ours.apply(x, c, s)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.apply(got, c, s, inverse=True), x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,rotary_dim", [((9, 4, 16), 8), ((9, 16), 8), ((9, 3, 8), 8)])
@pytest.mark.parametrize("tail", [True, False])
def test_eager_pair_rotation_equals_the_compiled_form(monkeypatch, dtype, shape, rotary_dim, tail):
    """Eagerly the interleaved pairs rotate in place in a copy (a complex product in fp32);
    a captured step keeps the functional form. Both agree, forward and inverse, for a
    non-contiguous input too: bit for bit in bf16, to an ulp in fp32 (the complex kernel
    may fuse a product into its sum)."""
    rope = RotaryEmbedding(
        rotary_dim,
        {"rope_type": "default", "rope_theta": 100.0},
        interleaved=True,
        rotate_tail=tail,
    )
    cos, sin = rope.cos_sin(torch.tensor([0, 1, 2, 7, 30, 31, 64, 500, 4096]))
    x = torch.randn(shape[-1], *shape[:-1]).movedim(0, -1).to(dtype)  # last dim strided
    assert not x.is_contiguous()
    eager = [rope.apply(x, cos, sin), rope.apply(x, cos, sin, inverse=True)]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    functional = [rope.apply(x, cos, sin), rope.apply(x, cos, sin, inverse=True)]
    for got, expected in zip(eager, functional):
        assert got.dtype == expected.dtype == dtype
        if dtype == torch.bfloat16:
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=2.5e-7, atol=1e-7)


def test_yarn_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = v4_config()
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config, None, layer_type="compress")
    ours, our_factor = rope_inv_freq(config.rope_parameters["compress"], config.qk_rope_head_dim)
    torch.testing.assert_close(ours, expected)
    assert our_factor == factor == 1.0
    ramped = rope_inv_freq(
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        64,
    )[1]
    assert ramped == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)


def test_neox_partial_rope_rotates_leading_half_pairs():
    rope = RotaryEmbedding(4, {"rope_type": "default", "rope_theta": 100.0})
    x = torch.randn(3, 2, 6)
    positions = torch.tensor([0, 2, 7])
    got = rope.apply(x, *rope.cos_sin(positions))
    inv = 1.0 / (100.0 ** (torch.arange(0, 4, 2).float() / 4))
    angle = positions[:, None, None].float() * inv  # [3, 1, 2]
    x1, x2 = x[..., :2], x[..., 2:4]
    expected = torch.cat(
        [x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin(), x[..., 4:]], -1
    )
    torch.testing.assert_close(got, expected)


# norms and mHC -----------------------------------------------------------------------------


def test_rms_norms_match_transformers():
    x = torch.randn(5, 32)
    hf = hf_v4.DeepseekV4RMSNorm(32, eps=1e-6)
    hf.weight.data = torch.randn(32)
    ours = RMSNorm(32, 1e-6)
    ours.weight.data.copy_(hf.weight.data)
    torch.testing.assert_close(ours(x), hf(x))
    torch.testing.assert_close(
        WeightlessRMSNorm(1e-6)(x), hf_v4.DeepseekV4UnweightedRMSNorm(1e-6)(x)
    )


@pytest.mark.parametrize("kernels", [False, True])
def test_hyper_connections_match_transformers(monkeypatch, kernels):
    """Eagerly (no grad, as the engine runs) through torch, and through the C++ kernels
    (Sinkhorn, the expansion), each path made sure of by counting the kernel's calls."""
    from runtime.configs.capture import default_cache_dir
    from runtime.kernels import cpu_extension
    from runtime.layers import hyper_connection

    if kernels and not cpu_extension.load(default_cache_dir()):
        pytest.skip("the C++ CPU kernels cannot be built here")
    monkeypatch.setitem(cpu_extension._state, "available", kernels)
    calls = []
    expand = hyper_connection.expand_streams
    monkeypatch.setattr(
        hyper_connection, "expand_streams", lambda *args: calls.append(1) or expand(*args)
    )
    config = v4_config()
    hc = hf_v4.DeepseekV4HyperConnection(config)
    for p in hc.parameters():
        p.data = torch.randn(p.shape) * 0.3
    x = torch.randn(1, 6, 4, 32)
    post, comb, collapsed = hc(x)
    with torch.no_grad():
        y, our_post, our_comb = hc_pre(
            x[0],
            hc.fn,
            hc.scale,
            hc.base,
            config.rms_norm_eps,
            config.hc_eps,
            config.hc_sinkhorn_iters,
        )
    torch.testing.assert_close(y, collapsed[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(our_post, post[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(our_comb, comb[0], atol=1e-5, rtol=1e-5)
    # columns and rows of comb sum to ~1 (doubly stochastic)
    torch.testing.assert_close(our_comb.sum(-1), torch.ones(6, 4), atol=1e-3, rtol=0)
    block_out = torch.randn(6, 32)
    expected = post[0].unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb[0].transpose(-1, -2), x[0]
    )
    with torch.no_grad():
        ours = hc_post(block_out, x[0], our_post, our_comb)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert len(calls) == (1 if kernels else 0)

    head = hf_v4.DeepseekV4HyperHead(config)
    for p in head.parameters():
        p.data = torch.randn(p.shape) * 0.3
    torch.testing.assert_close(
        hc_head(x[0], head.hc_fn, head.hc_scale, head.hc_base, config.rms_norm_eps, config.hc_eps),
        head(x)[0],
        atol=1e-5,
        rtol=1e-5,
    )


# MoE ---------------------------------------------------------------------------------------


def test_correction_bias_steers_selection_but_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    weights, ids = select_experts(
        logits, 2, "sqrtsoftplus", correction_bias=bias, routed_scaling_factor=1.5
    )
    assert sorted(ids[0].tolist()) == [0, 3]
    scores = F.softplus(logits).sqrt()[0]
    chosen = scores[ids[0]]
    torch.testing.assert_close(weights[0], chosen / chosen.sum() * 1.5)


def test_hash_routing_and_scoring_functions():
    logits = torch.randn(3, 6)
    table = torch.tensor([[5, 1], [0, 2], [3, 4]])
    weights, ids = select_experts(logits, 2, "sigmoid", hash_expert_ids=table, renormalize=False)
    assert torch.equal(ids, table)
    torch.testing.assert_close(weights, logits.sigmoid().gather(1, table))
    weights, ids = select_experts(logits, 3, "softmax")
    torch.testing.assert_close(weights.sum(-1), torch.ones(3))
    assert torch.equal(ids.sort(-1).values, logits.topk(3).indices.sort(-1).values)
    with pytest.raises(ValueError, match="supported: sqrtsoftplus, sigmoid, softmax"):
        select_experts(logits, 2, "relu")


def dense_moe(x, w13, w2, weights, ids, limit):
    """Per token, per selected expert: the plain statement of a routed MoE."""
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            gate, up = (w13[e] @ x[t]).split(inter)
            act = F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
            out[t] += weights[t, k] * (w2[e] @ act)
    return out


@pytest.mark.parametrize("hidden,inter", [(32, 16), (6, 5)])  # aligned (grouped_mm) and not
def test_fused_experts_match_dense_restatement(hidden, inter):
    experts = FusedMoEExperts(8, hidden, inter, swiglu_limit=0.5)
    experts.w13_weight.data = torch.randn(8, 2 * inter, hidden)
    experts.w2_weight.data = torch.randn(8, hidden, inter)
    x = torch.randn(11, hidden)
    weights, ids = select_experts(torch.randn(11, 8), 3, "sqrtsoftplus")
    expected = dense_moe(x, experts.w13_weight, experts.w2_weight, weights, ids, 0.5)
    torch.testing.assert_close(experts(x, weights, ids), expected, atol=1e-4, rtol=1e-4)


def test_expert_parallel_ranks_sum_to_the_whole(monkeypatch):
    monkeypatch.setattr(experts_mod, "all_reduce", lambda x, group: x)
    w13, w2 = torch.randn(8, 32, 16), torch.randn(8, 16, 16)
    x = torch.randn(7, 16)
    weights, ids = select_experts(torch.randn(7, 8), 2, "sigmoid")
    full = dense_moe(x, w13, w2, weights, ids, 1e9)
    total = torch.zeros_like(x)
    for rank in range(2):
        part = FusedMoEExperts(8, 16, 16, ep=ParallelGroup(rank, 2))
        part.weight_loader(part.w13_weight, w13)
        part.weight_loader(part.w2_weight, w2)
        total += part(x, weights, ids)
    torch.testing.assert_close(total, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tokens", [5, 30])  # gathered pairs; sorted (>= SORTED_MIN_PAIRS)
@pytest.mark.parametrize("ep,tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_fixed_shape_experts_under_expert_and_tensor_parallel(monkeypatch, ep, tp, tokens):
    """The forms captured steps take (no data-dependent shapes: per-pair gathered weights
    for few pairs, pairs sorted by expert with another rank's pairs weighing zero for many)
    on every (expert block, width slice) shard: each rank's piece goes through the layer's
    one reduction over `combine` (or none when the caller fuses it), and the pieces sum to
    the dense re-statement, as the eager form's do."""
    assert (tokens * 3 >= experts_mod.SORTED_MIN_PAIRS) == (tokens == 30)
    reduced = []

    def all_reduce(x, group):
        reduced.append(group)
        return x

    monkeypatch.setattr(experts_mod, "all_reduce", all_reduce)
    monkeypatch.setattr(experts_mod, "in_capture", lambda: True)
    w13, w2 = torch.randn(8, 2 * 12, 16), torch.randn(8, 16, 12)
    x = torch.randn(tokens, 16)
    weights, ids = select_experts(torch.randn(tokens, 8), 3, "sqrtsoftplus")
    full = dense_moe(x, w13, w2, weights, ids, 0.7)
    total = torch.zeros_like(x)
    for rank in range(ep * tp):
        combine = ParallelGroup(rank, ep * tp)
        part = FusedMoEExperts(
            8,
            16,
            12,
            ep=ParallelGroup(rank // tp, ep),
            swiglu_limit=0.7,
            tp=ParallelGroup(rank % tp, tp),
            combine=combine,
            reduce_results=rank % 2 == 0,
        )
        part.weight_loader(part.w13_weight, w13)
        part.weight_loader(part.w2_weight, w2)
        before = len(reduced)
        total += part(x, weights, ids)
        assert reduced[before:] == ([combine] if rank % 2 == 0 else [])
    torch.testing.assert_close(total, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tokens", [8, 40])  # gathered, sorted
def test_compiled_experts_are_one_graph_equal_to_eager(tokens):
    """A captured step compiles the routed experts into one graph (the grouped GEMM is one
    opaque operator), and its result equals the eager sorted form's."""
    torch._dynamo.reset()
    experts = FusedMoEExperts(8, 32, 16, swiglu_limit=0.7)
    experts.w13_weight.data = torch.randn(8, 32, 32)
    experts.w2_weight.data = torch.randn(8, 32, 16)
    x = torch.randn(tokens, 32)
    weights, ids = select_experts(torch.randn(tokens, 8), 2, "sqrtsoftplus")
    explained = torch._dynamo.explain(experts)(x, weights, ids)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    compiled = torch.compile(experts, dynamic=False, fullgraph=True)
    torch.testing.assert_close(compiled(x, weights, ids), experts(x, weights, ids))


def test_moe_checkpoint_loader_maps_per_expert_names():
    loader = MoECheckpointLoader(
        ExpertCheckpointSchema("w1", "w2", "w3"), num_experts=8, ep_rank=1, ep_size=2
    )
    target = loader.map("model.layers.3.ffn.experts.5.w3.weight")
    assert (target.param, target.shard_id, target.expert_id, target.local) == (
        "model.layers.3.ffn.experts.w13_weight",
        "w3",
        5,
        True,
    )
    assert loader.map("model.layers.3.ffn.experts.2.w2.weight").local is False
    assert loader.map("model.layers.3.ffn.shared_experts.w2.weight") is None
    experts = FusedMoEExperts(8, 4, 3, ep=ParallelGroup(1, 2))
    w1, w3 = torch.randn(3, 4), torch.randn(3, 4)
    experts.weight_loader(experts.w13_weight, w1, "w1", 5)
    experts.weight_loader(experts.w13_weight, w3, "w3", 5)
    assert torch.equal(experts.w13_weight[1], torch.cat([w1, w3]))


def test_grouped_gemm_matches_reference_with_empty_groups():
    x, w = torch.randn(10, 16), torch.randn(4, 8, 16)
    ends = torch.tensor([3, 3, 9, 10], dtype=torch.int32)
    torch.testing.assert_close(grouped_gemm(x, w, ends), grouped_gemm_reference(x, w, ends))
    expected = torch.cat([x[:3] @ w[0].T, x[3:9] @ w[2].T, x[9:] @ w[3].T])
    torch.testing.assert_close(grouped_gemm(x, w, ends), expected)


# attention kernel --------------------------------------------------------------------------


def test_sink_attention_matches_explicit_softmax():
    q, kv = torch.randn(3, 2, 4), torch.randn(3, 5, 4)
    valid = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    sink = torch.tensor([0.5, -1.0])
    out = sink_attention(q, kv, valid, sink, scale=0.5)
    for t in range(3):
        for h in range(2):
            keys = kv[t][valid[t]]
            z = (keys @ q[t, h]) * 0.5
            p = z.exp() / (z.exp().sum() + sink[h].exp())
            torch.testing.assert_close(out[t, h], p @ keys)


@pytest.mark.parametrize("kernel", [tiled_sink_attention_bmm, tiled_sink_attention_flash])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_rows", [False, True])
def test_tiled_sink_attention_equals_per_row_keys(kernel, dtype, with_rows):
    """Tiles of 3 rows over a ragged layout (a short tile pads with row T): every row's
    result equals plain sink attention over its tile's keys followed by its own keys, with
    both implementations (the CPU flash kernel merging the sink and the own keys through
    its log-sum-exp, and the batched products). Row 1 sees none of its tile's keys; row 4
    sees no key at all (its output is the sink's alone: zero)."""
    gen = torch.Generator().manual_seed(0)
    num_rows, heads, dim, tile_width, own = 7, 2, 8, 5, 3
    tile_rows = torch.tensor([[0, 1, 2], [3, 4, 7], [5, 6, 7]])  # rows 3-4 and 5-6 end short
    row_slot = torch.tensor([0, 1, 2, 3, 4, 6, 7])
    q = torch.randn(num_rows, heads, dim, generator=gen).to(dtype)
    tile_kv = torch.randn(3, tile_width, dim, generator=gen).to(dtype)
    tile_valid = torch.rand(3, 3, tile_width, generator=gen) > 0.3
    row_kv = torch.randn(num_rows, own, dim, generator=gen).to(dtype) if with_rows else None
    row_valid = torch.rand(num_rows, own, generator=gen) > 0.3 if with_rows else None
    tile_valid[0, 1] = False  # row 1
    tile_valid[1, 1] = False  # row 4
    if with_rows:
        row_valid[1] = True
        row_valid[4] = False
    sink = torch.randn(heads, generator=gen)
    tiled = TileKeys(tile_rows, row_slot, tile_kv, tile_valid, row_kv, row_valid)
    out = kernel(q, tiled, sink, 0.3)
    tile_of, lane_of = row_slot // 3, row_slot % 3
    keys, valid = tile_kv[tile_of], tile_valid[tile_of, lane_of]
    if with_rows:
        keys, valid = torch.cat([keys, row_kv], 1), torch.cat([valid, row_valid], 1)
    expected = sink_attention(q, keys, valid, sink, scale=0.3)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    assert not out[4].any()
    dispatched = tiled_sink_attention(q, tiled, sink, 0.3)
    torch.testing.assert_close(dispatched.float(), expected.float(), **tol)
    tile_q = to_tiles(q.float(), tile_rows).view(3, -1, dim)  # one product per tile
    scores = torch.bmm(tile_q, tile_kv.float().transpose(1, 2)).view(9, heads, -1)[row_slot]
    torch.testing.assert_close(
        scores, torch.bmm(q.float(), tile_kv[tile_of].float().transpose(1, 2))
    )


# tensor-parallel weight loaders ------------------------------------------------------------


def test_tensor_parallel_linears_shard_and_recombine(monkeypatch):
    monkeypatch.setattr(linear_mod, "all_reduce", lambda x, group: x)
    x = torch.randn(5, 8)
    w, gate, up = torch.randn(6, 8), torch.randn(4, 8), torch.randn(4, 8)
    row_w = torch.randn(3, 8)
    cols, merged, rows = [], [], torch.zeros(5, 3)
    for rank in range(2):
        tp = ParallelGroup(rank, 2)
        col = ColumnParallelLinear(8, 6, tp=tp)
        col.weight_loader(col.weight, w)
        cols.append(col(x))
        m = MergedColumnParallelLinear(8, [4, 4], tp=tp)
        m.weight_loader(m.weight, gate, 0)
        m.weight_loader(m.weight, up, 1)
        merged.append(m(x).split(2, dim=-1))
        row = RowParallelLinear(8, 3, tp=tp)
        row.weight_loader(row.weight, row_w)
        rows += row(x[:, rank * 4 : (rank + 1) * 4])
    torch.testing.assert_close(torch.cat(cols, -1), x @ w.T)
    torch.testing.assert_close(torch.cat([merged[0][0], merged[1][0]], -1), x @ gate.T)
    torch.testing.assert_close(torch.cat([merged[0][1], merged[1][1]], -1), x @ up.T)
    torch.testing.assert_close(rows, x @ row_w.T, atol=1e-5, rtol=1e-5)
    # the shapes named are the checkpoint tensor's, not this rank's slice of it
    with pytest.raises(WeightShapeError, match=r"expected \(4, 8\), got \(6, 8\)"):
        m.weight_loader(m.weight, torch.randn(6, 8), 0)


def test_vocab_parallel_embedding_and_head(monkeypatch):
    monkeypatch.setattr(embedding_mod, "all_reduce", lambda x, group: x)
    monkeypatch.setattr(embedding_mod, "all_gather_last_dim", lambda x, group: x)
    table = torch.randn(11, 4)
    ids = torch.tensor([0, 5, 6, 10])
    total, logits = torch.zeros(4, 4), []
    for rank in range(2):
        emb = VocabParallelEmbedding(11, 4, ParallelGroup(rank, 2))
        emb.weight_loader(emb.weight, table)
        total += emb(ids)
        head = ParallelLMHead(11, 4, ParallelGroup(rank, 2))
        head.weight_loader(head.weight, table)
        logits.append(F.linear(ids.float().unsqueeze(1).expand(-1, 4), head.weight))
    torch.testing.assert_close(total, table[ids])
    full = torch.cat(logits, -1)[:, :11]
    torch.testing.assert_close(full, F.linear(ids.float().unsqueeze(1).expand(-1, 4), table))


@pytest.mark.parametrize("rows", [1, 5, 300, 2048])
def test_sinkhorn_fast_path_is_bit_identical(monkeypatch, rows):
    """The torch fast paths (the C++ kernel, when loaded, is tested on its own)."""
    from runtime.kernels import cpu_extension
    from runtime.kernels.sinkhorn import sinkhorn, sinkhorn_reference

    monkeypatch.setitem(cpu_extension._state, "available", False)

    logits = torch.randn(rows, 4, 4)
    with torch.no_grad():
        fast = sinkhorn(logits, 20, 1e-6)
    assert torch.equal(fast, sinkhorn_reference(logits, 20, 1e-6))
    torch.testing.assert_close(fast.sum(-2), torch.ones(rows, 4), atol=1e-5, rtol=0)


def test_ngram_table_loads_whole_or_from_its_released_shards():
    """The PLE n-gram table arrives whole (transformers names) or as `split_ngram_parts`
    row shards (released names); a missing shard is reported by its id."""
    from types import SimpleNamespace

    from runtime.layers.ple import NGramEmbedding
    from runtime.layers.weight_utils import WeightLoadTracker

    config = SimpleNamespace(
        ngram_size=3,
        heads_per_ngram=2,
        eos_token_id=1,
        ngram_vocab_size_base=50,
        make_ngram_vocab_size_divisible_by=8,
        vocab_size=64,
        seed=1234,
        split_ngram_parts=2,
    )
    table = NGramEmbedding(config, embed_dim=16, ple_index=0)
    whole = torch.randn(table.weight.shape)
    shards = whole.chunk(2)
    tracker = WeightLoadTracker({"weight": table.weight})
    tracker.load("shard_0", "weight", shards[0], 0)
    assert tracker.missing() == {"weight": [(1,)]}
    tracker.load("shard_1", "weight", shards[1], 1)
    assert tracker.missing() == {} and torch.equal(table.weight, whole)
    tracker = WeightLoadTracker({"weight": table.weight})
    tracker.load("whole", "weight", whole)
    assert tracker.missing() == {}


def test_single_stream_sinkhorn_compiles_to_the_reference_constant():
    """`hc_mult = 1`: compiling the 40 passes of `c / (c + eps)` over one-element sums
    would inline into an expression that doubles with every pass; the captured form is the
    host-computed constant, equal to the reference bit for bit."""
    from runtime.kernels.sinkhorn import sinkhorn, sinkhorn_reference

    logits = torch.randn(3, 1, 1)
    compiled = torch.compile(lambda x: sinkhorn(x, 20, 1e-6), backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(logits), sinkhorn_reference(logits, 20, 1e-6))
        assert torch.equal(sinkhorn(logits, 20, 1e-6), sinkhorn_reference(logits, 20, 1e-6))
