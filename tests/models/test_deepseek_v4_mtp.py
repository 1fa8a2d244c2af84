# SPDX-License-Identifier: Apache-2.0
"""The paged MTP draft against a dense re-statement of its math, and its name remapping."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.cache import PagedTokenAllocator, ReqToTokenPool, SlotTable
from runtime.configs.model_config import ModelConfig
from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.execution.model_input import ModelInput
from runtime.models.deepseek_v4_mtp import DeepseekV4ForCausalLMNextN, remap_mtp_name
from tests.runners import load_runner
from tests.tiny_checkpoints import build_tiny_v4_mtp_checkpoint

ATOL = 1e-4


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    return build_tiny_v4_mtp_checkpoint(tmp_path_factory.mktemp("tiny_v4_mtp"), seed=5)


def rms(x, w, eps=1e-6):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def dense_mtp(mtp_hf, tensors, embed, head, next_ids, prev_hidden):
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


def test_paged_mtp_matches_dense_restatement_per_step(mtp_ckpt):
    from safetensors.torch import load_file

    path, target_hf, mtp_hf = mtp_ckpt
    tensors = load_file(str(path / "model.safetensors"))
    embed, head = tensors["embed.weight"], tensors["head.weight"]
    config = ModelConfig.from_path(path, "float32")
    table = SlotTable(ReqToTokenPool(4, 256), PagedTokenAllocator(64, 4))
    draft = load_runner(config, table, max_tokens_per_pass=4, model_cls=DeepseekV4ForCausalLMNextN)
    draft.model.set_embed_and_head(embed, head)

    prompt_len, steps = 37, 4
    ids = torch.randint(0, 97, (prompt_len + 1,), generator=torch.Generator().manual_seed(9))
    # target streams before hc_head, from our target (verified against transformers elsewhere)
    target = load_runner(config, table, max_tokens_per_pass=4)
    req = table.open_request()
    table.reserve(req, prompt_len + steps + 2)
    out = target.forward(
        ModelInput(
            ForwardMode.EXTEND,
            ids[:prompt_len],
            [req],
            [0],
            [prompt_len],
            capture_hidden_mode=CaptureHiddenMode.FULL,
        )
    )
    target_hidden = out.hidden_states

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

    # dense: recompute the whole chained sequence from scratch for every step
    seq_ids, seq_hidden = next_ids.clone(), target_hidden.clone()
    for i, (logits, hidden) in enumerate(paged):
        dense_logits, dense_hidden = dense_mtp(mtp_hf, tensors, embed, head, seq_ids, seq_hidden)
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


def test_mtp_name_remapping_on_the_released_key_list():
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
