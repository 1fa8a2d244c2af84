# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V4 MTP (NextN) draft model, after TokenSpeed's `deepseek_nextn.py` and vLLM's
`deepseek_mtp.py` (the block itself is transformers' `DeepseekV4DecoderLayer`).

Per row at position i, with the target's pre-`hc_head` streams `h_i [hc, H]` and the
embedding of the *next* token `t_{i+1}`:

    e = enorm(embed(t_{i+1}))           (zero at position 0, as TokenSpeed/vLLM do)
    X = h_proj(hnorm(h_i)) + e_proj(e)  h_proj per stream, e broadcast: [hc, H]
    X = DecoderBlock(X)                 a V4 block, window-only attention, learned routing
    logits = head(norm(hc_head(X)))     its own hc_head and norm, the target's head

and it predicts `t_{i+2}`. Chained draft steps feed `X` back as the next step's `h`. The
block keeps its global checkpoint layer id (`num_hidden_layers + k`) for config look-ups
and names, while its KV lives at compact index `k` of the draft's own cache pool.
Embedding and LM head are the target's (`set_embed_and_head`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from runtime.cache.deepseek_v4_pool import DeepseekV4CacheLayout, DeepseekV4KVPool
from runtime.core.forward_context import ForwardContext
from runtime.distributed import Mapping
from runtime.layers.attention.deepseek_v4 import RopeInputs
from runtime.layers.embedding import VocabParallelEmbedding
from runtime.layers.hyper_connection import hc_head
from runtime.layers.linear import ColumnParallelLinear
from runtime.layers.norm import RMSNorm
from runtime.layers.weight_utils import make_param
from runtime.models.base import MISSING_MTP_ADVICE, DraftModel, ParamTarget
from runtime.models.deepseek_v4 import (
    EXPERT_SCHEMA,
    DeepseekV4DecoderLayer,
    build_ropes,
    cache_layout_of,
    map_released_name,
    rope_inputs,
)

# Tensors that sit on the MTP layer itself; everything else belongs to its decoder block.
_LAYER_LEVEL = (
    "enorm.",
    "hnorm.",
    "e_proj.",
    "h_proj.",
    "hc_head_fn",
    "hc_head_base",
    "hc_head_scale",
    "shared_head.",
)
_MTP_PREFIX = re.compile(r"^mtp\.(\d+)\.(.*)$")
_SPEC_LAYER_PREFIX = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def remap_mtp_name(name: str, num_hidden_layers: int, num_mtp_layers: int) -> str | None:
    """A checkpoint name of the draft -> released-style `layers.{L+k}...` name, or None.

    Accepts the released `mtp.{k}.*` names and the `model.layers.{L+k}.*` spelling other
    engines write. The embedding and head (`emb.tok_emb`, `head`) are skipped: the draft
    shares the target's. The bare `mtp.{k}.norm.weight` is the MTP's final norm
    (`shared_head.norm`); the rest of the non-layer-level names belong to `mtp_block`.
    """
    match = _MTP_PREFIX.match(name)
    if match is not None:
        k, rest = int(match[1]), match[2]
    else:
        match = _SPEC_LAYER_PREFIX.match(name)
        if match is None:
            return None
        k, rest = int(match[1]) - num_hidden_layers, match[2]
    if not 0 <= k < num_mtp_layers:
        return None
    rest = rest.removeprefix("mtp_block.")
    if rest.startswith(("emb.tok_emb.", "embed_tokens.", "head.", "shared_head.head.")):
        return None
    if rest == "norm.weight":
        rest = "shared_head.norm.weight"
    elif not rest.startswith(_LAYER_LEVEL):
        rest = "mtp_block." + rest
    return f"layers.{num_hidden_layers + k}.{rest}"


class DeepseekV4MTPSharedHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV4MultiTokenPredictorLayer(nn.Module):
    def __init__(self, config, layer_id: int, cache_layer: int, mapping: Mapping):
        super().__init__()
        self.config, self.layer_id, self.hc_mult = config, layer_id, config.hc_mult
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        # split by output rows and gathered back (exact), so no rank holds the whole matrix
        tp = mapping.attn.tp
        self.e_proj = ColumnParallelLinear(hidden, hidden, tp=tp, gather_output=True)
        self.h_proj = ColumnParallelLinear(hidden, hidden, tp=tp, gather_output=True)
        self.hc_head_fn = make_param((config.hc_mult, config.hc_mult * hidden), torch.float32)
        self.hc_head_base = make_param((config.hc_mult,), torch.float32)
        self.hc_head_scale = make_param((1,), torch.float32)
        self.shared_head = DeepseekV4MTPSharedHead(config)
        self.mtp_block = DeepseekV4DecoderLayer(config, layer_id, mapping, cache_layer=cache_layer)

    def forward(
        self,
        ctx: ForwardContext,
        input_ids: torch.Tensor,
        prev_hidden: torch.Tensor,
        embeds: torch.Tensor,
        ropes: dict[str, RopeInputs],
    ) -> torch.Tensor:
        """`prev_hidden [T, hc*H]`, `embeds [T, H]` -> the block's output streams `[T, hc, H]`."""
        embeds = embeds.masked_fill((ctx.positions == 0).unsqueeze(-1), 0)
        embeds = self.enorm(embeds)
        streams = self.hnorm(prev_hidden.view(-1, self.hc_mult, self.config.hidden_size))
        x = self.h_proj(streams) + self.e_proj(embeds).unsqueeze(1)
        return self.mtp_block(x, ctx, input_ids, ropes)

    def logits_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        y = hc_head(
            streams,
            self.hc_head_fn,
            self.hc_head_scale,
            self.hc_head_base,
            cfg.rms_norm_eps,
            cfg.hc_eps,
        )
        return self.shared_head.norm(y)


class DeepseekV4MultiTokenPredictor(nn.Module):
    def __init__(self, config, mapping: Mapping):
        super().__init__()
        self.config = config
        self.first_layer_id = config.num_hidden_layers
        self.num_mtp_layers = config.num_nextn_predict_layers
        if self.num_mtp_layers < 1:
            raise ValueError(
                "the checkpoint config has num_nextn_predict_layers = 0: it has no MTP "
                "layer to draft with. " + MISSING_MTP_ADVICE
            )
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, mapping.attn.tp
        )
        self.layers = nn.ModuleDict(
            {
                str(self.first_layer_id + k): DeepseekV4MultiTokenPredictorLayer(
                    config, self.first_layer_id + k, cache_layer=k, mapping=mapping
                )
                for k in range(self.num_mtp_layers)
            }
        )
        self.ropes = nn.ModuleDict(build_ropes(config))

    def layer_for_step(self, spec_step_idx: int) -> DeepseekV4MultiTokenPredictorLayer:
        return self.layers[str(self.first_layer_id + spec_step_idx % self.num_mtp_layers)]

    def forward(
        self,
        ctx: ForwardContext,
        input_ids: torch.Tensor,
        prev_hidden: torch.Tensor,
        spec_step_idx: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`prev_hidden [T, hc*H]` -> `(normed hidden [T, H], output streams [T, hc*H])`."""
        layer = self.layer_for_step(spec_step_idx)
        ropes = rope_inputs(self.ropes.items(), ctx.positions)
        streams = layer(ctx, input_ids, prev_hidden, self.embed_tokens(input_ids), ropes)
        return layer.logits_hidden(streams), streams.flatten(1)


class DeepseekV4ForCausalLMNextN(DraftModel):
    """`captured_hidden_states [T, hc*H]`: the target's pre-`hc_head` streams on the first
    step, the previous step's output after that. The output's hidden states are this step's
    streams `[T or R, hc*H]`, for chaining."""

    model_name = "DeepSeek-V4 MTP draft"
    missing_weights_name = "MTP (NextN)"
    cache_pool_class = DeepseekV4KVPool
    expert_schema = EXPERT_SCHEMA

    def build_model(self, config, mapping: Mapping) -> DeepseekV4MultiTokenPredictor:
        return DeepseekV4MultiTokenPredictor(config, mapping)

    def canonical_spec_step(self, spec_step_idx: int) -> int:
        """The smallest step index that runs the same forward (captured steps share it)."""
        return spec_step_idx % self.model.num_mtp_layers

    @property
    def kv_reach(self) -> int | None:
        """The window when every MTP layer is window-only (a row's KV depends on that row
        alone), None when a layer compresses (its entries need every row)."""
        if any(self.cache_layout(self.config).compress_ratios):
            return None
        return self.config.sliding_window

    @classmethod
    def cache_layout(cls, config, mapping: Mapping | None = None) -> DeepseekV4CacheLayout:
        first = config.num_hidden_layers
        return cache_layout_of(config, range(first, first + config.num_nextn_predict_layers))

    @property
    def num_routed_experts(self) -> int:
        return self.config.n_routed_experts

    def map_weight_name(self, name: str) -> ParamTarget | None:
        """Only the draft's tensors; the trunk's are the target's business."""
        cfg = self.config
        released = remap_mtp_name(name, cfg.num_hidden_layers, cfg.num_nextn_predict_layers)
        return None if released is None else map_released_name(released)


EntryClass = [DeepseekV4ForCausalLMNextN]
