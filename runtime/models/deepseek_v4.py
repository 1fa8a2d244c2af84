# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V4 target model (transformers' `models/deepseek_v4/modeling_deepseek_v4.py`).

    X = repeat(embed(ids), hc)                              [T, hc, H]
    per layer:  a, post, comb = hc_pre(X);  X = post*Attn(attn_norm(a)) + comb^T X
                f, post, comb = hc_pre(X);  X = post*MoE(ffn_norm(f)) + comb^T X
    logits = head(norm(hc_head(X)))

`X` after the last layer (before `hc_head`) is what the MTP draft consumes; it is
returned flattened `[T, hc*H]` when the context asks for hidden capture.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from runtime.cache.deepseek_v4_pool import DeepseekV4CacheLayout, DeepseekV4KVPool
from runtime.core.forward_context import ForwardContext
from runtime.distributed import Mapping, all_reduce
from runtime.layers.attention.deepseek_v4 import DeepseekV4Attention, RopeInputs, sparse_ratio
from runtime.layers.embedding import VocabParallelEmbedding
from runtime.layers.hyper_connection import hc_head, hc_post, hc_pre
from runtime.layers.mlp import SwiGLUMLP
from runtime.layers.moe import ExpertCheckpointSchema, FusedMoEExperts, select_experts
from runtime.layers.norm import RMSNorm
from runtime.layers.rotary import RotaryEmbedding
from runtime.layers.weight_utils import make_param
from runtime.models.base import ParamTarget, TargetModel

# ---------------------------------------------------------------------------------------
# Config helpers
# ---------------------------------------------------------------------------------------

_LAYER_TYPE_RATIO_KEYS = {"compressed_sparse_attention", "heavily_compressed_attention"}


def compress_ratio_of(config, layer_id: int) -> int:
    """0 for window-only layers. Layers past the trunk (MTP) read the released
    `compress_ratios` list when the config has one, else are window-only."""
    if layer_id < config.num_hidden_layers:
        layer_type = config.layer_types[layer_id]
        if layer_type not in _LAYER_TYPE_RATIO_KEYS:
            return 0
        ratio = config.compress_rates[layer_type]
        if layer_type == "heavily_compressed_attention" and ratio == sparse_ratio(config):
            # a layer's kind is known from its ratio alone (caches and metadata are keyed
            # by it), and the kinds differ: CSA windows overlap and carry the indexer
            raise ValueError(
                "compress_rates: heavily_compressed_attention layers need a ratio other "
                f"than compressed_sparse_attention's ({ratio})"
            )
        return ratio
    ratios = getattr(config, "compress_ratios", None)
    return int(ratios[layer_id]) if ratios and layer_id < len(ratios) else 0


def is_hash_layer(config, layer_id: int) -> bool:
    return layer_id < config.num_hidden_layers and config.mlp_layer_types[layer_id] == "hash_moe"


def build_rope(config, kind: str) -> RotaryEmbedding:
    """`main` for window-only layers (and MTP), `compress` (YaRN) for compressed layers."""
    return RotaryEmbedding(
        config.qk_rope_head_dim, config.rope_parameters[kind], interleaved=True, rotate_tail=True
    )


def build_ropes(config) -> dict[str, RotaryEmbedding]:
    return {kind: build_rope(config, kind) for kind in ("main", "compress")}


def rope_inputs(ropes: Iterable[tuple[str, RotaryEmbedding]], positions) -> dict[str, RopeInputs]:
    """cos/sin of every rope kind at `positions`, computed once per forward."""
    return {kind: RopeInputs(rope, *rope.cos_sin(positions)) for kind, rope in ropes}


def cache_layout_of(config, layer_ids: Iterable[int]) -> DeepseekV4CacheLayout:
    """The cache layout of the given (global) layer ids, in order."""
    return DeepseekV4CacheLayout(
        compress_ratios=tuple(compress_ratio_of(config, i) for i in layer_ids),
        head_dim=config.head_dim,
        index_head_dim=config.index_head_dim,
        sliding_window=config.sliding_window,
        indexer_ratio=sparse_ratio(config),
    )


# ---------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------


class DeepseekV4Gate(nn.Module):
    """Router weights; learned layers carry the selection bias, hash layers `tid2eid`."""

    def __init__(self, config, hashed: bool):
        super().__init__()
        self.hashed = hashed
        self.weight = make_param((config.n_routed_experts, config.hidden_size))
        if hashed:
            self.tid2eid = make_param((config.vocab_size, config.num_experts_per_tok), torch.long)
        else:
            self.e_score_correction_bias = make_param((config.n_routed_experts,), torch.float32)


