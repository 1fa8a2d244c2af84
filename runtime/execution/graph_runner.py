# SPDX-License-Identifier: Apache-2.0
"""`GraphRunner`: decode, verify and draft steps replayed from captured graphs.

A step is capturable when every request runs the same number of rows (decode: 1; target
verify and the draft over verified rows: steps + 1; chained draft steps: 1) and the cache
pool lays such a batch out with fixed shapes (`pool.capturable`, `pool.prepare`). One graph
is kept per step kind and batch bucket (SGLang's `CudaGraphRunner` / `CPUGraphRunner`):

1. the live batch is padded up to the smallest bucket that holds it with copies of the
   padding request (its rows read and write only the caches' padding rows);
2. the pool prepares the batch's metadata (gather indices, masks) at the bucket's shapes,
   the count of what grows with the context (DeepSeek-V4's compressed entries, Qwen4Exp's
   key blocks) rounded up (`ENTRY_MULTIPLE`, or the context maximum for CUDA graphs, whose
   shapes cannot change);
3. the captured step runs: on CPU a `torch.compile` (inductor) graph of the model forward,
   that count marked dynamic so a growing context does not recompile; on CUDA a
   `torch.cuda.CUDAGraph` replay after copying the inputs into its static buffers
   (optionally compiled first, `--enable-torch-compile`);
4. logits and hidden states are sliced back to the live rows.

A bucket is compiled the first time a step needs it: on a worker thread while the step
runs eagerly (`CaptureConfig.background`, CPU), or in the calling thread (always for CUDA
graphs, which record in seconds, and cannot record beside another thread's synchronising
calls; they share one memory pool). Each (kind, bucket)
gets a code object of its own, so its dynamo cache holds exactly one graph and the guards
need not be evaluated on every call. On CPU each step is precompiled whole (torch's AOT
precompile) and saved under the runtime cache directory (`step_store`): a second start loads
it in seconds without tracing, and its calls bypass dynamo's frame evaluation. Where a step
cannot be precompiled (or `NEXTN_CHECK_GUARDS` asks for guards) it is a `torch.compile`d
function whose guards are skipped on captured calls, and evaluated while another thread
compiles (`GuardSkipping`); its compiled artifacts persist in inductor's FX graph and AOT
autograd caches, so a second start re-traces it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Protocol

import torch
from torch import nn

from runtime.cache.slot_table import SlotTable
from runtime.configs.capture import CaptureConfig
from runtime.configs.compiler_caches import point_compiler_caches
from runtime.core.capture import compiling_here
from runtime.core.forward_context import ForwardContext
from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.core.model_output import LogitsProcessorOutput
from runtime.distributed.replica import patient_collectives
from runtime.execution import step_store
from runtime.execution.compile_worker import CompileWorker
from runtime.execution.draft_chain import draft_chain
from runtime.execution.model_input import ModelInput
from runtime.execution.step_store import StepStore, fingerprint, outputs_match, precompile
from runtime.kernels import cpu_extension
from runtime.layers import hyper_connection

logger = logging.getLogger(__name__)

CAPTURED_MODES = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)
ENTRY_MULTIPLE = 16  # compressed-entry counts are padded to this (CPU: a dynamic dim anyway)
# The C++ wrapper calls the step's kernels without a Python interpreter between them (less
# CPU per step; it compiles longer).
CPU_INDUCTOR_OPTIONS = {"cpp_wrapper": True}
_compile_lock = threading.Lock()
SKIP_GUARDS = os.environ.get("NEXTN_CHECK_GUARDS") is None
# CPU steps are precompiled and kept on disk (`step_store`); with guards checked they are
# `torch.compile`d functions instead, whose guards dynamo evaluates
PRECOMPILE = SKIP_GUARDS
PREPARE_STORE = "prepare the step store"  # the background worker's first item (CPU)


class GuardSkipping:
    """Captured calls skip dynamo's guard evaluation (`skip_guard_eval_unsafe`: each step's
    code object holds one graph, see the module docstring). That stance is process-wide,
    and dynamo refuses to compile under it ("Recompilation triggered with
    skip_guard_eval_unsafe stance"): a background compile that began while the serving
    thread was inside a captured call failed, and its step ran eagerly for good. So a call
    takes the stance only while no compile runs or waits to (otherwise it evaluates the
    guards), and a compile starts once no call holds it: a wait of one call at most, since
    calls stop taking the stance as soon as a compile waits."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._lock = threading.Lock()  # held by a call in the stance, or to count compiles
        self._compiles = 0
        self._waiting = 0  # compiles waiting for the call in the stance to end

    @contextlib.contextmanager
    def call(self):
        # never block the serving thread: while a compile runs or waits, evaluate guards
        if self.enabled and not self._waiting and self._lock.acquire(blocking=False):
            try:
                if not self._compiles:
                    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                        yield
                    return
            finally:
                self._lock.release()
        yield

    @contextlib.contextmanager
    def compiling(self):
        # compiles run one at a time (`_compile_lock`), so one thread at most counts here
        self._waiting += 1
        try:
            with self._lock:
                self._compiles += 1
        finally:
            self._waiting -= 1
        try:
            yield
        finally:
            with self._lock:
                self._compiles -= 1


guard_skipping = GuardSkipping(SKIP_GUARDS)

LOGITS_ALL, LOGITS_PER_REQUEST = "all rows", "one row per request"


@dataclass(frozen=True)
class StepKey:
    mode: ForwardMode
    rows_per_req: int
    bucket: int
    capture_hidden: CaptureHiddenMode
    logits: str  # LOGITS_ALL or LOGITS_PER_REQUEST
    hidden_input: bool
    spec_step_idx: int
    # > 0: a whole draft round in one graph (`GraphRunner.try_draft_round`): the extend over
    # verified rows, then `draft_steps - 1` chained steps, greedy picks in between
    draft_steps: int = 0
    recipe: str = ""  # a step its caller defines (`StepRecipe.name`, `GraphRunner.try_recipe`)

    def describe(self) -> str:
        rows = "" if self.rows_per_req == 1 else f" x {self.rows_per_req} rows"
        if self.recipe:
            return f"{self.recipe} bs {self.bucket}{rows}"
        if self.draft_steps:
            return f"draft round ({self.draft_steps} steps) bs {self.bucket}{rows}"
        step = f" step {self.spec_step_idx}" if self.spec_step_idx else ""
        return f"{self.mode.name.lower()}{step} bs {self.bucket}{rows}"


class StepState(enum.Enum):
    PENDING = "pending"
    COMPILING = "compiling"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class StepRecipe:
    """A captured step whose body and arguments its caller defines (the speculative worker's
    fused NEXTN round, which runs two models). `body(*args)` is compiled (recorded) once per
    bucket, on `padding_args(bucket)`: arguments made only of padding rows, which write
    only the caches' padding rows. Outputs are tensors or tuples of tensors."""

    name: str
    body: Callable
    padding_args: Callable[[int], tuple]


@dataclass
class CapturedStep:
    key: StepKey
    fn: Callable
    recipe: StepRecipe | None = None
    state: StepState = StepState.PENDING
    seconds: float = 0.0
    error: str | None = None
    hidden_like: torch.Tensor | None = None  # a [0, D] tensor: the draft's hidden input
    graph: object = None  # CUDA: (graph, static inputs, static outputs)
    # `fn` is a precompiled step, called without dynamo's frame evaluation (`step_store`)
    precompiled: bool = False
    loaded: bool = False  # the precompiled step came from disk
    runs: int = 0  # calls that ran this step (live batches, not its compile)


def fresh_function(fn: Callable, name: str) -> Callable:
    """A copy of `fn` with a code object of its own (dynamo caches graphs per code object)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def tensors_of(value) -> list[torch.Tensor]:
    """Every tensor inside nested dataclasses, dicts, lists and tuples, in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if is_dataclass(value) and not isinstance(value, type):
        return [t for f in fields(value) for t in tensors_of(getattr(value, f.name))]
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in tensors_of(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


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
        self.buckets = config.buckets(max_running_requests)
        self.device = torch.device(runner.device)
        self.cuda = self.device.type == "cuda"
        self.pad_req = runner.slot_table.req_pool.pad_req
        self.max_context = runner.slot_table.req_pool.max_context_len
        self._steps: dict[StepKey, CapturedStep] = {}
        self._lock = threading.Lock()
        self._worker: CompileWorker | None = None  # its items: steps, or PREPARE_STORE
        self._graph_pool = None  # CUDA: the memory pool the graphs share
        # False once start-up compiled every step a batch can meet: a step met later (a kind
        # the warm-up did not run) pads into a larger ready bucket or runs eagerly rather
        # than stalling the serving thread on a compile
        self.compiles_on_demand = True
        # steps that met their own bucket not yet ready (compiling, or about to): their time
        # says nothing about the captured step's (a measured speculation policy skips them)
        self.unsettled_runs = 0
        # CPU: steps precompiled and kept on disk, unless a replica's ranks compile together
        # (their graphs hold collectives) or guards are wanted
        self._store: StepStore | None = None
        if not self.cuda:
            configure_compiler(config)
            if PRECOMPILE and not torch.distributed.is_initialized():
                self._store = StepStore(config.resolved_cache_dir() / "steps")
                if config.background:  # before traffic claims the core
                    self._background().put(PREPARE_STORE)
        elif config.torch_compile and config.background:
            logger.warning(
                "--enable-torch-compile on CUDA: each step compiles (about a minute) in the "
                "serving thread the first time a batch needs it; --capture-compile startup "
                "compiles them all before serving"
            )

    # --- which steps ---------------------------------------------------------------------
    @property
    def capturable(self) -> bool:
        return bool(getattr(self.runner.kv_pool, "capturable", False))

    def bucket_for(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def step_key(self, inp: ModelInput) -> StepKey | None:
        """The captured step that runs `inp`, or None when it must run eagerly."""
        if not self.capturable or inp.forward_mode not in CAPTURED_MODES:
            return None
        lens = inp.extend_lens
        q = lens[0] if lens else 0
        # decode and chained draft steps run one row per request, verify rounds and the draft
        # over them the full speculative width; other uniform batches (a draft extend over
        # equally short prompts) are rare enough to run eagerly instead of compiling for them
        wanted = 1 if inp.forward_mode is ForwardMode.DECODE else self.runner.verify_width
        if q != wanted or any(n != q for n in lens):
            return None
        bucket = self.bucket_for(len(lens))
        if bucket is None:
            return None
        rows = logits_rows_of(inp, q)
        if rows is None:
            logits = LOGITS_ALL
        elif len(rows) == len(lens):
            logits = LOGITS_PER_REQUEST
        else:
            return None
        canonical = getattr(self.runner.model, "canonical_spec_step", None)
        return StepKey(
            inp.forward_mode,
            q,
            bucket,
            inp.capture_hidden_mode,
            logits,
            inp.captured_hidden_states is not None,
            inp.spec_step_idx if canonical is None else canonical(inp.spec_step_idx),
        )

    # --- running -------------------------------------------------------------------------
    def try_forward(self, inp: ModelInput) -> LogitsProcessorOutput | None:
        """Run `inp` through its captured step; None when it is not capturable or its bucket
        is not compiled yet (the caller then runs it eagerly)."""
        key = self.step_key(inp)
        if key is None:
            return None
        step = self._ready_step(key, inp.captured_hidden_states)
        if step is None:
            return None
        batch = self.padded_batch(inp, step.key)
        return self._run(step, batch, len(inp.extend_lens))

    def round_key(self, inp: ModelInput, num_steps: int) -> StepKey | None:
        """The captured draft round that runs the draft's extend `inp` and `num_steps - 1`
        chained steps after it, or None (not a uniform extend over verified rows with one
        logits row per request and the hidden state of that row)."""
        key = self.step_key(inp)
        if (
            key is None
            or key.mode is not ForwardMode.DRAFT_EXTEND
            or key.logits != LOGITS_PER_REQUEST
            or key.capture_hidden is not CaptureHiddenMode.LAST
            or not key.hidden_input
            or num_steps < 1
        ):
            return None
        return dataclasses.replace(key, draft_steps=num_steps)

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
        step = self._ready_step(key, inp.captured_hidden_states)
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
        step = self._ready_step(key, None, recipe)
        if step is None:
            return None
        args = live_args(step.key.bucket)
        if self.cuda:
            outputs = self._replay_cuda_graph(step, args)
            return tuple(o.clone() for o in outputs)  # the next replay overwrites them
        return self._call_compiled(step, args)

    def loading(self, key: StepKey) -> bool:
        """Whether the step of `key` is compiling, or queued to (not ready, not failed)."""
        step = self._steps.get(key)
        if step is None:
            return False
        return step.state is StepState.COMPILING or (
            step.state is StepState.PENDING and self.compiles_on_demand
        )

    @contextlib.contextmanager
    def no_new_compiles(self):
        """Steps met meanwhile that are not compiled yet run eagerly (or padded into a larger
        ready bucket) and are not queued for a compile: work a batch runs only until another
        step of its own is ready, or a warm-up's request whose steps compile at the buckets
        the traffic meets instead of at its own batch size."""
        was, self.compiles_on_demand = self.compiles_on_demand, False
        try:
            yield
        finally:
            self.compiles_on_demand = was

    def _ready_step(
        self, key: StepKey, hidden: torch.Tensor | None, recipe: StepRecipe | None = None
    ) -> CapturedStep | None:
        """The compiled step for `key` (compiling it if it is new), or the smallest larger
        ready bucket while it compiles, or None."""
        step = self.captured_step(key, hidden, recipe)
        if step.state is StepState.PENDING and self.compiles_on_demand:
            self.unsettled_runs += 1
            self._schedule(step)
        elif step.state is StepState.COMPILING:
            self.unsettled_runs += 1
        if step.state is not StepState.READY:
            # while its own bucket compiles, a batch pads into a larger bucket that is ready
            # (more padding rows cost far less than an eager step), else it runs eagerly
            step = self._ready_larger(key)
        return step

    def _ready_larger(self, key: StepKey) -> CapturedStep | None:
        """The smallest ready step like `key` but for a larger bucket."""
        with self._lock:
            for bucket in self.buckets:
                if bucket > key.bucket:
                    step = self._steps.get(dataclasses.replace(key, bucket=bucket))
                    if step is not None and step.state is StepState.READY:
                        return step
        return None

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
        if self.cuda:
            logits, states = self._replay_cuda_graph(step, args)
        else:
            logits, states = self._call_compiled(step, args)
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

    @staticmethod
    def _call_compiled(step: CapturedStep, args: tuple):
        if step.precompiled:
            return step.fn(*args)
        mark_dynamic_dims(args)
        with guard_skipping.call():
            return step.fn(*args)

    # --- compiling -----------------------------------------------------------------------
    def captured_step(
        self, key: StepKey, hidden: torch.Tensor | None = None, recipe: StepRecipe | None = None
    ) -> CapturedStep:
        """The step for `key`, made (pending, not compiled) the first time it is asked for;
        `hidden`: the draft's hidden input of a live batch (its width), `recipe`: the
        caller's body for a recipe step."""
        with self._lock:
            step = self._steps.get(key)
            if step is None:
                name = f"captured_{key.mode.name.lower()}_{key.rows_per_req}x{key.bucket}"
                if key.draft_steps:
                    name = f"captured_draft_round_{key.draft_steps}x{key.bucket}"
                if recipe is not None:
                    name = f"captured_{recipe.name.replace(' ', '_')}_{key.bucket}"
                like = None if hidden is None else hidden.new_zeros((0, hidden.shape[1]))
                fn = self._step_function(name, key, recipe)
                step = CapturedStep(key, fn, recipe, hidden_like=like)
                self._steps[key] = step
            return step

    def _step_function(self, name: str, key: StepKey, recipe: StepRecipe | None) -> Callable:
        call_model = self.runner.call_model

        def step(ctx, input_ids, hidden, spec_step_idx):
            out = call_model(ctx, input_ids, hidden, spec_step_idx)
            return out.next_token_logits, out.hidden_states

        if recipe is not None:
            body = recipe.body
        elif key.draft_steps:
            body = draft_round_function(self.runner, key)
        else:
            body = step
        fn = fresh_function(body, name)
        if (self.cuda and not self.config.torch_compile) or self._store is not None:
            return fn  # recorded, or precompiled, by `compile_step`
        # inductor's default mode on CUDA too: the gain is fusing the step's thousands of
        # small kernels, and max-autotune's GEMM search costs minutes per bucket
        return torch.compile(fn, dynamic=False, options=self._options() or None)

    def _options(self) -> dict:
        """Inductor options: the config's, over the CPU defaults (`CPU_INDUCTOR_OPTIONS`)."""
        if self.cuda:
            return dict(self.config.inductor_options)
        return {**CPU_INDUCTOR_OPTIONS, **self.config.inductor_options}

    def configure_regions(self) -> None:
        """Nested compile regions on or off for this runner's compiles (inductor's C++
        wrapper cannot call them); callers hold `_compile_lock` or trace only."""
        hyper_connection.COMPILE_HC_PRE_ONCE = not self._options().get("cpp_wrapper")

    def _schedule(self, step: CapturedStep) -> None:
        # a CUDA graph records in seconds, and while one records, another thread's
        # synchronising calls (the serving thread's eager steps) would fail: record inline
        if not self.config.background or self.cuda:
            self.compile_step(step)
            return
        with self._lock:
            if step.state is not StepState.PENDING:
                return
            step.state = StepState.COMPILING
        self._background().put(step)

    def _background(self) -> CompileWorker:
        """The worker thread that compiles this runner's steps (started on first use)."""
        with self._lock:
            if self._worker is None:
                self._worker = CompileWorker(self._work)
            return self._worker

    def _work(self, item) -> None:
        if item is PREPARE_STORE:
            step_store.prepare()
            self._store.prune()
        else:
            self.compile_step(item)

    def compile_step(self, step: CapturedStep) -> None:
        """Capture `step`, in the calling thread, on a batch made only of padding rows (it
        writes only padding rows of the caches, so it may run beside eager steps on live
        requests)."""
        step.state = StepState.COMPILING
        start = time.perf_counter()
        try:
            # on a replica every rank compiles this step now and then runs it together
            with (
                torch.inference_mode(),
                _compile_lock,
                compiling_here(),  # this thread's compile, not the serving thread's eager steps
                guard_skipping.compiling(),
                patient_collectives(),
            ):
                self.configure_regions()
                if not self.cuda:
                    cpu_extension.load(self.config.resolved_cache_dir())
                args = self._padding_args(step)
                if self.cuda:
                    self._capture_cuda_graph(step, args)
                elif self._store is not None:
                    self._precompile(step, args)
                else:
                    mark_dynamic_dims(args)
                    step.fn(*args)
        except Exception as err:  # a step that cannot be captured keeps running eagerly
            step.state, step.error = StepState.FAILED, f"{type(err).__name__}: {err}"
            logger.warning("capture of %s failed, it runs eagerly: %s", step.key.describe(), err)
            return
        step.seconds = time.perf_counter() - start
        step.state = StepState.READY
        how = "loaded" if step.loaded else "captured"
        logger.info("%s %s in %.1f s", how, step.key.describe(), step.seconds)

    def _precompile(self, step: CapturedStep, args: tuple) -> None:
        """Load `step` from the step store, or precompile it and save it there; a step that
        cannot be precompiled is compiled by `torch.compile` instead."""
        fn, options = step.fn, self._options()
        mark_dynamic_dims(args)
        path = self._store.path(fn.__name__, fingerprint(fn, args, options, step.key.describe()))
        loaded = self._store.load(path, fn)
        if loaded is not None:
            if self._runs_like_eager(loaded, fn, args):
                step.fn, step.precompiled, step.loaded = loaded, True, True
                return
            logger.warning("the stored %s differs from the eager step; compiling it", path.name)
        try:
            compiled = precompile(fn, args, options)
        except Exception as err:  # e.g. a closure object the artifact cannot refer to
            logger.warning(
                "%s cannot be precompiled, so a later start traces it again: %s",
                step.key.describe(),
                err,
            )
            step.fn = torch.compile(fn, dynamic=False, options=options or None)
            step.fn(*args)
            return
        self._store.save(path, compiled, fn)
        compiled(*args)
        step.fn, step.precompiled = compiled, True

    @staticmethod
    def _runs_like_eager(loaded: Callable, fn: Callable, args: tuple) -> bool:
        """Whether a stored step gives the eager step's outputs on the padding batch (a step
        that fails to run counts as different: it is compiled afresh, not left eager)."""
        try:
            got = loaded(*args)
        except Exception as err:
            logger.warning("a stored step failed to run: %s", err)
            return False
        return outputs_match(got, fn(*args))

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

    def compile_buckets(self, buckets, wanted: Callable[[StepKey], bool] | None = None) -> None:
        """Compile every step seen so far for each of `buckets` too, in the calling thread: a
        benchmark's warm-up meets each kind of step at some batch size, while its measured
        run may meet any bucket. `wanted`: only the steps it accepts (the ones a batch can
        meet)."""
        for key, seen in list(self._steps.items()):
            for bucket in buckets:
                if bucket not in self.buckets:
                    continue
                each = dataclasses.replace(key, bucket=bucket)
                if wanted is not None and not wanted(each):
                    continue
                step = self.captured_step(each, seen.hidden_like, seen.recipe)
                if step.state is StepState.PENDING:
                    self.compile_step(step)

    def wait_until_idle(self, timeout: float | None = None) -> bool:
        """Block until no bucket is compiling (tests, benchmarks). False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(s.state is StepState.COMPILING for s in list(self._steps.values())):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    # --- CUDA graphs ---------------------------------------------------------------------
    def _capture_cuda_graph(self, step: CapturedStep, args: tuple) -> None:
        """Warm up on a side stream, then record the step into a CUDA graph whose inputs are
        `args`' tensors (later batches are copied into them)."""
        # streams and the capture belong to the model's GPU, whichever is the thread's current
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step.fn(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            # one memory pool for every graph (as SGLang's runner does): replays run one at a
            # time and `_run` copies a replay's outputs before the next one can overwrite them
            with torch.cuda.graph(graph, pool=self._graph_pool):
                outputs = step.fn(*args)
        step.graph = (graph, args, outputs)

    def _replay_cuda_graph(self, step: CapturedStep, args: tuple):
        graph, static, outputs = step.graph
        with torch.cuda.device(self.device):  # copies and launch on the model's GPU's stream
            for dst, src in zip(tensors_of(static), tensors_of(args), strict=True):
                if dst.data_ptr() != src.data_ptr():  # the shared caches are the same tensors
                    dst.copy_(src)
            graph.replay()
        return outputs

    # --- reporting -----------------------------------------------------------------------
    def describe(self) -> str:
        backend = "CUDA graphs" if self.cuda else "torch.compile (inductor)"
        if self.cuda and self.config.torch_compile:
            backend = "torch.compile + CUDA graphs"
        if self._store is not None:
            backend += f", precompiled and kept in {self._store.directory}"
        when = "compiled on first use"
        if self.config.background and not self.cuda:
            when = "compiled on first use in the background"
        elif self.cuda:  # recorded on the serving thread
            when = "recorded on first use"
        return f"captured steps: {backend}, buckets {list(self.buckets)}, {when}"

    def compiled_steps(self) -> list[tuple[str, str, float]]:
        """(step, state, seconds) of every step seen so far."""
        return [(s.key.describe(), s.state.value, s.seconds) for s in self._steps.values()]


@contextlib.contextmanager
def no_new_compiles(graph_runners):
    """`GraphRunner.no_new_compiles` on each of `graph_runners` at once."""
    with contextlib.ExitStack() as stack:
        for graph_runner in graph_runners:
            stack.enter_context(graph_runner.no_new_compiles())
        yield


def logits_rows_of(inp: ModelInput, rows_per_req: int) -> list[int] | None:
    """The rows `inp` wants logits for (None: all)."""
    rows = inp.logits_row_indices
    if isinstance(rows, torch.Tensor):
        return rows.tolist()
    if rows is None or isinstance(rows, (list, tuple)):
        return rows
    # the runner's default: each request's last row for a draft extend, every row otherwise
    if inp.forward_mode is not ForwardMode.DRAFT_EXTEND:
        return None
    return [(b + 1) * rows_per_req - 1 for b in range(len(inp.extend_lens))]


def mark_dynamic_dims(args) -> None:
    """The dims that grow with the context (compressed entries, key blocks) stay symbolic in
    the graph: those of every context among a step's arguments (nested in tuples)."""
    if isinstance(args, ForwardContext):
        for tensor, dim in getattr(args.attn_metadata, "dynamic_dims", list)():
            torch._dynamo.mark_dynamic(tensor, dim)
    elif isinstance(args, (tuple, list)):
        for one in args:
            mark_dynamic_dims(one)


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


def configure_compiler(config: CaptureConfig) -> None:
    """Point inductor's on-disk caches (FX graphs, AOT autograd, compiled kernels) at the
    runtime cache directory unless the user chose one (`compiler_caches`). Dims marked
    dynamic stay distinct symbols even when their sizes happen to match (no duck shaping:
    the entry counts of two compress ratios are equal at one step and not at the next)."""
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    point_compiler_caches(config.resolved_cache_dir())  # done by the engine already
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.autotune_local_cache = True
