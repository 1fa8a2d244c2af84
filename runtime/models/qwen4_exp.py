# SPDX-License-Identifier: Apache-2.0
"""Qwen4Exp text model (released as Qwen3.8-Flash-Next; transformers'
`models/qwen4_exp/modeling_qwen4_exp.py`, `Qwen4ExpTextModel`).

    R = repeat(embed(ids), n)                                   [T, n*H]
    per layer:  [R += PLE(R, ids)]
                x, s = attn_GR(R);  R = R + s (x) (GatedDeltaNet | QSA-attention)(x)
                x, s = mlp_GR(R);   R = R + s (x) SparseMoE(x)
    logits = lm_head(mixer_GR(R))                               no final norm

`R` before the final mixer (`[T, n*H]`) is what the MTP draft consumes.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from runtime.cache.qwen4_exp_pool import Qwen4ExpCacheLayout, Qwen4ExpKVPool
from runtime.core.forward_context import ForwardContext
from runtime.distributed import Mapping, all_reduce
from runtime.layers.attention.qwen4_exp_qsa import QSAAttention, local_kv_heads
from runtime.layers.embedding import VocabParallelEmbedding
from runtime.layers.gated_residual import GatedResidual
from runtime.layers.linear import ReplicatedLinear
from runtime.layers.linear_attention.gated_delta_net import GatedDeltaNet, local_head_counts
from runtime.layers.mlp import SwiGLUMLP
from runtime.layers.moe import ExpertCheckpointSchema, FusedMoEExperts, select_experts
from runtime.layers.ple import PLELayer
from runtime.layers.rotary import RotaryEmbedding
from runtime.layers.weight_utils import make_param
from runtime.models.base import ParamTarget, TargetModel

ATTENTION_SPELLINGS = {
    "full_attention",
    "indexed_attention",
    "qwen_sparse_attention",
    "deepseek_sparse_attention",
    "hybrid_indexed",
    "attention",
}


def text_config(config):
    """The text config of a `Qwen4ExpForConditionalGeneration` checkpoint, or the config itself."""
    return getattr(config, "text_config", None) or config


def layer_kind(config, layer_id: int) -> str:
    kind = config.layer_types[layer_id]
    if kind == "linear_attention":
        return "linear"
    if kind in ATTENTION_SPELLINGS:
        return "attention"
    raise ValueError(f"unsupported Qwen4Exp layer type {kind!r} at layer {layer_id}")


def build_rope(config) -> RotaryEmbedding:
    params = config.rope_parameters or {}
    rotary_dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
    # Text positions are equal on all three mRoPE axes, so interleaved mRoPE is plain RoPE.
    return RotaryEmbedding(rotary_dim, {**params, "rope_type": params.get("rope_type", "default")})


class Qwen4ExpSparseMoe(nn.Module):
    """softmax router (no bias) -> top-k renormalised experts + sigmoid-gated shared expert.

    Router and shared-expert gate replicated; routed experts over `mapping.moe`; the shared
    expert split over the attention TP group. The gate is a per-row scalar, so the shared
    expert's partial sums can join the routed experts' all-reduce when the groups match."""

    def __init__(self, config, mapping: Mapping):
        super().__init__()
        self.top_k, self.renormalize = (
            config.num_experts_per_tok,
            getattr(config, "norm_topk_prob", True),
        )
        self.fused_reduction = mapping.moe_reduction_spans_tp
        self.combine = mapping.moe.combine
        self.gate = nn.Module()
        self.gate.weight = make_param((config.num_experts, config.hidden_size))
        self.experts = FusedMoEExperts(
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            mapping.moe.ep,
            tp=mapping.moe.tp,
            combine=mapping.moe.combine,
            reduce_results=not self.fused_reduction,
        )
        self.shared_expert = SwiGLUMLP(
            config.hidden_size,
            config.shared_expert_intermediate_size,
            tp=mapping.attn.tp,
            reduce_results=not self.fused_reduction,
        )
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(
            nn.functional.linear(x, self.gate.weight),
            self.top_k,
            "softmax",
            renormalize=self.renormalize,
        )
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        out = self.experts(x, weights, ids) + shared
        return all_reduce(out, self.combine) if self.fused_reduction else out


class Qwen4ExpDecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_id: int,
        mapping: Mapping,
        rope: RotaryEmbedding,
        cache_layer: int | None = None,
        kind: str | None = None,
        allow_ple: bool = True,
    ):
        super().__init__()
        cache_layer = layer_id if cache_layer is None else cache_layer
        self.kind = kind or layer_kind(config, layer_id)
        tp = mapping.attn.tp
        if self.kind == "linear":
            self.linear_attn = GatedDeltaNet(config, cache_layer, tp)
        else:
            self.self_attn = QSAAttention(config, cache_layer, rope, tp)
        self.mlp = Qwen4ExpSparseMoe(config, mapping)
        ple_ids = list(getattr(config, "ple_layer_ids", None) or [])
        self.ple = (
            PLELayer(config, ple_ids.index(layer_id + 1), cache_layer)
            if allow_ple and layer_id + 1 in ple_ids
            else None
        )
        hc = (config.hc_count, config.hidden_size, config.hc_lowrank, config.rms_norm_eps)
        self.attn_hyper_connection = GatedResidual(*hc)
        self.mlp_hyper_connection = GatedResidual(*hc)

    def forward(
        self,
        streams: torch.Tensor,
        ctx: ForwardContext,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        if self.ple is not None:
            streams = streams + self.ple(streams, input_ids, ctx)
        x, inject = self.attn_hyper_connection(streams)
        if self.kind == "linear":
            y = self.linear_attn(x, ctx)
        else:
            y = self.self_attn(x, ctx, cos, sin, spec_step_idx)
        streams = GatedResidual.combine(streams, y, inject)
        x, inject = self.mlp_hyper_connection(streams)
        return GatedResidual.combine(streams, self.mlp(x), inject)


class Qwen4ExpModel(nn.Module):
    def __init__(self, config, mapping: Mapping):
        super().__init__()
        self.config, self.hc_count = config, config.hc_count
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, mapping.attn.tp
        )
        self.rope = build_rope(config)
        self.layers = nn.ModuleList(
            Qwen4ExpDecoderLayer(config, i, mapping, self.rope)
            for i in range(config.num_hidden_layers)
        )
        self.hyper_connection_mixer = GatedResidual(
            config.hc_count,
            config.hidden_size,
            config.hc_lowrank,
            config.rms_norm_eps,
            use_combine=False,
        )

    def forward(
        self, ctx: ForwardContext, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(mixer output [T, H], streams before the mixer [T, n*H])`."""
        streams = self.embed_tokens(input_ids).repeat(1, self.hc_count)
        cos, sin = self.rope.cos_sin(ctx.positions)
        for layer in self.layers:
            streams = layer(streams, ctx, input_ids, cos, sin)
        return self.hyper_connection_mixer(streams)[0], streams