class DeepseekV4MoE(nn.Module):
    """Router replicated; routed experts over `mapping.moe` (EP blocks x TP slices); the
    shared expert split over the attention TP group."""

    def __init__(self, config, hashed: bool, mapping: Mapping):
        super().__init__()
        self.top_k, self.scoring_func = config.num_experts_per_tok, config.scoring_func
        self.renormalize = getattr(config, "norm_topk_prob", True)
        self.routed_scaling_factor = config.routed_scaling_factor
        self.gate = DeepseekV4Gate(config, hashed)
        self.fused_reduction = mapping.moe_reduction_spans_tp
        self.combine = mapping.moe.combine
        self.experts = FusedMoEExperts(
            config.n_routed_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            mapping.moe.ep,
            config.swiglu_limit,
            tp=mapping.moe.tp,
            combine=mapping.moe.combine,
            reduce_results=not self.fused_reduction,
        )
        # one shared expert of the routed experts' width whatever `n_shared_experts` says,
        # as transformers' `DeepseekV4MoE` builds it (its config maps `intermediate_size`
        # to `moe_intermediate_size`); the released checkpoints have one
        self.shared_experts = SwiGLUMLP(
            config.hidden_size,
            config.moe_intermediate_size,
            tp=mapping.attn.tp,
            swiglu_limit=config.swiglu_limit,
            reduce_results=not self.fused_reduction,
        )

    def route(self, x: torch.Tensor, input_ids: torch.Tensor):
        """-> (expert weights [T, k], expert ids [T, k], shared-expert output [T, H])."""
        gate = self.gate
        weights, ids = select_experts(
            nn.functional.linear(x, gate.weight),
            self.top_k,
            self.scoring_func,
            correction_bias=None if gate.hashed else gate.e_score_correction_bias,
            hash_expert_ids=gate.tid2eid[input_ids] if gate.hashed else None,
            renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor,
        )
        return weights, ids, self.shared_experts(x)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids, shared = self.route(x, input_ids)
        out = self.experts(x, weights, ids) + shared
        return all_reduce(out, self.combine) if self.fused_reduction else out


