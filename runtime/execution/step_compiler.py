# SPDX-License-Identifier: Apache-2.0
"""`StepCompiler`: the captured steps of one runner, their compile scheduling and the step
store.

A step (`CapturedStep`, one per `StepKey`) is made pending the first time a batch asks for
it and compiled on a batch of padding rows only: on a worker thread while the step runs
eagerly (`CaptureConfig.background`, CPU), or in the calling thread (always for CUDA graphs,
recorded by `capture_buffer`). Each step gets a code object of its own, so its dynamo cache
holds exactly one graph and captured calls may skip guard evaluation (`GuardSkipping`). On
CPU a step is precompiled whole (torch's AOT precompile) and kept in the `step_store`, so a
second start loads it without tracing; where it cannot be (or `NEXTN_CHECK_GUARDS` asks for
guards) it is a `torch.compile`d function. Contract: until a step is READY a batch pads into
a larger ready bucket or runs eagerly; a step that fails to compile runs eagerly for good.
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
from dataclasses import dataclass

import torch

from runtime.configs.capture import CaptureConfig
from runtime.configs.compiler_caches import point_compiler_caches
from runtime.core.capture import compiling_here
from runtime.core.forward_context import ForwardContext
from runtime.distributed.replica import patient_collectives
from runtime.execution import step_store
from runtime.execution.capture_buffer import CaptureBuffers
from runtime.execution.compile_worker import CompileWorker
from runtime.execution.step_keys import StepKey
from runtime.execution.step_store import StepStore, fingerprint, outputs_match, precompile
from runtime.kernels import cpu_extension
from runtime.layers import hyper_connection

logger = logging.getLogger(__name__)

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


class StepCompiler:
    """The steps of one runner on `device`. `step_body(key, recipe)`: the function a step
    runs (the model step, a draft round or a recipe's body); `padding_args(step)`: its
    arguments for a batch of padding rows only. `role`: the runner's, for whoever reads."""

    def __init__(
        self,
        config: CaptureConfig,
        device: torch.device,
        buckets,
        step_body: Callable[[StepKey, StepRecipe | None], Callable],
        padding_args: Callable[[CapturedStep], tuple],
        role: str = "",
    ):
        self.config, self.device, self.buckets, self.role = config, device, buckets, role
        self.cuda = device.type == "cuda"
        self.step_body, self.padding_args = step_body, padding_args
        self.steps: dict[StepKey, CapturedStep] = {}
        self._lock = threading.Lock()
        self.worker: CompileWorker | None = None  # its items: steps, or PREPARE_STORE
        self.buffers = CaptureBuffers(device) if self.cuda else None
        # False once start-up compiled every step a batch can meet: a step met later (a kind
        # the warm-up did not run) pads into a larger ready bucket or runs eagerly rather
        # than stalling the serving thread on a compile
        self.compiles_on_demand = True
        # steps that met their own bucket not yet ready (compiling, or about to): their time
        # says nothing about the captured step's (a measured speculation policy skips them)
        self.unsettled_runs = 0
        # CPU: steps precompiled and kept on disk, unless a replica's ranks compile together
        # (their graphs hold collectives) or guards are wanted
        self.store: StepStore | None = None
        if not self.cuda:
            configure_compiler(config)
            if PRECOMPILE and not torch.distributed.is_initialized():
                self.store = StepStore(config.resolved_cache_dir() / "steps")
                if config.background:  # before traffic claims the core
                    self._background().put(PREPARE_STORE)
        elif config.torch_compile and config.background:
            logger.warning(
                "--enable-torch-compile on CUDA: each step compiles (about a minute) in the "
                "serving thread the first time a batch needs it; --capture-compile startup "
                "compiles them all before serving"
            )

    # --- which step runs -----------------------------------------------------------------
    def ready_step(
        self, key: StepKey, hidden: torch.Tensor | None, recipe: StepRecipe | None = None
    ) -> CapturedStep | None:
        """The compiled step for `key` (compiling it if it is new), or the smallest larger
        ready bucket while it compiles, or None."""
        step = self.captured_step(key, hidden, recipe)
        if step.state is StepState.PENDING and self.compiles_on_demand:
            self.unsettled_runs += 1
            self.schedule(step)
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
                    step = self.steps.get(dataclasses.replace(key, bucket=bucket))
                    if step is not None and step.state is StepState.READY:
                        return step
        return None

    def loading(self, key: StepKey) -> bool:
        """Whether the step of `key` is compiling, or queued to (not ready, not failed)."""
        step = self.steps.get(key)
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

    def call(self, step: CapturedStep, args: tuple):
        """The ready `step`'s outputs on `args` (a CUDA graph's are its static outputs,
        overwritten by the next replay: `capture_buffer`)."""
        if self.cuda:
            return self.buffers.replay(step.graph, args)
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
            step = self.steps.get(key)
            if step is None:
                name = f"captured_{key.mode.name.lower()}_{key.rows_per_req}x{key.bucket}"
                if key.draft_steps:
                    name = f"captured_draft_round_{key.draft_steps}x{key.bucket}"
                if recipe is not None:
                    name = f"captured_{recipe.name.replace(' ', '_')}_{key.bucket}"
                like = None if hidden is None else hidden.new_zeros((0, hidden.shape[1]))
                fn = self._step_function(name, key, recipe)
                step = CapturedStep(key, fn, recipe, hidden_like=like)
                self.steps[key] = step
            return step

    def _step_function(self, name: str, key: StepKey, recipe: StepRecipe | None) -> Callable:
        fn = fresh_function(self.step_body(key, recipe), name)
        if (self.cuda and not self.config.torch_compile) or self.store is not None:
            return fn  # recorded, or precompiled, by `compile_step`
        # inductor's default mode on CUDA too: the gain is fusing the step's thousands of
        # small kernels, and max-autotune's GEMM search costs minutes per bucket
        return torch.compile(fn, dynamic=False, options=self.options() or None)

    def options(self) -> dict:
        """Inductor options: the config's, over the CPU defaults (`CPU_INDUCTOR_OPTIONS`)."""
        if self.cuda:
            return dict(self.config.inductor_options)
        return {**CPU_INDUCTOR_OPTIONS, **self.config.inductor_options}

    def configure_regions(self) -> None:
        """Nested compile regions on or off for this runner's compiles (inductor's C++
        wrapper cannot call them); callers hold `_compile_lock` or trace only."""
        hyper_connection.COMPILE_HC_PRE_ONCE = not self.options().get("cpp_wrapper")

    def schedule(self, step: CapturedStep) -> None:
        """Compile the pending `step`: queued for the worker thread (background, CPU), or
        now in the calling thread."""
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
            if self.worker is None:
                self.worker = CompileWorker(self._work)
            return self.worker

    def _work(self, item) -> None:
        if item is PREPARE_STORE:
            step_store.prepare()
            self.store.prune()
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
                args = self.padding_args(step)
                if self.cuda:
                    step.graph = self.buffers.record(step.fn, args)
                elif self.store is not None:
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
        fn, options = step.fn, self.options()
        mark_dynamic_dims(args)
        path = self.store.path(fn.__name__, fingerprint(fn, args, options, step.key.describe()))
        loaded = self.store.load(path, fn)
        if loaded is not None:
            if _runs_like_eager(loaded, fn, args):
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
        self.store.save(path, compiled, fn)
        compiled(*args)
        step.fn, step.precompiled = compiled, True

    def compile_buckets(self, buckets, wanted: Callable[[StepKey], bool] | None = None) -> None:
        """Compile every step seen so far for each of `buckets` too, in the calling thread: a
        benchmark's warm-up meets each kind of step at some batch size, while its measured
        run may meet any bucket. `wanted`: only the steps it accepts (the ones a batch can
        meet)."""
        for key, seen in list(self.steps.items()):
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
        while any(s.state is StepState.COMPILING for s in list(self.steps.values())):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


def _runs_like_eager(loaded: Callable, fn: Callable, args: tuple) -> bool:
    """Whether a stored step gives the eager step's outputs on the padding batch (a step
    that fails to run counts as different: it is compiled afresh, not left eager)."""
    try:
        got = loaded(*args)
    except Exception as err:
        logger.warning("a stored step failed to run: %s", err)
        return False
    return outputs_match(got, fn(*args))


def mark_dynamic_dims(args) -> None:
    """The dims that grow with the context (compressed entries, key blocks) stay symbolic in
    the graph: those of every context among a step's arguments (nested in tuples)."""
    if isinstance(args, ForwardContext):
        for tensor, dim in getattr(args.attn_metadata, "dynamic_dims", list)():
            torch._dynamo.mark_dynamic(tensor, dim)
    elif isinstance(args, (tuple, list)):
        for one in args:
            mark_dynamic_dims(one)


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
