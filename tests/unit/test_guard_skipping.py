# SPDX-License-Identifier: Apache-2.0
"""`GuardSkipping`: captured calls skip dynamo's guards, a process-wide stance under which
dynamo refuses to compile, so a background compile must never start inside such a call.
Checked with real `torch.compile` functions (the eager backend: what is checked is
dynamo's frame handling, not inductor) and two threads ordered by events."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.eval_frame import _is_skip_guard_eval_unsafe_stance

from runtime.configs.capture import CaptureConfig
from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.execution import step_compiler
from runtime.execution.graph_runner import LOGITS_ALL, GraphRunner, StepKey, StepRecipe, StepState
from runtime.execution.step_compiler import GuardSkipping, fresh_function


def compiled(offset: float):
    """A compiled function with a code object of its own, as each captured step has."""

    def step(x):
        return x * 2 + offset

    name = f"step_{str(offset).replace('.', '_')}"
    return torch.compile(fresh_function(step, name), backend="eager", dynamic=False)


def run_in_thread(fn) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = fn()
        except Exception as err:  # reported to the test's thread
            outcome["error"] = err

    thread = threading.Thread(target=target)
    thread.start()
    return thread, outcome


def hold_a_call(enter, inside: threading.Event, leave: threading.Event):
    """A captured call (`enter()`: its context) that stays inside until `leave` is set."""
    warm = compiled(1.0)
    x = torch.ones(3)
    warm(x)  # compiled before the call, as a ready step is

    def call():
        with enter():
            inside.set()
            assert leave.wait(10)
            return warm(x)

    return call


def test_the_stance_is_process_wide_so_an_unprotected_compile_fails():
    """Why `GuardSkipping` exists: one thread inside the stance, another compiling."""
    inside, leave = threading.Event(), threading.Event()
    holder, _ = run_in_thread(
        hold_a_call(lambda: torch.compiler.set_stance(skip_guard_eval_unsafe=True), inside, leave)
    )
    assert inside.wait(10)
    try:
        with pytest.raises(RuntimeError, match="skip_guard_eval_unsafe"):
            compiled(2.0)(torch.ones(3))
    finally:
        leave.set()
        holder.join()


def test_a_compile_waits_for_the_call_in_the_stance_and_then_succeeds():
    skipping = GuardSkipping(True)
    inside, leave = threading.Event(), threading.Event()
    holder, held = run_in_thread(hold_a_call(skipping.call, inside, leave))
    assert inside.wait(10)
    assert _is_skip_guard_eval_unsafe_stance()  # the call took the stance

    def compile_fresh():
        with skipping.compiling():
            return compiled(2.0)(torch.ones(3))

    compiler, compiled_out = run_in_thread(compile_fresh)
    compiler.join(0.3)
    assert compiler.is_alive() and not compiled_out  # waiting, not failed
    # from now until the compile is in, calls evaluate guards rather than take the stance
    # again (the lock cannot pass from call to call ahead of the waiting compile)
    assert skipping._waiting == 1
    leave.set()
    holder.join()
    compiler.join()
    assert "error" not in compiled_out, compiled_out
    assert torch.equal(compiled_out["value"], torch.full((3,), 4.0))
    assert torch.equal(held["value"], torch.full((3,), 3.0))
    assert not _is_skip_guard_eval_unsafe_stance()


def test_calls_while_a_compile_runs_evaluate_the_guards_and_never_wait():
    skipping = GuardSkipping(True)
    warm = compiled(1.0)
    x = torch.ones(3)
    warm(x)
    with skipping.compiling():
        stances = []

        def call():
            with skipping.call():
                stances.append(_is_skip_guard_eval_unsafe_stance())
                return warm(x)

        caller, out = run_in_thread(call)
        caller.join(10)
        assert not caller.is_alive() and torch.equal(out["value"], torch.full((3,), 3.0))
    with skipping.call():
        stances.append(_is_skip_guard_eval_unsafe_stance())
    assert stances == [False, True]
    with GuardSkipping(False).call():  # NEXTN_CHECK_GUARDS: always evaluated
        assert not _is_skip_guard_eval_unsafe_stance()


def test_a_graph_runner_compile_started_inside_a_captured_call_succeeds(monkeypatch, eager_dynamo):
    """The race itself, through `GraphRunner`: the serving thread is inside a captured call
    of a ready step when the background thread starts compiling another. The compile
    waits for the call to end and succeeds (it used to fail, and its step ran eagerly
    until a restart)."""
    monkeypatch.setattr(step_compiler, "guard_skipping", GuardSkipping(True))
    pool = SimpleNamespace(pad_req=0, max_context_len=64)
    runner = SimpleNamespace(
        device="cpu", slot_table=SimpleNamespace(req_pool=pool), kv_pool=None, call_model=None
    )
    graph_runner = GraphRunner(runner, CaptureConfig(batch_sizes=(1,), background=False), 1)

    def recipe(name: str, offset: float) -> tuple[StepKey, StepRecipe]:
        key = StepKey(
            ForwardMode.DECODE, 1, 1, CaptureHiddenMode.NULL, LOGITS_ALL, False, 0, recipe=name
        )
        return key, StepRecipe(name, lambda x: (x * 2 + offset,), lambda bucket: (torch.ones(3),))

    key, body = recipe("ready", 1.0)
    ready = graph_runner.captured_step(key, None, body)
    graph_runner.compile_step(ready)
    key, body = recipe("fresh", 2.0)
    fresh = graph_runner.captured_step(key, None, body)
    assert ready.state is StepState.READY and fresh.state is StepState.PENDING
    compiled_fn, inside = ready.fn, threading.Event()

    def held_open(*args):  # the serving thread inside the call, in the stance
        inside.set()
        time.sleep(0.3)
        return compiled_fn(*args)

    ready.fn = held_open

    def call():  # every forward runs in inference mode, as the compile does
        with torch.inference_mode():
            return graph_runner.compiler.call(ready, (torch.ones(3),))

    caller, out = run_in_thread(call)
    assert inside.wait(10) and _is_skip_guard_eval_unsafe_stance()
    graph_runner.compile_step(fresh)  # as the background thread does
    caller.join()
    assert fresh.state is StepState.READY, fresh.error
    assert "error" not in out, out
    assert torch.equal(out["value"][0], torch.full((3,), 3.0))
    with torch.inference_mode():
        assert torch.equal(fresh.fn(torch.ones(3))[0], torch.full((3,), 4.0))