class DeepseekV4DecoderLayer(nn.Module):
    """Attention and MoE sub-blocks, each wrapped in hc_pre / hc_post (transformers'
    `DeepseekV4DecoderLayer` with its `DeepseekV4HyperConnection`s)."""

    def __init__(self, config, layer_id: int, mapping: Mapping, cache_layer: int | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.compress_ratio = compress_ratio_of(config, layer_id)
        self.rope_kind = "compress" if self.compress_ratio > 1 else "main"
        self.norm_eps, self.hc_eps = config.rms_norm_eps, config.hc_eps
        self.sinkhorn_iters = config.hc_sinkhorn_iters
        hc = config.hc_mult
        mix = (2 + hc) * hc
        for part in ("attn", "ffn"):
            setattr(
                self, f"hc_{part}_fn", make_param((mix, hc * config.hidden_size), torch.float32)
            )
            setattr(self, f"hc_{part}_base", make_param((mix,), torch.float32))
            setattr(self, f"hc_{part}_scale", make_param((3,), torch.float32))
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = DeepseekV4Attention(
            config,
            self.compress_ratio,
            layer_id if cache_layer is None else cache_layer,
            build_rope(config, self.rope_kind),
            tp=mapping.attn.tp,
        )
        self.ffn = DeepseekV4MoE(config, is_hash_layer(config, layer_id), mapping)

    # pure stream math between the sub-blocks

    def _hc_pre(self, x: torch.Tensor, part: str):
        return hc_pre(
            x,
            getattr(self, f"hc_{part}_fn"),
            getattr(self, f"hc_{part}_scale"),
            getattr(self, f"hc_{part}_base"),
            self.norm_eps,
            self.hc_eps,
            self.sinkhorn_iters,
        )

    def enter_attn(self, x: torch.Tensor):
        a, post, comb = self._hc_pre(x, "attn")
        return self.attn_norm(a), post, comb

    def enter_ffn(self, attn_out: torch.Tensor, x: torch.Tensor, post, comb):
        x = hc_post(attn_out, x, post, comb)
        f, post, comb = self._hc_pre(x, "ffn")
        return self.ffn_norm(f), x, post, comb

    def leave(self, ffn_out: torch.Tensor, x: torch.Tensor, post, comb) -> torch.Tensor:
        return hc_post(ffn_out, x, post, comb)

    def forward(
        self,
        x: torch.Tensor,
        ctx: ForwardContext,
        input_ids: torch.Tensor,
        ropes: dict[str, RopeInputs],
    ) -> torch.Tensor:
        """`x [T, hc, H]` -> `[T, hc, H]`."""
        a, post, comb = self.enter_attn(x)
        f, x, post, comb = self.enter_ffn(self.attn(a, ctx, ropes[self.rope_kind]), x, post, comb)
        return self.leave(self.ffn(f, input_ids), x, post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, config, mapping: Mapping):
        super().__init__()
        self.config, self.hc_mult = config, config.hc_mult
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, mapping.attn.tp
        )
        self.layers = nn.ModuleList(
            DeepseekV4DecoderLayer(config, i, mapping) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head_fn = make_param(
            (config.hc_mult, config.hc_mult * config.hidden_size), torch.float32
        )
        self.hc_head_base = make_param((config.hc_mult,), torch.float32)
        self.hc_head_scale = make_param((1,), torch.float32)
        self.ropes = nn.ModuleDict(build_ropes(config))

    def forward(
        self, ctx: ForwardContext, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(normed hidden [T, H], residual streams before hc_head [T, hc*H])`."""
        embeds = self.embed_tokens(input_ids)
        x = embeds.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        ropes = rope_inputs(self.ropes.items(), ctx.positions)
        for layer in self.layers:
            x = layer(x, ctx, input_ids, ropes)
        cfg = self.config
        y = hc_head(
            x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, cfg.rms_norm_eps, cfg.hc_eps
        )
        return self.norm(y), x.flatten(1)


# ---------------------------------------------------------------------------------------
# Checkpoint names
# ---------------------------------------------------------------------------------------

# transformers names -> released names. Two spellings reach us: module names
# (`model.layers.0.self_attn.q_a_proj.weight`, a raw `state_dict()`) and what
# `save_pretrained` writes, which reverses transformers' load-time renames only partly
# (`model.layers.0.attn.wq_a.weight`, and the main attention's kv_norm as `attn.norm`).
# Applied in order.
HF_TO_RELEASED: tuple[tuple[str, str], ...] = (
    (r"\.attn\.norm\.", ".attn.kv_norm."),
    (r"^model\.embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^model\.norm\.", "norm."),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.layers\.", "layers."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
)

# Released names -> runtime parameters. Plain renames first, then (param, checkpoint, shard)
# stacks in the order TokenSpeed's loader uses.
RELEASED_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^embed\.", "model.embed_tokens."),
    (r"^head\.", "lm_head."),
    (r"^norm\.", "model.norm."),
    (r"^hc_head_", "model.hc_head_"),
    (r"^layers\.", "model.layers."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.ffn\.gate\.bias$", ".ffn.gate.e_score_correction_bias"),
)
STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    ("shared_experts.gate_up_proj", "shared_experts.w1", 0),
    ("shared_experts.gate_up_proj", "shared_experts.w3", 1),
    ("attn.fused_wqa_wkv", "attn.wq_a", 0),
    ("attn.fused_wqa_wkv", "attn.wkv", 1),
    ("compressor.fused_wkv_wgate", "compressor.wkv", 0),
    ("compressor.fused_wkv_wgate", "compressor.wgate", 1),
)
# transformers keeps routed experts fused; they load whole into the fused parameters.
FUSED_EXPERTS = (
    (r"\.ffn\.experts\.gate_up_proj$", ".ffn.experts.w13_weight"),
    (r"\.ffn\.experts\.down_proj$", ".ffn.experts.w2_weight"),
)
EXPERT_SCHEMA = ExpertCheckpointSchema(gate_proj_name="w1", down_proj_name="w2", up_proj_name="w3")


def hf_to_released_name(name: str) -> str:
    """A transformers `save_pretrained` name in the released naming (released names pass)."""
    if not name.startswith(("model.", "lm_head.")):
        return name
    for pattern, repl in HF_TO_RELEASED:
        name = re.sub(pattern, repl, name)
    return name


def map_released_name(name: str) -> ParamTarget | None:
    """Released checkpoint name -> runtime parameter (None for tensors the target skips).
    Per-expert weights keep their `experts.E.wN` form for the MoE checkpoint loader."""
    if name.startswith("mtp."):
        return None
    for pattern, repl in RELEASED_RENAMES:
        name = re.sub(pattern, repl, name)
    for pattern, repl in FUSED_EXPERTS:
        if re.search(pattern, name):
            return ParamTarget(re.sub(pattern, repl, name))
    if ".experts." not in name:
        for param, ckpt, shard in STACKED_PARAMS:
            if f".{ckpt}." in name:
                return ParamTarget(name.replace(f".{ckpt}.", f".{param}."), (shard,))
    return ParamTarget(name)


# ---------------------------------------------------------------------------------------
# Entry class
# ---------------------------------------------------------------------------------------


class DeepseekV4ForCausalLM(TargetModel):
    """With hidden capture the output carries the pre-`hc_head` streams `[T, hc*H]` that the
    MTP draft consumes. Loads released (`layers.N.attn.wq_a.weight`, ...) or transformers
    names; `mtp.*` is left to the draft model (and not even read)."""

    model_name = "DeepSeek-V4 target"
    draft_architecture = "DeepseekV4ForCausalLMNextN"
    cache_pool_class = DeepseekV4KVPool
    expert_schema = EXPERT_SCHEMA

    @staticmethod
    def has_draft_layers(config) -> bool:
        return (getattr(config, "num_nextn_predict_layers", 0) or 0) >= 1

    def build_model(self, config, mapping: Mapping) -> DeepseekV4Model:
        return DeepseekV4Model(config, mapping)

    @classmethod
    def cache_layout(cls, config, mapping: Mapping | None = None) -> DeepseekV4CacheLayout:
        """The same on every rank: the KV latent is replicated."""
        return cache_layout_of(config, range(config.num_hidden_layers))

    @property
    def num_routed_experts(self) -> int:
        return self.config.n_routed_experts

    def map_weight_name(self, name: str) -> ParamTarget | None:
        return map_released_name(hf_to_released_name(name))


EntryClass = [DeepseekV4ForCausalLM]
