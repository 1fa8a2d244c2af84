# SPDX-License-Identifier: Apache-2.0
"""`ModelRunner`: owns one built model and its cache pool; turns a `ModelInput` into a
forward.

Target and draft each get a runner; both share the `SlotTable` (request slots and token
pages), so a request's positions map to the same token slots in both. The runner is handed
a loaded model (the engine loads it); it never reads a checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from runtime.cache.pool_geometry import PoolGeometry
from runtime.cache.slot_table import SlotTable
from runtime.configs.model_config import ModelConfig
from runtime.core.forward_context import ForwardContext
from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.core.model_output import LogitsProcessorOutput

logger = logging.getLogger(__name__)

_DEFAULT_ROWS = object()


@dataclass
class ModelInput:
    """One forward's worth of work, in scheduler terms (no tensors of the model)."""

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T] new tokens, request after request
    req_pool_indices: list[int]
    prefix_lens: list[int]  # tokens of each request already in the cache
    extend_lens: list[int]  # new tokens of each request in `input_ids`
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    captured_hidden_states: torch.Tensor | None = None  # draft input: target hidden per row
    logits_row_indices: object = field(default=_DEFAULT_ROWS)  # rows to score; default by mode
    spec_step_idx: int = 0


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        slot_table: SlotTable,
        max_tokens_per_pass: int = 1,
        device: str = "cpu",
    ):
        self.model, self.model_config = model, model_config
        self.slot_table, self.device = slot_table, device
        geometry = PoolGeometry(
            max_reqs=slot_table.req_pool.max_reqs,
            num_pages=slot_table.allocator.num_pages,
            page_size=slot_table.page_size,
            max_tokens_per_pass=max_tokens_per_pass,
            dtype=model_config.dtype,
            device=device,
            max_context=slot_table.req_pool.max_context_len,
        )
        self.kv_pool = self.model.create_cache_pool(model_config.hf_config, geometry)
        logger.info("%s", self.kv_pool.describe())

    def build_context(self, inp: ModelInput) -> ForwardContext:
        rows = inp.logits_row_indices
        if rows is _DEFAULT_ROWS:
            rows = None
        ctx = ForwardContext.build(
            inp.forward_mode,
            inp.req_pool_indices,
            inp.prefix_lens,
            inp.extend_lens,
            out_cache_loc=None,
            req_to_token=self.slot_table.req_to_token,
            kv_pool=self.kv_pool,
            capture_hidden_mode=inp.capture_hidden_mode,
            logits_row_indices=rows,
        )
        if inp.logits_row_indices is _DEFAULT_ROWS and inp.forward_mode in (
            ForwardMode.EXTEND,
            ForwardMode.DRAFT_EXTEND,
        ):
            ctx.logits_row_indices = ctx.last_row_per_request()
        return ctx

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> LogitsProcessorOutput:
        ctx = self.build_context(inp)
        return self.model(
            ctx, inp.input_ids.to(self.device), inp.captured_hidden_states, inp.spec_step_idx
        )
