# SPDX-License-Identifier: Apache-2.0
"""`GraphRunner`: decode, verify and draft steps replayed from captured graphs, a facade over
three parts (SGLang's `CudaGraphRunner` capture/replay split, mini-sglang's `engine/graph.py`):

- `step_keys`: which captured step (`StepKey`: kind and batch bucket) runs a batch;
- `step_compiler`: the steps, their compile scheduling (background or inline) and the step
  store (precompiled CPU steps kept on disk);
- `capture_buffer`: CUDA graphs' static buffers, recording and replay.

What stays here is the batch itself: the live batch is padded up to its bucket with copies
of the padding request (whose rows read and write only the caches' padding rows), the pool
prepares its metadata at the bucket's shapes (what grows with the context rounded up to
`ENTRY_MULTIPLE`, or to the context maximum for CUDA graphs), the step runs, and logits and
hidden states are sliced back to the live rows. Three kinds of step run here: the model
step, a whole greedy draft round (`draft_round_function`) and a caller's recipe (the fused
NEXTN round). A step not ready yet returns None: the caller runs it eagerly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from runtime.cache.slot_table import SlotTable
from runtime.configs.capture import CaptureConfig
from runtime.core.forward_context import ForwardContext
from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.core.model_output import LogitsProcessorOutput
from runtime.execution.draft_chain import draft_chain
from runtime.execution.model_input import ModelInput
from runtime.execution.step_compiler import CapturedStep, StepCompiler, StepRecipe, StepState
from runtime.execution.step_keys import (
    LOGITS_ALL,
    LOGITS_PER_REQUEST,
    StepKey,
    StepKeys,
    logits_rows_of,
)

# what callers of the captured steps name (their modules are this one's parts)
__all__ = [
    "LOGITS_ALL",
    "LOGITS_PER_REQUEST",
    "GraphRunner",
    "StepKey",
    "StepRecipe",
    "StepRunner",
    "StepState",
    "draft_round_function",
    "no_new_compiles",
]

ENTRY_MULTIPLE = 16  # compressed-entry counts are padded to this (CPU: a dynamic dim anyway)


class StepRunner(Protocol):
    """What a `GraphRunner` reads of the runner it captures steps for (`ModelRunner` is
    one): a protocol, so that `model_runner` imports this module and not the reverse."""

    device: str
    model: nn.Module
    slot_table: SlotTable
    kv_pool: object  # the model's cache pool (`capturable`, `prepare`)
    verify_width: int

    def call_model(
        self,
        ctx: ForwardContext,
        input_ids: torch.Tensor,
        captured_hidden_states: torch.Tensor | None,
        spec_step_idx: int,
    ) -> LogitsProcessorOutput: ...


class GraphRunner:
    def __init__(self, runner: StepRunner, config: CaptureConfig, max_running_requests: int):
        self.runner, self.config = runner, config
        self.device = torch.device(runner.device)
        self.cuda = self.device.type == "cuda"
        self.pad_req = runner.slot_table.req_pool.pad_req
        self.max_context = runner.slot_table.req_pool.max_context_len
        self.keys = StepKeys(config.buckets(max_running_requests), runner)
        self.compiler = StepCompiler(
            config,
            self.device,
            self.keys.buckets,
            self._step_body,
            self._padding_args,
            role=getattr(runner, "role", ""),
        )

    # --- which steps (`step_keys`) -------------------------------------------------------
    @property
    def capturable(self) -> bool:
        return bool(getattr(self.runner.kv_pool, "capturable", False))

    @property
    def buckets(self):
        return self.keys.buckets

    def bucket_for(self, batch_size: int) -> int | None:
        return self.keys.bucket_for(batch_size)

    def step_key(self, inp: ModelInput) -> StepKey | None:
        """The captured step that runs `inp`, or None when it must run eagerly."""
        return self.keys.step_key(inp) if self.capturable else None

    def round_key(self, inp: ModelInput, num_steps: int) -> StepKey | None:
        """`StepKeys.round_key`: the captured draft round of the extend `inp`, or None."""
        return self.keys.round_key(inp, num_steps) if self.capturable else None

    # --- compiling (`step_compiler`) -----------------------------------------------------
    @property
    def compiles_on_demand(self) -> bool:
        return self.compiler.compiles_on_demand

    @compiles_on_demand.setter
    def compiles_on_demand(self, value: bool) -> None:
        self.compiler.compiles_on_demand = value

    @property
    def unsettled_runs(self) -> int:
        return self.compiler.unsettled_runs

    def captured_step(
        self, key: StepKey, hidden: torch.Tensor | None = None, recipe: StepRecipe | None = None
    ) -> CapturedStep:
        return self.compiler.captured_step(key, hidden, recipe)

    def compile_step(self, step: CapturedStep) -> None:
        self.compiler.compile_step(step)

    def compile_buckets(self, buckets, wanted: Callable[[StepKey], bool] | None = None) -> None:
        self.compiler.compile_buckets(buckets, wanted)

    def wait_until_idle(self, timeout: float | None = None) -> bool:
        return self.compiler.wait_until_idle(timeout)

    def loading(self, key: StepKey) -> bool:
        return self.compiler.loading(key)

    def no_new_compiles(self):
        return self.compiler.no_new_compiles()

    def configure_regions(self) -> None:
        self.compiler.configure_regions()

    def _step_body(self, key: StepKey, recipe: StepRecipe | None) -> Callable:
        """What the step of `key` runs: the recipe's body, a draft round, or the model."""
        if recipe is not None:
            return recipe.body
        if key.draft_steps:
            return draft_round_function(self.runner, key)
        call_model = self.runner.call_model

        def step(ctx, input_ids, hidden, spec_step_idx):
            out = call_model(ctx, input_ids, hidden, spec_step_idx)
            return out.next_token_logits, out.hidden_states

        return step

    def _padding_args(self, step: CapturedStep) -> tuple:
        """The step's arguments for a batch of padding rows only."""
        key = step.key
        if step.recipe is not None:
            return step.recipe.padding_args(key.bucket)
        inp = self._padding_input(step)
        if key.draft_steps:
            return (*self.padded_round(inp, [], key), key.spec_step_idx)
        return (*self.padded_batch(inp, key), key.spec_step_idx)

    def _padding_input(self, step: CapturedStep) -> ModelInput:
        """A zero-request input of the step's shape (padding fills the whole bucket)."""
        key = step.key
        return ModelInput(
            key.mode,
            torch.zeros(0, dtype=torch.long),
            [],
            [],
            [],
            capture_hidden_mode=key.capture_hidden,
            captured_hidden_states=step.hidden_like,
            logits_row_indices=[] if key.logits == LOGITS_PER_REQUEST else None,
            spec_step_idx=key.spec_step_idx,
        )

    # --- running -------------------------------------------------------------------------
    def try_forward(self, inp: ModelInput) -> LogitsProcessorOutput | None:
        """Run `inp` through its captured step; None when it is not capturable or its bucket
        is not compiled yet (the caller then runs it eagerly)."""
        key = self.step_key(inp)
        if key is None:
            return None
        step = self.compiler.ready_step(key, inp.captured_hidden_states)
        if step is None:
            return None
        batch = self.padded_batch(inp, step.key)
        return self._run(step, batch, len(inp.extend_lens))

    def try_draft_round(
        self, inp: ModelInput, chain_positions: list[int], num_steps: int
    ) -> torch.Tensor | None:
        """A whole greedy draft round in one captured graph (SGLang's
        `EAGLEDraftCudaGraphRunner` runs every draft step of a round in one graph): the
        extend `inp` over the verified rows, each request's next token the argmax of its
        gather row, then `num_steps - 1` single-token steps, request b's first at position
        `chain_positions[b]`, each fed the previous step's argmax and hidden state. The
        metadata of every step is prepared before the graph runs (the chained steps'
        positions follow the gather rows, known on the host). Returns the drafts
        `[bs, num_steps]`, or None when the round must run step by step (not capturable,
        or its bucket is not compiled yet)."""
        key = self.round_key(inp, num_steps)
        if key is None:
            return None
        step = self.compiler.ready_step(key, inp.captured_hidden_states)
        if step is None:
            return None
        batch = self.padded_round(inp, chain_positions, step.key)
        return self._run(step, batch, len(inp.extend_lens)).next_token_logits

    def try_recipe(
        self, key: StepKey, recipe: StepRecipe, live_args: Callable[[int], tuple]
    ) -> tuple | None:
        """Run the caller-defined step `recipe` (`key.recipe` names it) on
        `live_args(bucket)`, the live batch padded to the bucket of the ready step (its own,
        or a larger one while its own compiles). Returns the step's outputs at the bucket's
        size (the caller slices its live rows), or None when no bucket is ready (the caller
        then runs the work another way)."""
        step = self.compiler.ready_step(key, None, recipe)
        if step is None:
            return None
        outputs = self.compiler.call(step, live_args(step.key.bucket))
        if self.cuda:
            return tuple(o.clone() for o in outputs)  # the next replay overwrites them
        return outputs

    def padded_batch(
        self, inp: ModelInput, key: StepKey
    ) -> tuple[ForwardContext, torch.Tensor, object]:
        """The live batch padded to `key.bucket` requests: (context with metadata, input ids,
        hidden states or None)."""
        bs, q, pad = len(inp.extend_lens), key.rows_per_req, key.bucket - len(inp.extend_lens)
        rows = logits_rows_of(inp, q)
        if rows is not None:
            rows = [int(r) for r in rows] + [(bs + j) * q + q - 1 for j in range(pad)]
        ctx = self.prepared_context(
            key.mode,
            list(inp.req_pool_indices) + [self.pad_req] * pad,
            list(inp.prefix_lens) + [0] * pad,
            q,
            key.capture_hidden,
            rows,
        )
        # always fresh tensors made here (under inference mode, like the metadata), so every
        # call presents the graph the same kind of tensor
        ids = inp.input_ids.to(self.device)
        ids = torch.cat([ids, ids.new_zeros(pad * q)])
        hidden = inp.captured_hidden_states
        if hidden is not None:
            hidden = torch.cat([hidden, hidden.new_zeros((pad * q, hidden.shape[1]))])
        return ctx, ids, hidden

    def padded_round(
        self, inp: ModelInput, chain_positions: list[int], key: StepKey
    ) -> tuple[tuple[ForwardContext, ...], torch.Tensor, torch.Tensor]:
        """A draft round's batch padded to `key.bucket`: (the extend's context, then one
        context per chained step, with metadata; the extend's input ids; hidden states)."""
        ctx, ids, hidden = self.padded_batch(inp, key)
        pad = key.bucket - len(chain_positions)
        pools = list(inp.req_pool_indices) + [self.pad_req] * pad
        contexts = [ctx]
        for i in range(1, key.draft_steps):
            positions = [p + i - 1 for p in chain_positions] + [0] * pad
            contexts.append(
                self.prepared_context(
                    ForwardMode.DECODE, pools, positions, 1, CaptureHiddenMode.LAST, None
                )
            )
        return tuple(contexts), ids, hidden

    def prepared_context(
        self,
        mode,
        req_pool_indices,
        prefix_lens,
        rows_per_req,
        capture_hidden,
        logits_rows=None,
        *,
        reach: int = 0,
    ) -> ForwardContext:
        """A padded batch's context of `rows_per_req` rows per request, its metadata prepared
        at the bucket's shapes (also for a caller-defined step, `try_recipe`).
        `logits_rows`: None for every row. `reach`: the entry counts also cover positions
        that far past the batch's rows (a captured step that derives later steps' metadata
        from these, `prepare_in_step`)."""
        ctx = ForwardContext.build(
            mode,
            req_pool_indices,
            prefix_lens,
            [rows_per_req] * len(req_pool_indices),
            out_cache_loc=None,
            req_to_token=self.runner.slot_table.req_to_token,
            kv_pool=self.runner.kv_pool,
            capture_hidden_mode=capture_hidden,
            logits_row_indices=logits_rows,
        )
        entries = self._entries
        if reach:
            longest = max(ctx.seq_lens_cpu, default=0) + reach

            def entries(ratio: int, needed: int) -> int:
                return self._entries(ratio, max(needed, -(-longest // ratio)))

        ctx.attn_metadata = self.runner.kv_pool.prepare(ctx, entries)
        return ctx

    def _entries(self, ratio: int, needed: int) -> int:
        """Compressed entries (key blocks) laid out for a captured step (see the module
        docstring)."""
        if self.cuda:
            return max(2, -(-self.max_context // ratio))
        return max(ENTRY_MULTIPLE, -(-needed // ENTRY_MULTIPLE) * ENTRY_MULTIPLE)

    def _run(self, step: CapturedStep, batch, batch_size: int) -> LogitsProcessorOutput:
        ctx, ids, hidden = batch
        key = step.key
        step.runs += 1
        args = (ctx, ids, hidden, key.spec_step_idx)
        logits, states = self.compiler.call(step, args)
        if key.draft_steps:  # the round's drafts `[bucket, steps]`
            drafts = logits[:batch_size]
            return LogitsProcessorOutput(drafts.clone() if self.cuda else drafts, None)
        rows = batch_size * key.rows_per_req
        logits = logits[: batch_size if key.logits == LOGITS_PER_REQUEST else rows]
        if states is not None:
            per_request = (
                key.capture_hidden is CaptureHiddenMode.LAST and key.logits == LOGITS_PER_REQUEST
            )
            states = states[: batch_size if per_request else rows]
        if self.cuda:  # the graph's outputs are overwritten by the next replay
            logits = logits.clone()
            states = None if states is None else states.clone()
        return LogitsProcessorOutput(logits, states)

    # --- reporting -----------------------------------------------------------------------
    def describe(self) -> str:
        backend = "CUDA graphs" if self.cuda else "torch.compile (inductor)"
        if self.cuda and self.config.torch_compile:
            backend = "torch.compile + CUDA graphs"
        if self.compiler.store is not None:
            backend += f", precompiled and kept in {self.compiler.store.directory}"
        when = "compiled on first use"
        if self.config.background and not self.cuda:
            when = "compiled on first use in the background"
        elif self.cuda:  # recorded on the serving thread
            when = "recorded on first use"
        return f"captured steps: {backend}, buckets {list(self.buckets)}, {when}"

    def compiled_steps(self) -> list[tuple[str, str, float]]:
        """(step, state, seconds) of every step seen so far."""
        return [(s.key.describe(), s.state.value, s.seconds) for s in self.compiler.steps.values()]


@contextlib.contextmanager
def no_new_compiles(graph_runners):
    """`GraphRunner.no_new_compiles` on each of `graph_runners` at once."""
    with contextlib.ExitStack() as stack:
        for graph_runner in graph_runners:
            stack.enter_context(graph_runner.no_new_compiles())
        yield


def draft_round_function(runner: StepRunner, key: StepKey) -> Callable:
    """The body of a captured draft round (`GraphRunner.try_draft_round`): the extend, then
    the chain (`draft_chain`) over the prepared step contexts, greedy (what the
    step-by-step drafter picks without a grammar). Returns (drafts `[bucket, steps]`,
    None)."""
    call_model = runner.call_model
    canonical = getattr(runner.model, "canonical_spec_step", None)
    step_indices = tuple(
        i if canonical is None else canonical(i) for i in range(1, key.draft_steps)
    )

    def draft_round(contexts, input_ids, hidden, spec_step_idx):
        out = call_model(contexts[0], input_ids, hidden, spec_step_idx)

        def step(i, tokens, hidden):
            return call_model(contexts[i], tokens, hidden, step_indices[i - 1])

        drafts = draft_chain(out.next_token_logits, out.hidden_states, key.draft_steps, step)
        return drafts, None

    return draft_round
