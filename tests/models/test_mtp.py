# SPDX-License-Identifier: Apache-2.0
"""The paged MTP draft of each family against a dense oracle, per chained step; and each
family's checkpoint name remapping on its released key list.

The paged run is the same for both families (target extend capturing every row's hidden
streams, draft extend over the prompt, then chained single-token draft steps); the oracle
is the family's: DeepSeek-V4's a dense re-statement of its math (enorm/hnorm/e_proj/h_proj
and hc_head + norm by hand, the decoder block from transformers, causal sliding-window
mask), Qwen4Exp's composed from transformers' Qwen4Exp modules (`modeling_qwen4_exp.py`),
with the fed-back streams and the QSA selection reuse of chained steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from runtime.cache import PagedTokenAllocator, ReqToTokenPool, SlotTable
from runtime.configs.model_config import ModelConfig
from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.execution.model_input import ModelInput
from runtime.models.deepseek_v4_mtp import DeepseekV4ForCausalLMNextN, remap_mtp_name
from runtime.models.qwen4_exp_mtp import (
    Qwen4ExpMTP,
    map_mtp_checkpoint_name,
    remap_mtp_weight_name,
)
from tests.runners import load_runner
from tests.tiny_checkpoints import build_tiny_qwen4_exp_mtp_checkpoint, build_tiny_v4_mtp_checkpoint

ATOL = 1e-4


def rms(x, w, eps=1e-6):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def dense_v4_mtp(mtp_hf, tensors, embed, head, next_ids, prev_hidden):
    """The MTP forward over a whole sequence at once (positions 0..n-1), written out:
    enorm/hnorm/e_proj/h_proj and hc_head + norm by hand, the decoder block from
    transformers (its last layer is the MTP block), causal sliding-window mask."""
    cfg = mtp_hf.config
    n, hc, hidden = len(next_ids), cfg.hc_mult, cfg.hidden_size
    positions = torch.arange(n)
    e = embed[next_ids].clone()
    e[positions == 0] = 0
    e = rms(e, tensors["mtp.0.enorm.weight"])
    h = rms(prev_hidden.view(n, hc, hidden), tensors["mtp.0.hnorm.weight"])
    x = h @ tensors["mtp.0.h_proj.weight"].T + (e @ tensors["mtp.0.e_proj.weight"].T).unsqueeze(1)
    q, k = positions.view(-1, 1), positions.view(1, -1)
    mask = torch.where((k <= q) & (k > q - cfg.sliding_window), 0.0, float("-inf")).view(1, 1, n, n)
    rope = mtp_hf.model.rotary_emb
    pos = positions.unsqueeze(0)
    embeddings = {kind: rope(x, pos, layer_type=kind) for kind in ("main", "compress")}
    block = mtp_hf.model.layers[cfg.num_hidden_layers - 1]
    with torch.no_grad():
        out = block(
            x.unsqueeze(0),
            input_ids=next_ids.unsqueeze(0),
            position_embeddings=embeddings,
            position_ids=pos,
            attention_mask=mask,
        )[0]
    flat = out.flatten(1)
    mixes = F.linear(
        flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps),
        tensors["mtp.0.hc_head_fn"],
    )
    pre = (
        torch.sigmoid(mixes * tensors["mtp.0.hc_head_scale"] + tensors["mtp.0.hc_head_base"])
        + cfg.hc_eps
    )
    y = rms((pre.unsqueeze(-1) * out).sum(1), tensors["mtp.0.norm.weight"])
    return y @ head.T, flat


def offset_norm(x, w, eps=1e-6):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def dense_qwen_mtp(hf_plus, tensors, embed, head, next_ids, prev_streams, reuse_from=None):
    """The MTP over a whole sequence at once. `reuse_from=q0`: the last row keeps the QSA
    selection row q0 made (plus everything after q0's tail), as chained draft steps do."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedResidual

    cfg = hf_plus.config
    n, hidden, length = cfg.hc_count, cfg.hidden_size, len(next_ids)
    u = (
        offset_norm(embed[next_ids], tensors["mtp.pre_fc_norm_embedding.weight"])
        @ tensors["mtp.fc_embedding.weight"].T
    )
    s = offset_norm(prev_streams, tensors["mtp.pre_fc_norm_hidden.weight"]).view(length, n, hidden)
    streams = (s @ tensors["mtp.fc_hidden.weight"].T + u.unsqueeze(1)).flatten(1)
    positions = torch.arange(length)
    causal = torch.where(positions.view(1, -1) <= positions.view(-1, 1), 0.0, float("-inf")).view(
        1, 1, length, length
    )
    rope = hf_plus.model.rotary_emb(streams.unsqueeze(0), positions.view(1, 1, -1).expand(3, 1, -1))
    layer = hf_plus.model.layers[cfg.num_hidden_layers - 1]
    indexer = layer.self_attn.indexer
    original = indexer.forward
    if reuse_from is not None:

        def reuse(*args, **kwargs):
            mask = original(*args, **kwargs).clone()
            tail = (reuse_from + 1) // cfg.indexer_compress_ratio * cfg.indexer_compress_ratio
            mask[0, 0, -1] = mask[0, 0, reuse_from] | (positions >= tail)
            return mask

        indexer.forward = reuse
    try:
        with torch.no_grad():
            out = layer(streams.unsqueeze(0), position_embeddings=rope, attention_mask=causal)[0]
    finally:
        indexer.forward = original
    mixer = Qwen4ExpTextGatedResidual(cfg, use_combine=False)
    for name in ("hc_norm", "input_mix_weight_down", "input_mix_weight_up"):
        getattr(mixer, name).weight.data = tensors[f"mtp.hyper_connection_mixer.{name}.weight"]
    with torch.no_grad():
        return mixer(out) @ head.T, out


@dataclass(frozen=True)
class MTPFamily:
    """What differs between the families in the paged-vs-oracle test."""

    build: Callable  # (path, seed) -> (path, transformers target, transformers MTP holder)
    seed: int
    draft_cls: type
    embed_key: str
    head_key: str
    max_reqs: int
    max_tokens_per_pass: int
    token_ids: Callable[[int], torch.Tensor]  # prompt_len -> prompt_len + 1 token ids
    # (mtp_hf, tensors, embed, head, ids, streams, step, prompt_len) -> (logits, streams)
    oracle: Callable


MTP_FAMILIES = {
    "deepseek_v4": MTPFamily(
        build=build_tiny_v4_mtp_checkpoint,
        seed=5,
        draft_cls=DeepseekV4ForCausalLMNextN,
        embed_key="embed.weight",
        head_key="head.weight",
        max_reqs=4,
        max_tokens_per_pass=4,
        token_ids=lambda n: torch.randint(
            0, 97, (n + 1,), generator=torch.Generator().manual_seed(9)
        ),
        oracle=lambda hf, t, e, h, ids, s, step, n: dense_v4_mtp(hf, t, e, h, ids, s),
    ),
    "qwen4_exp": MTPFamily(
        build=build_tiny_qwen4_exp_mtp_checkpoint,
        seed=6,
        draft_cls=Qwen4ExpMTP,
        embed_key="model.embed_tokens.weight",
        head_key="lm_head.weight",
        max_reqs=2,
        max_tokens_per_pass=5,
        token_ids=lambda n: torch.randint(
            2, 128, (n + 1,), generator=torch.Generator().manual_seed(n)
        ),
        # chained steps keep the QSA selection the extend's last row made
        oracle=lambda hf, t, e, h, ids, s, step, n: dense_qwen_mtp(
            hf, t, e, h, ids, s, reuse_from=None if step == 0 else n - 1
        ),
    ),
}


@pytest.fixture(scope="module")
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def mtp_ckpt(family, tmp_path_factory):
    spec = MTP_FAMILIES[family]
    return spec.build(tmp_path_factory.mktemp(f"{family}_mtp"), seed=spec.seed)


# Qwen4Exp: dense attention at 11 tokens, then with the QSA selection active at 30
@pytest.mark.parametrize(
    "family, prompt_len",
    [("deepseek_v4", 37), ("qwen4_exp", 11), ("qwen4_exp", 30)],
    indirect=["family"],
)
def test_paged_mtp_matches_the_oracle_per_step(family, mtp_ckpt, prompt_len):
    spec = MTP_FAMILIES[family]
    path, target_hf, mtp_hf = mtp_ckpt
    tensors = load_file(str(path / "model.safetensors"))
    embed, head = tensors[spec.embed_key], tensors[spec.head_key]
    config = ModelConfig.from_path(path, "float32")
    table = SlotTable(ReqToTokenPool(spec.max_reqs, 256), PagedTokenAllocator(64, 4))
    width = spec.max_tokens_per_pass
    draft = load_runner(config, table, max_tokens_per_pass=width, model_cls=spec.draft_cls)
    draft.model.set_embed_and_head(embed, head)
    steps = 4
    ids = spec.token_ids(prompt_len)
    # target streams before the head, from our target (verified against transformers in
    # the parity tests)
    target = load_runner(config, table, max_tokens_per_pass=width)
    req = table.open_request()
    table.reserve(req, prompt_len + steps + 2)
    target_hidden = target.forward(
        ModelInput(
            ForwardMode.EXTEND,
            ids[:prompt_len],
            [req],
            [0],
            [prompt_len],
            capture_hidden_mode=CaptureHiddenMode.FULL,
        )
    ).hidden_states

    # paged: draft extend over the prompt, then chained single-token steps
    next_ids = ids[1 : prompt_len + 1]
    step = draft.forward(
        ModelInput(
            ForwardMode.DRAFT_EXTEND,
            next_ids,
            [req],
            [0],
            [prompt_len],
            capture_hidden_mode=CaptureHiddenMode.LAST,
            captured_hidden_states=target_hidden,
        )
    )
    paged = [(step.next_token_logits[0], step.hidden_states[0])]
    for i in range(1, steps):
        token = step.next_token_logits.argmax(-1)
        step = draft.forward(
            ModelInput(
                ForwardMode.DECODE,
                token,
                [req],
                [prompt_len + i - 1],
                [1],
                capture_hidden_mode=CaptureHiddenMode.LAST,
                captured_hidden_states=step.hidden_states,
                spec_step_idx=i,
            )
        )
        paged.append((step.next_token_logits[0], step.hidden_states[0]))

    # oracle: recompute the whole chained sequence from scratch for every step
    seq_ids, seq_hidden = next_ids.clone(), target_hidden.clone()
    for i, (logits, hidden) in enumerate(paged):
        dense_logits, dense_hidden = spec.oracle(
            mtp_hf, tensors, embed, head, seq_ids, seq_hidden, i, prompt_len
        )
        torch.testing.assert_close(
            logits, dense_logits[-1], atol=ATOL, rtol=0, msg=f"step {i} logits"
        )
        torch.testing.assert_close(
            hidden, dense_hidden[-1], atol=ATOL, rtol=0, msg=f"step {i} hidden"
        )
        seq_ids = torch.cat([seq_ids, dense_logits[-1].argmax().view(1)])
        seq_hidden = torch.cat([seq_hidden, dense_hidden[-1:]])


def released_mtp_keys(num_experts=256):
    """The 1575 `mtp.0.*` names of DeepSeek-V4-Flash (its `model.safetensors.index.json`)."""
    keys = [f"mtp.0.attn.{n}" for n in ("attn_sink", "q_norm.weight", "kv_norm.weight")]
    for proj in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
        keys += [f"mtp.0.attn.{proj}.weight", f"mtp.0.attn.{proj}.scale"]
    keys += ["mtp.0.attn_norm.weight", "mtp.0.ffn_norm.weight"]
    keys += [f"mtp.0.hc_{part}_{k}" for part in ("attn", "ffn") for k in ("fn", "base", "scale")]
    keys += ["mtp.0.ffn.gate.weight", "mtp.0.ffn.gate.bias"]
    keys += [f"mtp.0.ffn.shared_experts.w{i}.{s}" for i in (1, 2, 3) for s in ("weight", "scale")]
    keys += [
        f"mtp.0.ffn.experts.{e}.w{i}.{s}"
        for e in range(num_experts)
        for i in (1, 2, 3)
        for s in ("weight", "scale")
    ]
    keys += [f"mtp.0.{p}.{s}" for p in ("e_proj", "h_proj") for s in ("weight", "scale")]
    keys += ["mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.norm.weight"]
    keys += ["mtp.0.hc_head_fn", "mtp.0.hc_head_base", "mtp.0.hc_head_scale"]
    return keys


def test_deepseek_v4_mtp_name_remapping_on_the_released_key_list():
    keys = released_mtp_keys()
    assert len(keys) == 1575
    mapped = {k: remap_mtp_name(k, 43, 1) for k in keys}
    assert all(v is not None for v in mapped.values())
    assert mapped["mtp.0.attn.wq_a.weight"] == "layers.43.mtp_block.attn.wq_a.weight"
    assert mapped["mtp.0.ffn.experts.7.w2.scale"] == "layers.43.mtp_block.ffn.experts.7.w2.scale"
    assert mapped["mtp.0.ffn.gate.bias"] == "layers.43.mtp_block.ffn.gate.bias"
    assert mapped["mtp.0.hc_attn_fn"] == "layers.43.mtp_block.hc_attn_fn"
    assert mapped["mtp.0.norm.weight"] == "layers.43.shared_head.norm.weight"
    assert mapped["mtp.0.e_proj.scale"] == "layers.43.e_proj.scale"
    assert mapped["mtp.0.enorm.weight"] == "layers.43.enorm.weight"
    assert mapped["mtp.0.hc_head_fn"] == "layers.43.hc_head_fn"
    assert len(set(mapped.values())) == len(keys)
    # decoys: the trunk, other MTP depths, shared embedding and head
    for decoy in (
        "layers.42.attn.wq_a.weight",
        "embed.weight",
        "head.weight",
        "mtp.1.enorm.weight",
        "mtp.0.emb.tok_emb.weight",
        "mtp.0.head.weight",
        "model.layers.42.attn.wkv.weight",
    ):
        assert remap_mtp_name(decoy, 43, 1) is None
    # the spec-layer spelling other engines write
    assert (
        remap_mtp_name("model.layers.43.mtp_block.attn.wkv.weight", 43, 1)
        == "layers.43.mtp_block.attn.wkv.weight"
    )
    assert remap_mtp_name("model.layers.43.enorm.weight", 43, 1) == "layers.43.enorm.weight"
    assert remap_mtp_name("model.layers.43.shared_head.head.weight", 43, 1) is None


def released_qwen_mtp_keys():
    """The 31 `mtp.*` tensor names of Qwen3.8-Flash-Next (its `model.safetensors.index.json`)."""
    keys = [
        "mtp.fc_embedding.weight",
        "mtp.fc_hidden.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
    ]
    keys += [
        f"mtp.hyper_connection_mixer.{n}.weight"
        for n in ("hc_norm", "input_mix_weight_down", "input_mix_weight_up")
    ]
    keys += [
        f"mtp.layers.0.{part}_hyper_connection.{n}.weight"
        for part in ("attn", "mlp")
        for n in ("hc_norm", "input_mix_weight_down", "input_mix_weight_up", "block_inject_weight")
    ]
    keys += [
        f"mtp.layers.0.self_attn.{n}.weight"
        for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
    ]
    keys += [
        f"mtp.layers.0.self_attn.indexer.{n}.weight"
        for n in ("index_qk_proj", "q_layernorm", "k_layernorm")
    ]
    keys += [
        "mtp.layers.0.mlp.gate.weight",
        "mtp.layers.0.mlp.experts.gate_up_proj",
        "mtp.layers.0.mlp.experts.down_proj",
        "mtp.layers.0.mlp.shared_expert_gate.weight",
    ]
    keys += [
        f"mtp.layers.0.mlp.shared_expert.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")
    ]
    return keys