# ---------------------------------------------------------------------------------------
# Checkpoint names: transformers / released names -> runtime parameters
# ---------------------------------------------------------------------------------------

PREFIXES = (
    (r"^model\.language_model\.", "model."),
    (r"^language_model\.model\.", "model."),
    (r"^language_model\.", "model."),
)
SKIPPED = (
    r"^model\.visual\.",
    r"^visual\.",
    r"^mtp\.",
    r"hyper_connection_mixer\.block_inject_weight",
    r"ple_embedding\.(layer_multipliers|ngram_heads_vocab_sizes|ngram_heads_offsets)$",
)
RENAMES = (
    (r"\.ple_embedding\.ngram_embedding\.weight$", ".ple_embedding.weight"),
    (r"\.mlp\.experts\.gate_up_proj$", ".mlp.experts.w13_weight"),
    (r"\.mlp\.experts\.down_proj$", ".mlp.experts.w2_weight"),
)
# (runtime parameter, checkpoint tensor, shard id); the strings carry their delimiters, so the
# final mixer's `hyper_connection_mixer.input_mix_weight_down` stays a plain parameter.
STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    (".linear_attn.in_proj.", ".linear_attn.in_proj_qkv.", 0),
    (".linear_attn.in_proj.", ".linear_attn.in_proj_z.", 1),
    (".linear_attn.in_proj.", ".linear_attn.in_proj_b.", 2),
    (".linear_attn.in_proj.", ".linear_attn.in_proj_a.", 3),
    (".self_attn.qkv_proj.", ".self_attn.q_proj.", 0),
    (".self_attn.qkv_proj.", ".self_attn.k_proj.", 1),
    (".self_attn.qkv_proj.", ".self_attn.v_proj.", 2),
    (".shared_expert.gate_up_proj.", ".shared_expert.gate_proj.", 0),
    (".shared_expert.gate_up_proj.", ".shared_expert.up_proj.", 1),
    (
        "_hyper_connection.input_mix_weight_down_block_inject.",
        "_hyper_connection.input_mix_weight_down.",
        0,
    ),
    (
        "_hyper_connection.input_mix_weight_down_block_inject.",
        "_hyper_connection.block_inject_weight.",
        1,
    ),
    (".ple.kv_proj.", ".ple.key_proj.", 0),
    (".ple.kv_proj.", ".ple.value_proj.", 1),
)
NGRAM_SHARD = re.compile(
    r"^(?P<prefix>.*\.ple_embedding)\.ngram_embedding\.shard_(?P<shard>\d+)\.weight$"
)
EXPERT_SCHEMA = ExpertCheckpointSchema(
    gate_proj_name="gate_proj", down_proj_name="down_proj", up_proj_name="up_proj"
)


