# SPDX-License-Identifier: Apache-2.0
"""Qwen4Exp MTP draft (`Qwen4ExpMTP`), after vLLM's `qwen3_next_mtp.py` MTP module; its
decoder layer and final mixer are transformers' `Qwen4ExpTextDecoderLayer` and
`Qwen4ExpTextGatedResidual` (`models/qwen4_exp/modeling_qwen4_exp.py`).

With `H_in [T, n*H]` (the target's streams before its final mixer on the first step, the
previous step's streams after that) and the next token's embedding:

    u = fc_embedding(pre_fc_norm_embedding(embed(x_next)))              [T, H]
    S = fc_hidden(pre_fc_norm_hidden(H_in)) per stream                 one norm over all n*H
    R = S_i + u for every stream i                                      the embedding as residual
    R = DecoderLayer(R)                                                 QSA attention + MoE, no PLE
    logits = lm_head(mixer(R));  R goes on to the next step             two outputs per step

The layer keeps checkpoint index `mtp.layers.k` and caches at compact index k of the
draft's own pool. QSA blocks chosen on the first step are reused by later chained steps.
Embedding and LM head are the target's.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.cache.pool_geometry import PoolGeometry
from runtime.cache.qwen4_exp_pool import Qwen4ExpCacheLayout, Qwen4ExpKVPool
from runtime.core.forward_context import ForwardContext
from runtime.distributed import Mapping
from runtime.layers.embedding import VocabParallelEmbedding
from runtime.layers.gated_residual import GatedResidual
from runtime.layers.linear import ColumnParallelLinear
from runtime.layers.norm import OffsetRMSNorm
from runtime.models.base import MISSING_MTP_ADVICE, DraftModel, ParamTarget
from runtime.models.qwen4_exp import (
    EXPERT_SCHEMA,
    Qwen4ExpDecoderLayer,
    build_rope,
    cache_layout_of,
    map_checkpoint_name,
    text_config,
)


def remap_mtp_weight_name(name: str) -> str | None:
    """A checkpoint name -> the draft's own naming (`mtp.X` -> `model.X`), None for tensors
    that are not the draft's. The target's embedding and head are shared, not loaded here."""
    for prefix in ("model.language_model.", "language_model."):
        if name.startswith(prefix):
            name = name.removeprefix(prefix)
            break
    if name.startswith("model.mtp."):
        name = name.removeprefix("model.")
    if not name.startswith("mtp.") or name.startswith("mtp.shared_head.head."):
        return None
    return "model." + name.removeprefix("mtp.")


def map_mtp_checkpoint_name(name: str) -> ParamTarget | None:
    """A checkpoint name -> the draft's parameter: the draft's own naming, then the
    target's stacking and skip rules unchanged."""
    own = remap_mtp_weight_name(name)
    return None if own is None else map_checkpoint_name(own)


def num_mtp_layers(config) -> int:
    cfg = text_config(config)
    return int(
        getattr(cfg, "mtp_num_hidden_layers", None)
        or getattr(cfg, "num_nextn_predict_layers", 0)
        or 0
    )


class Qwen4ExpMultiTokenPredictor(nn.Module):
    def __init__(self, config, mapping: Mapping):
        super().__init__()
        self.config, self.hc_count, self.hidden_size = config, config.hc_count, config.hidden_size
        self.num_layers = num_mtp_layers(config)
        if self.num_layers < 1:
            raise ValueError(
                "the checkpoint config has no MTP layer (mtp_num_hidden_layers = 0). "
                + MISSING_MTP_ADVICE
            )
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, mapping.attn.tp)
        # vLLM's ColumnParallelLinear(gather_output=True): split rows, gathered back (exact)
        tp = mapping.attn.tp
        self.fc_embedding = ColumnParallelLinear(hidden, hidden, tp=tp, gather_output=True)
        self.fc_hidden = ColumnParallelLinear(hidden, hidden, tp=tp, gather_output=True)
        self.pre_fc_norm_embedding = OffsetRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(self.hc_count * hidden, eps)  # ungrouped on purpose
        self.rope = build_rope(config)
        first = config.num_hidden_layers
        self.layers = nn.ModuleList(
            Qwen4ExpDecoderLayer(
                config,
                first + k,
                mapping,
                self.rope,
                cache_layer=k,
                kind="attention",
                allow_ple=False,
            )
            for k in range(self.num_layers)
        )
        self.hyper_connection_mixer = GatedResidual(
            config.hc_count, hidden, config.hc_lowrank, eps, use_combine=False
        )

    def forward(
        self,
        ctx: ForwardContext,
        input_ids: torch.Tensor,
        prev_streams: torch.Tensor,
        spec_step_idx: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`prev_streams [T, n*H]` -> `(mixer output [T, H], streams [T, n*H])`."""
        n, hidden = self.hc_count, self.hidden_size
        u = self.fc_embedding(self.pre_fc_norm_embedding(self.embed_tokens(input_ids)))
        streams = self.fc_hidden(self.pre_fc_norm_hidden(prev_streams).view(-1, n, hidden)).flatten(
            1
        )
        streams = GatedResidual.combine(streams, u, None)
        cos, sin = self.rope.cos_sin(ctx.positions)
        layer = self.layers[spec_step_idx % self.num_layers]
        streams = layer(streams, ctx, input_ids, cos, sin, spec_step_idx)
        return self.hyper_connection_mixer(streams)[0], streams


class Qwen4ExpMTP(DraftModel):
    """`captured_hidden_states [T, n*H]`: the target's streams before its final mixer on the
    first step, the previous step's streams after that."""

    model_name = "Qwen4Exp MTP draft"
    cache_pool_class = Qwen4ExpKVPool
    expert_schema = EXPERT_SCHEMA
    text_config_of = staticmethod(text_config)

    def build_model(self, config, mapping: Mapping) -> Qwen4ExpMultiTokenPredictor:
        return Qwen4ExpMultiTokenPredictor(config, mapping)

    def canonical_spec_step(self, spec_step_idx: int) -> int:
        """The smallest step index that runs the same forward (captured steps share it): the
        step's layer (`spec_step_idx % layers`) and whether it selects QSA blocks (step 0)
        or reuses them (later steps)."""
        layers = self.model.num_layers
        if spec_step_idx < layers:
            return spec_step_idx
        return layers + spec_step_idx % layers

    @classmethod
    def cache_layout(cls, config, mapping: Mapping | None = None) -> Qwen4ExpCacheLayout:
        kinds = ("attention",) * num_mtp_layers(config)
        return cache_layout_of(config, kinds=kinds, ple_layers=(), mapping=mapping)

    def create_cache_pool(self, config, geometry: PoolGeometry) -> Qwen4ExpKVPool:
        """Chained draft steps reuse the QSA blocks the first step chose."""
        layout = self.cache_layout(config, self.mapping)
        return Qwen4ExpKVPool(layout, geometry, reuses_qsa_selection=True)

    @property
    def num_routed_experts(self) -> int:
        return self.text_config.num_experts

    def map_weight_name(self, name: str) -> ParamTarget | None:
        return map_mtp_checkpoint_name(name)


EntryClass = [Qwen4ExpMTP]
