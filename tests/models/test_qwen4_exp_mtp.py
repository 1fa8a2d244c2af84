# SPDX-License-Identifier: Apache-2.0
"""The paged Qwen4Exp MTP draft against an oracle composed from transformers' Qwen4Exp
modules (`modeling_qwen4_exp.py`), per step, with the fed-back streams and the
QSA selection reuse; and the checkpoint name remapping on the released key list."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from runtime.cache import PagedTokenAllocator, ReqToTokenPool, SlotTable
from runtime.configs.model_config import ModelConfig
from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.execution.model_input import ModelInput
from runtime.models.qwen4_exp_mtp import (
    Qwen4ExpMTP,
    map_mtp_checkpoint_name,
    remap_mtp_weight_name,
)
from tests.runners import load_runner
from tests.tiny_checkpoints import build_tiny_qwen4_exp_mtp_checkpoint

ATOL = 1e-4


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    return build_tiny_qwen4_exp_mtp_checkpoint(tmp_path_factory.mktemp("qwen_mtp"), seed=6)


def offset_norm(x, w, eps=1e-6):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def dense_mtp(hf_plus, tensors, embed, head, next_ids, prev_streams, reuse_from=None):
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


@pytest.mark.parametrize("prompt_len", [11, 30])  # dense, then with QSA selection active
def test_paged_mtp_matches_composed_oracle(mtp_ckpt, prompt_len):
    path, target_hf, hf_plus = mtp_ckpt
    tensors = load_file(str(path / "model.safetensors"))
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    config = ModelConfig.from_path(path, "float32")
    table = SlotTable(ReqToTokenPool(2, 256), PagedTokenAllocator(64, 4))
    target = load_runner(config, table, max_tokens_per_pass=5)
    draft = load_runner(config, table, max_tokens_per_pass=5, model_cls=Qwen4ExpMTP)
    draft.model.set_embed_and_head(embed, head)
    steps = 4
    ids = torch.randint(
        2, 128, (prompt_len + 1,), generator=torch.Generator().manual_seed(prompt_len)
    )
    req = table.open_request()
    table.reserve(req, prompt_len + steps + 2)
    hidden = target.forward(
        ModelInput(
            ForwardMode.EXTEND,
            ids[:prompt_len],
            [req],
            [0],
            [prompt_len],
            capture_hidden_mode=CaptureHiddenMode.FULL,
        )
    ).hidden_states
    next_ids = ids[1 : prompt_len + 1]
    step = draft.forward(
        ModelInput(
            ForwardMode.DRAFT_EXTEND,
            next_ids,
            [req],
            [0],
            [prompt_len],
            capture_hidden_mode=CaptureHiddenMode.LAST,
            captured_hidden_states=hidden,
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

    seq_ids, seq_hidden = next_ids.clone(), hidden.clone()
    for i, (logits, streams) in enumerate(paged):
        dense_logits, dense_streams = dense_mtp(
            hf_plus,
            tensors,
            embed,
            head,
            seq_ids,
            seq_hidden,
            reuse_from=None if i == 0 else prompt_len - 1,
        )
        torch.testing.assert_close(
            logits, dense_logits[-1], atol=ATOL, rtol=0, msg=f"step {i} logits"
        )
        torch.testing.assert_close(
            streams, dense_streams[-1], atol=ATOL, rtol=0, msg=f"step {i} streams"
        )
        seq_ids = torch.cat([seq_ids, dense_logits[-1].argmax().view(1)])
        seq_hidden = torch.cat([seq_hidden, dense_streams[-1:]])


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


def test_mtp_name_remapping_on_the_released_key_list():
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
