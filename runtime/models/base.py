# SPDX-License-Identifier: Apache-2.0
"""What every model entry class shares, target or MTP draft.

An entry class, named after the HF architecture it serves and exported as `EntryClass`,
holds `self.model`, `self.lm_head` and a `LogitsProcessor`; this base owns the rest: built
as `Cls(hf_config, mapping)`, one forward signature for targets and drafts alike,

      forward(ctx, input_ids [T], captured_hidden_states [T, D] | None, spec_step_idx)
          -> LogitsProcessorOutput   logits at `ctx.logits_row_indices`, captured hidden

(positions, slots and batch layout come from the `ForwardContext`); `create_cache_pool`
from the class's `cache_layout` for this rank's share; weight loading through the model
file's name tables (`map_weight_name`) and the MoE checkpoint loader, where a parameter
left unfilled is an error naming it; a target LM head tied to its embedding
(`tie_word_embeddings`, as transformers saves tied models); for MTP drafts the embedding
and LM head shared with the target. A model file holds its blocks, name tables and a few
class attributes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from runtime.cache.pool_geometry import PoolGeometry
from runtime.core.forward_context import ForwardContext
from runtime.core.model_output import LogitsProcessorOutput
from runtime.distributed import Mapping
from runtime.layers.embedding import HotVocabLMHead, ParallelLMHead
from runtime.layers.logits_processor import LogitsProcessor
from runtime.layers.moe import ExpertCheckpointSchema, MoECheckpointLoader
from runtime.layers.weight_utils import WeightLoadTracker

MISSING_MTP_ADVICE = (
    "Use a checkpoint that includes `mtp.*` weights, or drop "
    "--speculative-algorithm to serve without speculative decoding."
)


class ParamTarget(NamedTuple):
    """Where a checkpoint tensor goes: a runtime parameter and the extra arguments of its
    `weight_loader` (the shard id of a stacked parameter)."""

    param: str
    loader_args: tuple = ()


class CausalLMBase(nn.Module):
    """Construction, forward, cache pool and weight loading of an entry class.

    Subclasses set `model_name` (how errors name it), `cache_pool_class`, `expert_schema`,
    and implement `build_model`, `cache_layout`, `map_weight_name`, `num_routed_experts`.
    """

    model_name: ClassVar[str]
    cache_pool_class: ClassVar[type]
    expert_schema: ClassVar[ExpertCheckpointSchema]

    def __init__(self, config, mapping: Mapping | None = None):
        super().__init__()
        self.config, self.mapping = config, mapping or Mapping.single()
        self.text_config = cfg = self.text_config_of(config)
        self.model = self.build_model(cfg, self.mapping)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.mapping.attn.tp)
        self.logits_processor = LogitsProcessor()

    @staticmethod
    def text_config_of(config):
        """The config the blocks read (a multimodal checkpoint nests its text config)."""
        return config

    def build_model(self, config, mapping: Mapping) -> nn.Module:
        raise NotImplementedError

    # forward ------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        ctx: ForwardContext,
        input_ids: torch.Tensor,
        captured_hidden_states: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> LogitsProcessorOutput:
        """`input_ids [T]`; `captured_hidden_states [T, D]` feeds a draft (targets ignore it);
        `spec_step_idx` is the draft step (0 for the extend over verified rows)."""
        hidden, streams = self.run_model(ctx, input_ids, captured_hidden_states, spec_step_idx)
        return self.logits_processor(hidden, self.lm_head, ctx, aux_hidden=streams)

    def run_model(
        self,
        ctx: ForwardContext,
        input_ids: torch.Tensor,
        captured_hidden_states: torch.Tensor | None,
        spec_step_idx: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden the LM head reads `[T, H]`, streams a draft consumes `[T, D]`)."""
        raise NotImplementedError

    def get_embed_and_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.embed_tokens.weight, self.lm_head.weight

    # caches -------------------------------------------------------------------------------
    @classmethod
    def cache_layout(cls, config, mapping: Mapping | None = None):
        """What the caches hold for one rank of `mapping` (heads it owns, ...)."""
        raise NotImplementedError

    def create_cache_pool(self, config, geometry: PoolGeometry):
        """This rank's cache pool, sized from its own share of the layers."""
        return self.cache_pool_class(self.cache_layout(config, self.mapping), geometry)

    # weights ------------------------------------------------------------------------------
    def map_weight_name(self, name: str) -> ParamTarget | None:
        """A checkpoint name -> its runtime parameter; None for tensors this model skips.
        Per-expert names keep their `experts.E.<proj>` form for the MoE checkpoint loader."""
        raise NotImplementedError

    @property
    def num_routed_experts(self) -> int:
        raise NotImplementedError

    def shared_params(self) -> tuple[str, ...]:
        """Parameters another tensor provides (tied or the target's); not loaded here."""
        return ()

    def skip_checkpoint_weight(self, name: str) -> bool:
        """Tensors the loader need not even read (a tied head's copy among them)."""
        target = self.map_weight_name(name)
        return target is None or target.param in self.shared_params()

    def fill_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> WeightLoadTracker:
        """Feed checkpoint tensors to the parameters; the tracker says what was filled,
        what was unexpected and what is missing."""
        shared = set(self.shared_params())
        tracker = WeightLoadTracker({n: p for n, p in self.named_parameters() if n not in shared})
        ep = self.mapping.moe.ep
        experts = MoECheckpointLoader(self.expert_schema, self.num_routed_experts, ep.rank, ep.size)
        for raw_name, tensor in weights:
            target = self.map_weight_name(raw_name)
            if target is None:
                continue
            expert = experts.map(target.param)
            if expert is None:
                tracker.load(raw_name, target.param, tensor, *target.loader_args)
            elif expert.local:
                tracker.load(raw_name, expert.param, tensor, expert.shard_id, expert.expert_id)
        return tracker

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Raises on a missing or mis-shaped tensor, naming it."""
        tracker = self.fill_weights(weights)
        tracker.raise_if_incomplete(what=self.model_name)
        return tracker.loaded_params


class TargetModel(CausalLMBase):
    """A model served on its own; with hidden capture its output carries the streams its
    MTP draft (`draft_architecture`) consumes."""

    draft_architecture: ClassVar[str]

    def __init__(self, config, mapping: Mapping | None = None):
        super().__init__(config, mapping)
        if self.ties_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def ties_word_embeddings(self) -> bool:
        """The LM head is the embedding (`tie_word_embeddings`, as in transformers'
        `_tied_weights_keys`): a checkpoint holds the embedding only, and one written with
        both has its `lm_head.weight` ignored, as transformers ties after loading."""
        return bool(getattr(self.text_config, "tie_word_embeddings", False))

    def shared_params(self) -> tuple[str, ...]:
        return ("lm_head.weight",) if self.ties_word_embeddings else ()

    @staticmethod
    def has_draft_layers(config) -> bool:
        """Whether the checkpoint config declares MTP layers to draft with."""
        raise NotImplementedError

    def run_model(self, ctx, input_ids, captured_hidden_states, spec_step_idx):
        return self.model(ctx, input_ids)


class DraftModel(CausalLMBase):
    """An MTP draft: `self.model(ctx, input_ids, prev_hidden, spec_step_idx)` over the
    target's hidden streams (first step) or its own previous output (chained steps), with
    the target's embedding and LM head."""

    missing_weights_name: ClassVar[str] = "MTP"  # what "the checkpoint has no ... weights" says

    def run_model(self, ctx, input_ids, captured_hidden_states, spec_step_idx):
        if captured_hidden_states is None:
            raise ValueError(
                f"the {self.model_name} needs captured_hidden_states: the target's hidden "
                "streams, or the previous draft step's"
            )
        return self.model(ctx, input_ids, captured_hidden_states, spec_step_idx)

    @property
    def kv_reach(self) -> int | None:
        """How far back a draft row's attention reads when that is bounded (None: every
        row matters). With a bound the drafter may skip older prompt rows."""
        return None

    def shared_params(self) -> tuple[str, ...]:
        return ("model.embed_tokens.weight", "lm_head.weight")

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        """Point at the target's tensors (no copy); the draft's own are dropped."""
        del self.model.embed_tokens.weight
        del self.lm_head.weight
        self.model.embed_tokens.weight = embed
        self.lm_head.weight = head

    def use_hot_vocab(self, hot_ids: Sequence[int]) -> None:
        """Score only `hot_ids` from now on (`HotVocabLMHead`); call after
        `set_embed_and_head`, whose head it copies rows of."""
        self.lm_head = HotVocabLMHead(self.lm_head, hot_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tracker = self.fill_weights(weights)
        if not tracker.loaded_params:
            raise ValueError(
                f"the checkpoint has no {self.missing_weights_name} weights (`mtp.*`), so it "
                "cannot draft for NEXTN speculative decoding. " + MISSING_MTP_ADVICE
            )
        tracker.raise_if_incomplete(what=self.model_name)
        return tracker.loaded_params