def test_qwen4_exp_mtp_name_remapping_on_the_released_key_list():
    keys = released_qwen_mtp_keys()
    assert len(keys) == 31
    mapped = {k: map_mtp_checkpoint_name(k) for k in keys}
    assert all(v is not None for v in mapped.values())
    assert mapped["mtp.fc_hidden.weight"] == ("model.fc_hidden.weight", ())
    assert mapped["mtp.layers.0.self_attn.k_proj.weight"] == (
        "model.layers.0.self_attn.qkv_proj.weight",
        (1,),
    )
    assert mapped["mtp.layers.0.mlp_hyper_connection.block_inject_weight.weight"] == (
        "model.layers.0.mlp_hyper_connection.input_mix_weight_down_block_inject.weight",
        (1,),
    )
    assert mapped["mtp.hyper_connection_mixer.input_mix_weight_down.weight"] == (
        "model.hyper_connection_mixer.input_mix_weight_down.weight",
        (),
    )
    assert mapped["mtp.layers.0.mlp.experts.gate_up_proj"] == (
        "model.layers.0.mlp.experts.w13_weight",
        (),
    )
    assert len({v for v in mapped.values()}) == 31
    # the released checkpoint nests the text model; the MTP prefix may come either way
    assert remap_mtp_weight_name("model.mtp.fc_hidden.weight") == "model.fc_hidden.weight"
    assert remap_mtp_weight_name("model.language_model.mtp.fc_hidden.weight") == (
        "model.fc_hidden.weight"
    )
    for decoy in (
        "model.language_model.layers.3.self_attn.q_proj.weight",
        "model.language_model.embed_tokens.weight",
        "lm_head.weight",
        "model.visual.blocks.0.attn.qkv.weight",
        "model.language_model.hyper_connection_mixer.hc_norm.weight",
        "mtp.shared_head.head.weight",
    ):
        assert map_mtp_checkpoint_name(decoy) is None
    assert map_mtp_checkpoint_name("mtp.hyper_connection_mixer.block_inject_weight.weight") is None
