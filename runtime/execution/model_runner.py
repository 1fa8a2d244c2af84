# SPDX-License-Identifier: Apache-2.0
"""`ModelRunner`: owns one built model and its cache pool; turns a `ModelInput` into a
forward.

Target and draft each get a runner; both share the `SlotTable` (request slots and token
pages), so a request's positions map to the same token slots in both. The runner is handed
a loaded model (the engine loads it); it never reads a checkpoint.

In a multi-rank replica, rank 0's runners hand every forward (and every cache commit) to a
`BatchBroadcaster` before running it, and the other ranks' runners replay the same calls
(`runtime.execution.rank_sync`), so every rank runs the same forward on its shard.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from runtime.cache.pool_geometry import PoolGeometry
from runtime.cache.slot_table import SlotTable
from runtime.configs.capture import CaptureConfig
from runtime.configs.model_config import ModelConfig
from runtime.core.forward_context import ForwardContext
from runtime.core.forward_mode import ForwardMode
from runtime.core.kv_pool import KVPool
from runtime.core.model_output import LogitsProcessorOutput
from runtime.core.pool_commands import CommitVerified, PoolCommand
from runtime.execution.graph_runner import GraphRunner
from runtime.execution.model_input import DEFAULT_ROWS, DRAFT, TARGET, HiddenRows, ModelInput
from runtime.kernels import cpu_extension

# the input types live in `model_input` (both runners read them); their users import them
# from here too
__all__ = ["DRAFT", "TARGET", "HiddenRows", "ModelInput", "ModelRunner"]

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        slot_table: SlotTable,
        max_tokens_per_pass: int = 1,
        device: str = "cpu",
        role: str = TARGET,
        capture: CaptureConfig | None = None,
        verify_width: int | None = None,
    ):
        """`max_tokens_per_pass`: the most positions a pass writes that a later one may
        rewrite (the rings' slack). `verify_width`: the rows per request of a verify round
        and of the draft's pass over it (default `max_tokens_per_pass`), the width captured
        verify-shaped steps run at."""
        self.model, self.model_config = model, model_config
        self.slot_table, self.device, self.role = slot_table, device, role
        self.verify_width = verify_width or max_tokens_per_pass
        self.broadcaster = None  # rank 0 of a multi-rank replica: see `rank_sync`
        geometry = PoolGeometry(
            max_reqs=slot_table.req_pool.max_reqs,
            num_pages=slot_table.allocator.num_pages,  # the pools add the scratch page
            page_size=slot_table.page_size,
            max_tokens_per_pass=max_tokens_per_pass,
            dtype=model_config.dtype,
            device=device,
            max_context=slot_table.req_pool.max_context_len,
        )
        self.kv_pool: KVPool = self.model.create_cache_pool(model_config.hf_config, geometry)
        logger.info("%s", self.kv_pool.describe())
        self.graph_runner = None
        if capture is not None and capture.enabled:
            self.graph_runner = GraphRunner(self, capture, slot_table.req_pool.max_reqs)
            if self.graph_runner.capturable:
                logger.info("%s", self.graph_runner.describe())
        compiles = self.graph_runner is not None and self.graph_runner.capturable
        if torch.device(device).type == "cpu" and not compiles:
            # a graph runner loads the C++ kernels before its first compile; without one the
            # eager steps still use them (faster than torch's forms in prefill and decode)
            cpu_extension.load((capture or CaptureConfig()).resolved_cache_dir())

    def compile_fingerprint(self) -> dict:
        """What a captured step calling this runner can bake in (`step_store.fingerprint`):
        its model's structure and configuration and its caches' layout, not the run-time
        state of its graph runner or slot table."""
        return {
            "role": self.role,
            "device": str(self.device),
            "verify_width": self.verify_width,
            "dtype": self.model_config.dtype,
            "config": self.model_config.hf_config.to_dict(),
            "model": self.model,
            "kv_pool": self.kv_pool,
            "req_to_token": self.slot_table.req_to_token,
        }

    def captures(self, inp: ModelInput) -> bool:
        """Whether `inp` has a captured step (compiled or not yet) rather than running
        eagerly."""
        return self.graph_runner is not None and self.graph_runner.step_key(inp) is not None

    def build_context(self, inp: ModelInput) -> ForwardContext:
        rows = inp.logits_row_indices
        if rows is DEFAULT_ROWS:
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
        if inp.logits_row_indices is DEFAULT_ROWS and inp.forward_mode in (
            ForwardMode.EXTEND,
            ForwardMode.DRAFT_EXTEND,
        ):
            ctx.logits_row_indices = ctx.last_row_per_request()
        ctx.attn_metadata = self.kv_pool.prepare(ctx)
        return ctx

    def call_model(
        self,
        ctx: ForwardContext,
        input_ids: torch.Tensor,
        captured_hidden_states: torch.Tensor | None,
        spec_step_idx: int,
    ) -> LogitsProcessorOutput:
        """The model forward on a prepared context (what a captured step records)."""
        return self.model(ctx, input_ids, captured_hidden_states, spec_step_idx)

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> LogitsProcessorOutput:
        if self.broadcaster is not None:
            with self.broadcaster.forward(self.role, inp):
                return self.run(inp)
        return self.run(inp)

    def run(self, inp: ModelInput) -> LogitsProcessorOutput:
        """The forward on this rank alone (other ranks run theirs from the broadcast): the
        captured step where there is one, else eagerly."""
        if self.graph_runner is not None:
            out = self.graph_runner.try_forward(inp)
            if out is not None:
                return out
        ctx = self.build_context(inp)
        return self.call_model(
            ctx, inp.input_ids.to(self.device), inp.captured_hidden_states, inp.spec_step_idx
        )

    @torch.inference_mode()
    def draft_round(
        self, inp: ModelInput, chain_positions: list[int], num_steps: int
    ) -> torch.Tensor | None:
        """A greedy draft round in one captured graph (`GraphRunner.try_draft_round`): the
        drafts `[bs, num_steps]`, or None where the round must run step by step (no
        captured steps, a multi-rank replica, a batch that is not capturable, or a bucket
        still compiling)."""
        if self.graph_runner is None or self.broadcaster is not None:
            return None
        return self.graph_runner.try_draft_round(inp, chain_positions, num_steps)

    def commit_verified(self, req_pool_indices: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Keep the caches' state after each request's accepted rows (recurrent states); the
        same on every rank of a replica."""
        self.apply(CommitVerified(req_pool_indices, num_accepted))

    def apply(self, command: PoolCommand, local: bool = False) -> None:
        """Run `command` on this runner's pool here and, on rank 0 of a replica, on every
        other rank: any change to the caches outside a forward goes through this (the
        command travels pickled, tensors via the CPU). `local=True` runs it on this rank
        only (a replayed command)."""
        if self.broadcaster is not None and not local:
            self.broadcaster.pool_command(self.role, command)
        command.apply(self.kv_pool)
