# SPDX-License-Identifier: Apache-2.0
"""Qwen4Exp text model (released as Qwen3.8-Flash-Next; research/qwen4exp.md section 2).

    R = repeat(embed(ids), n)                                   [T, n*H]
    per layer:  [R += PLE(R, ids)]
                x, s = attn_GR(R);  R = R + s (x) (GatedDeltaNet | QSA-attention)(x)
                x, s = mlp_GR(R);   R = R + s (x) SparseMoE(x)
    logits = lm_head(mixer_GR(R))                               no final norm

`R` before the final mixer (`[T, n*H]`) is what the MTP draft consumes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from runtime.cache.pool_geometry import PoolGeometry
from runtime.cache.qwen4_exp_pool import Qwen4ExpCacheLayout, Qwen4ExpKVPool
from runtime.core.forward_context import ForwardContext
from runtime.core.model_output import LogitsProcessorOutput
from runtime.distributed import Mapping
from runtime.layers.attention.qwen4_exp_qsa import QSAAttention
from runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.gated_residual import GatedResidual
from runtime.layers.linear import ReplicatedLinear
from runtime.layers.linear_attention.gated_delta_net import GatedDeltaNet
from runtime.layers.logits_processor import LogitsProcessor
from runtime.layers.mlp import SwiGLUMLP
from runtime.layers.moe import (
    ExpertCheckpointSchema,
    FusedMoEExperts,
    MoECheckpointLoader,
    select_experts,
)
from runtime.layers.ple import PLELayer
from runtime.layers.rotary import RotaryEmbedding
from runtime.layers.weight_utils import WeightLoadTracker, make_param

logger = logging.getLogger(__name__)

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
    """softmax router (no bias) -> top-k renormalised experts + sigmoid-gated shared expert."""

    def __init__(self, config, mapping: Mapping):
        super().__init__()
        self.top_k, self.renormalize = (
            config.num_experts_per_tok,
            getattr(config, "norm_topk_prob", True),
        )
        self.gate = nn.Module()
        self.gate.weight = make_param((config.num_experts, config.hidden_size))
        self.experts = FusedMoEExperts(
            config.num_experts, config.hidden_size, config.moe_intermediate_size, mapping.moe.ep
        )
        self.shared_expert = SwiGLUMLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(
            nn.functional.linear(x, self.gate.weight),
            self.top_k,
            "softmax",
            renormalize=self.renormalize,
        )
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, weights, ids) + shared


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
        if self.kind == "linear":
            self.linear_attn = GatedDeltaNet(config, cache_layer)
        else:
            self.self_attn = QSAAttention(config, cache_layer, rope)
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
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        input_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(mixer output [T, H], streams before the mixer [T, n*H])`."""
        embeds = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        streams = embeds.repeat(1, self.hc_count)
        cos, sin = self.rope.cos_sin(positions)
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


def map_checkpoint_name(name: str) -> tuple[str, tuple] | None:
    """A checkpoint name -> (runtime parameter, weight-loader args), None to skip. Per-expert
    names keep their `experts.E.*_proj` form for the MoE checkpoint loader."""
    for pattern, repl in PREFIXES:
        name = re.sub(pattern, repl, name)
    if any(re.search(p, name) for p in SKIPPED):
        return None
    shard = NGRAM_SHARD.match(name)
    if shard:
        return f"{shard['prefix']}.weight", (int(shard["shard"]),)
    for pattern, repl in RENAMES:
        name = re.sub(pattern, repl, name)
    if ".experts." not in name or "shared_expert" in name:
        for param, ckpt, shard_id in STACKED_PARAMS:
            if ckpt in name:
                return name.replace(ckpt, param), (shard_id,)
    return name, ()