def map_checkpoint_name(name: str) -> ParamTarget | None:
    """A checkpoint name -> (runtime parameter, weight-loader args), None to skip. Per-expert
    names keep their `experts.E.*_proj` form for the MoE checkpoint loader."""
    for pattern, repl in PREFIXES:
        name = re.sub(pattern, repl, name)
    if any(re.search(p, name) for p in SKIPPED):
        return None
    shard = NGRAM_SHARD.match(name)
    if shard:
        return ParamTarget(f"{shard['prefix']}.weight", (int(shard["shard"]),))
    for pattern, repl in RENAMES:
        name = re.sub(pattern, repl, name)
    if ".experts." not in name or "shared_expert" in name:
        for param, ckpt, shard_id in STACKED_PARAMS:
            if ckpt in name:
                return ParamTarget(name.replace(ckpt, param), (shard_id,))
    return ParamTarget(name)


def cache_layout_of(
    config, kinds: tuple[str, ...] | None = None, ple_layers=None, mapping: Mapping | None = None
) -> Qwen4ExpCacheLayout:
    """The cache layout of the trunk (default) or of the given layer kinds and PLE layers,
    for one rank of `mapping`: its KV heads, its Gated DeltaNet heads (conv channels and
    recurrent states); the QSA index keys and PLE rings are replicated."""
    cfg = text_config(config)
    tp_size = mapping.attn.tp.size if mapping is not None else 1
    kinds = kinds or tuple(layer_kind(cfg, i) for i in range(cfg.num_hidden_layers))
    if ple_layers is None:
        ple_layers = tuple(i - 1 for i in (getattr(cfg, "ple_layer_ids", None) or []))
    k_heads, v_heads = local_head_counts(cfg, tp_size)
    key_dim = k_heads * cfg.linear_key_head_dim
    return Qwen4ExpCacheLayout(
        layer_kinds=kinds,
        ple_layers=tuple(ple_layers),
        num_kv_heads=local_kv_heads(cfg, tp_size),
        head_dim=cfg.head_dim,
        index_head_dim=getattr(cfg, "indexer_head_dim", None) or 1,
        conv_dim=2 * key_dim + v_heads * cfg.linear_value_head_dim,
        conv_kernel=cfg.linear_conv_kernel_dim,
        num_v_heads=v_heads,
        head_k_dim=cfg.linear_key_head_dim,
        head_v_dim=cfg.linear_value_head_dim,
        hc_width=cfg.hc_count * cfg.hidden_size,
        ple_conv_span=(cfg.ple_conv_kernel_size - 1) * cfg.ngram_size,
        ngram_size=cfg.ngram_size,
        qsa_ratio=getattr(cfg, "indexer_compress_ratio", None) or 1,
    )


# ---------------------------------------------------------------------------------------
# Entry classes
# ---------------------------------------------------------------------------------------


class Qwen4ExpForCausalLM(TargetModel):
    """Text model for `Qwen4ExpForCausalLM` and the text path of
    `Qwen4ExpForConditionalGeneration`. With hidden capture the output carries the streams
    before the final mixer, `[T, n*H]`, for the MTP draft."""

    model_name = "Qwen4Exp target"
    draft_architecture = "Qwen4ExpMTP"
    cache_pool_class = Qwen4ExpKVPool
    expert_schema = EXPERT_SCHEMA
    text_config_of = staticmethod(text_config)

    @staticmethod
    def has_draft_layers(config) -> bool:
        cfg = text_config(config)
        return bool(
            getattr(cfg, "mtp_num_hidden_layers", None)
            or getattr(cfg, "num_nextn_predict_layers", 0)
        )

    def build_model(self, config, mapping: Mapping) -> Qwen4ExpModel:
        return Qwen4ExpModel(config, mapping)

    @classmethod
    def cache_layout(cls, config, mapping: Mapping | None = None) -> Qwen4ExpCacheLayout:
        return cache_layout_of(config, mapping=mapping)

    @property
    def num_routed_experts(self) -> int:
        return self.text_config.num_experts

    def map_weight_name(self, name: str) -> ParamTarget | None:
        return map_checkpoint_name(name)


class Qwen4ExpForConditionalGeneration(Qwen4ExpForCausalLM):
    """The multimodal checkpoint served through its text path (vision weights skipped)."""


EntryClass = [Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration]
