# SPDX-License-Identifier: Apache-2.0
"""Replica layouts, their flags, and what each rank loads (no processes: each rank's shard
is built and filled here from the same checkpoint, as that rank would)."""

from __future__ import annotations

import pytest
import torch

from runtime.configs.engine_config import EngineConfig
from runtime.configs.model_config import ModelConfig
from runtime.configs.parallel import ParallelLayout
from runtime.distributed import Mapping
from runtime.engine.ranks import weight_bytes
from runtime.engine.worker_factory import draft_class
from runtime.model_loader.build import load_model
from runtime.models.registry import resolve_model_class
from tests.tiny_checkpoints import build_tiny_qwen4_exp_mtp_checkpoint, build_tiny_v4_mtp_checkpoint

LAYOUTS = [(2, 1), (1, 2), (2, 2)]


def test_layout_groups():
    tp2 = ParallelLayout(2, 1)
    assert (tp2.world_size, tp2.moe_tp_size) == (2, 2)
    assert tp2.tp_groups() == [[0, 1]] and tp2.moe_tp_groups() == [[0, 1]]
    assert tp2.ep_groups() == [[0], [1]]
    ep2 = ParallelLayout(1, 2)
    assert ep2.tp_groups() == [[0], [1]] and ep2.ep_groups() == [[0, 1]]
    mixed = ParallelLayout(4, 2)
    assert mixed.moe_tp_size == 2
    assert mixed.ep_groups() == [[0, 2], [1, 3]] and mixed.moe_tp_groups() == [[0, 1], [2, 3]]
    # every rank holds a distinct (expert block, width slice) pair
    pairs = {(mixed.ep_rank(r), mixed.moe_tp_rank(r)) for r in range(4)}
    assert len(pairs) == 4
    with pytest.raises(ValueError, match="smaller must divide"):
        ParallelLayout(3, 2)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"tp_size": 2, "nnodes": 2}, "--dist-init-addr"),
        ({"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "--node-rank"),
        ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "does not split"),
        ({"tp_size": 2, "dist_init_addr": "nohost"}, "HOST:PORT"),
        ({"tp_size": 2, "ep_size": 3}, "smaller must divide"),
    ],
)
def test_bad_parallel_flags_are_refused_before_loading(tiny_v4, flags, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model_path=str(tiny_v4[0]), **flags).resolve()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    v4 = build_tiny_v4_mtp_checkpoint(tmp_path_factory.mktemp("v4_shards"), seed=3)[0]
    qwen = build_tiny_qwen4_exp_mtp_checkpoint(tmp_path_factory.mktemp("qwen_shards"), seed=3)[0]
    return {"deepseek_v4": v4, "qwen4_exp": qwen}


def load_rank(path, mapping):
    config = ModelConfig.from_path(path, "float32")
    target_cls = resolve_model_class(config.architectures)
    target = load_model(config, target_cls, mapping, progress=False)
    draft = load_model(config, draft_class(target_cls, config), mapping, progress=False)
    draft.set_embed_and_head(*target.get_embed_and_head())
    return target, draft


def split_bytes(single, ranks):
    """Bytes of the parameters a rank holds a share of (shape differs from the single-rank
    model's) and of those it holds whole, per rank."""
    full = dict(single.named_parameters())
    out = []
    for model in ranks:
        sharded = replicated = 0
        for name, param in model.named_parameters():
            size = param.numel() * param.element_size()
            if param.shape == full[name].shape:
                replicated += size
            else:
                sharded += size
        out.append((sharded, replicated))
    return out


@pytest.mark.parametrize("family", ["deepseek_v4", "qwen4_exp"])
@pytest.mark.parametrize("tp, ep", LAYOUTS)
def test_each_rank_holds_half_of_the_sharded_weights(checkpoints, family, tp, ep):
    path = checkpoints[family]
    single = load_rank(path, None)
    layout = ParallelLayout(tp, ep)
    ranks = [load_rank(path, Mapping.for_layout(layout, r)) for r in range(layout.world_size)]
    for part in (0, 1):  # target, draft
        whole = dict(single[part].named_parameters())
        per_rank = split_bytes(single[part], [r[part] for r in ranks])
        sharded_names = {
            n for n, p in ranks[0][part].named_parameters() if p.shape != whole[n].shape
        }
        full_sharded = sum(whole[n].numel() * whole[n].element_size() for n in sharded_names)
        assert full_sharded > 0
        for sharded, _ in per_rank:
            # an even split, up to the vocabulary's padding row
            assert sharded == pytest.approx(full_sharded / 2, rel=0.02)
        assert len({replicated for _, replicated in per_rank}) == 1
        # what is replicated is identical on every rank and equal to the single-rank value
        for name, param in ranks[1][part].named_parameters():
            if name not in sharded_names:
                torch.testing.assert_close(param, whole[name], rtol=0, atol=0)
    total = weight_bytes(single)
    for rank_models in ranks:
        assert weight_bytes(rank_models) < total


def test_rank_caches_are_sized_from_the_rank_share(checkpoints):
    """Qwen4Exp: KV heads and Gated DeltaNet heads (conv channels, recurrent states) split;
    DeepSeek-V4: the single latent is replicated, so the cache is the same on every rank."""
    from runtime.cache.pool_geometry import PoolGeometry

    geometry = PoolGeometry(4, 16, 4, 4, torch.float32, "cpu", 64)
    for family, halves in (("qwen4_exp", True), ("deepseek_v4", False)):
        single = load_rank(checkpoints[family], None)[0]
        one = single.create_cache_pool(single.config, geometry)
        mapping = Mapping.for_layout(ParallelLayout(2, 1), 1)
        rank = load_rank(checkpoints[family], mapping)[0]
        pool = rank.create_cache_pool(rank.config, geometry)
        if not halves:
            assert pool.nbytes() == one.nbytes()
            continue
        for attr in ("k_cache", "v_cache", "conv_state", "ssm_state", "ssm_snapshots"):
            for layer, buf in getattr(one, attr).items():
                mine = getattr(pool, attr)[layer]
                assert mine.numel() * 2 == buf.numel(), (attr, layer)
        assert pool.nbytes() < one.nbytes()