def load_qwen4_exp_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    name_map,
    shared_params: tuple[str, ...] = (),
) -> WeightLoadTracker:
    params = {n: p for n, p in model.named_parameters() if n not in shared_params}
    tracker = WeightLoadTracker(params)
    ep = model.mapping.moe.ep
    experts = MoECheckpointLoader(EXPERT_SCHEMA, model.text_config.num_experts, ep.rank, ep.size)
    skipped_vision = False
    for raw_name, tensor in weights:
        mapped = name_map(raw_name)
        if mapped is None:
            skipped_vision = skipped_vision or "visual." in raw_name
            continue
        name, args = mapped
        expert = experts.map(name)
        if expert is not None:
            if expert.local:
                tracker.load(raw_name, expert.param, tensor, expert.shard_id, expert.expert_id)
            continue
        tracker.load(raw_name, name, tensor, *args)
    if skipped_vision:
        logger.info("skipped the vision tower weights (this runtime serves the text path)")
    return tracker


class Qwen4ExpForCausalLM(nn.Module):
    """Text model for `Qwen4ExpForCausalLM` and the text path of
    `Qwen4ExpForConditionalGeneration`. With hidden capture the output carries the streams
    before the final mixer, `[T, n*H]`, for the MTP draft."""

    draft_architecture = "Qwen4ExpMTP"

    @staticmethod
    def has_draft_layers(config) -> bool:
        cfg = text_config(config)
        return bool(
            getattr(cfg, "mtp_num_hidden_layers", None)
            or getattr(cfg, "num_nextn_predict_layers", 0)
        )

    def __init__(self, config, mapping: Mapping | None = None, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config, self.mapping = config, mapping or Mapping.single()
        self.text_config = cfg = text_config(config)
        self.model = Qwen4ExpModel(cfg, self.mapping)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.mapping.attn.tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_processor = LogitsProcessor()

    @torch.no_grad()
    def forward(
        self,
        ctx: ForwardContext,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        input_embeds: torch.Tensor | None = None,
        captured_hidden_states: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> LogitsProcessorOutput:
        hidden, streams = self.model(input_ids, positions, ctx, input_embeds)
        return self.logits_processor(hidden, self.lm_head, ctx, aux_hidden=streams)

    def get_embed_and_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.embed_tokens.weight, self.lm_head.weight

    @staticmethod
    def skip_checkpoint_weight(name: str) -> bool:
        return map_checkpoint_name(name) is None

    # caches -------------------------------------------------------------------------------
    @classmethod
    def cache_layout(
        cls, config, kinds: tuple[str, ...] | None = None, ple_layers=None
    ) -> Qwen4ExpCacheLayout:
        cfg = text_config(config)
        kinds = kinds or tuple(layer_kind(cfg, i) for i in range(cfg.num_hidden_layers))
        if ple_layers is None:
            ple_layers = tuple(i - 1 for i in (getattr(cfg, "ple_layer_ids", None) or []))
        key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        return Qwen4ExpCacheLayout(
            layer_kinds=kinds,
            ple_layers=tuple(ple_layers),
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            index_head_dim=getattr(cfg, "indexer_head_dim", None) or 1,
            conv_dim=2 * key_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim,
            conv_kernel=cfg.linear_conv_kernel_dim,
            num_v_heads=cfg.linear_num_value_heads,
            head_k_dim=cfg.linear_key_head_dim,
            head_v_dim=cfg.linear_value_head_dim,
            hc_width=cfg.hc_count * cfg.hidden_size,
            ple_conv_span=(cfg.ple_conv_kernel_size - 1) * cfg.ngram_size,
            ngram_size=cfg.ngram_size,
            qsa_ratio=getattr(cfg, "indexer_compress_ratio", None) or 1,
        )

    @classmethod
    def create_cache_pool(cls, config, geometry: PoolGeometry) -> Qwen4ExpKVPool:
        return Qwen4ExpKVPool(cls.cache_layout(config), geometry)

    # weights ------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tied = ("lm_head.weight",) if self.text_config.tie_word_embeddings else ()
        tracker = load_qwen4_exp_weights(self, weights, map_checkpoint_name, shared_params=tied)
        tracker.raise_if_incomplete(what="Qwen4Exp target")
        return tracker.loaded_params


class Qwen4ExpForConditionalGeneration(Qwen4ExpForCausalLM):
    """The multimodal checkpoint served through its text path (vision weights skipped)."""


EntryClass = [Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration]
