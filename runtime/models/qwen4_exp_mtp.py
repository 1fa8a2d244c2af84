# SPDX-License-Identifier: Apache-2.0
"""Qwen4Exp MTP draft (`Qwen4ExpMTP`; seed 004, research/qwen4exp.md sections 1 and 5.5).

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

from collections.abc import Iterable

import torch
from torch import nn

from runtime.cache.pool_geometry import PoolGeometry
from runtime.cache.qwen4_exp_pool import Qwen4ExpKVPool
from runtime.core.forward_context import ForwardContext
from runtime.core.model_output import LogitsProcessorOutput
from runtime.distributed import Mapping
from runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.gated_residual import GatedResidual
from runtime.layers.linear import ReplicatedLinear
from runtime.layers.logits_processor import LogitsProcessor
from runtime.layers.norm import OffsetRMSNorm
from runtime.models.draft_common import SharesTargetEmbedHead
from runtime.models.qwen4_exp import (
    Qwen4ExpDecoderLayer,
    Qwen4ExpForCausalLM,
    build_rope,
    load_qwen4_exp_weights,
    map_checkpoint_name,
    text_config,
)

MISSING_MTP_ADVICE = (
    "Use a checkpoint that includes `mtp.*` weights, or drop "
    "--speculative-algorithm to serve without speculative decoding."
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
        self.fc_embedding = ReplicatedLinear(hidden, hidden)
        self.fc_hidden = ReplicatedLinear(hidden, hidden)
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
        input_ids,
        positions,
        prev_streams,
        input_embeds,
        ctx: ForwardContext,
        spec_step_idx: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(mixer output [T, H], streams [T, n*H])`."""
        n, hidden = self.hc_count, self.hidden_size
        embeds = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        u = self.fc_embedding(self.pre_fc_norm_embedding(embeds))
        streams = self.fc_hidden(self.pre_fc_norm_hidden(prev_streams).view(-1, n, hidden)).flatten(
            1
        )
        streams = GatedResidual.combine(streams, u, None)
        cos, sin = self.rope.cos_sin(positions)
        layer = self.layers[spec_step_idx % self.num_layers]
        streams = layer(streams, ctx, input_ids, cos, sin, spec_step_idx)
        return self.hyper_connection_mixer(streams)[0], streams


class Qwen4ExpMTP(SharesTargetEmbedHead, nn.Module):
    """Same forward contract as the target; `captured_hidden_states [T, n*H]` is required."""

    def __init__(self, config, mapping: Mapping | None = None, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config, self.mapping = config, mapping or Mapping.single()
        self.text_config = cfg = text_config(config)
        self.model = Qwen4ExpMultiTokenPredictor(cfg, self.mapping)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.mapping.attn.tp)
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
        if captured_hidden_states is None:
            raise ValueError(
                "the Qwen4Exp MTP draft needs captured_hidden_states (the target's streams "
                "before its final mixer, or the previous draft step's streams)"
            )
        sample, streams = self.model(
            input_ids, positions, captured_hidden_states, input_embeds, ctx, spec_step_idx
        )
        return self.logits_processor(sample, self.lm_head, ctx, aux_hidden=streams)

    # caches -------------------------------------------------------------------------------
    @classmethod
    def create_cache_pool(cls, config, geometry: PoolGeometry) -> Qwen4ExpKVPool:
        layout = Qwen4ExpForCausalLM.cache_layout(
            config, kinds=("attention",) * num_mtp_layers(config), ple_layers=()
        )
        return Qwen4ExpKVPool(layout, geometry, reuses_qsa_selection=True)

    # weights ------------------------------------------------------------------------------
    @staticmethod
    def map_name(name: str) -> tuple[str, tuple] | None:
        own = remap_mtp_weight_name(name)
        if own is None:
            return None
        return map_checkpoint_name(own)  # the target's stacking and skip rules apply unchanged

    def skip_checkpoint_weight(self, name: str) -> bool:
        return remap_mtp_weight_name(name) is None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tracker = load_qwen4_exp_weights(
            self,
            weights,
            self.map_name,
            shared_params=("model.embed_tokens.weight", "lm_head.weight"),
        )
        if not tracker.loaded_params:
            raise ValueError(
                "the checkpoint has no MTP weights (`mtp.*`), so it cannot draft for NEXTN "
                "speculative decoding. " + MISSING_MTP_ADVICE
            )
        tracker.raise_if_incomplete(what="Qwen4Exp MTP draft")
        return tracker.loaded_params


EntryClass = [Qwen4ExpMTP]
