# SPDX-License-Identifier: Apache-2.0
"""`step_store`: captured CPU steps precompiled, saved, and loaded by a later start without
tracing, bound to that start's own objects.

Real inductor compiles of small steps (seconds each): a step closing over a module is
precompiled and saved; a fresh process (and a fresh graph runner) loads it without dynamo
tracing anything, reads its own module's weights, and gives the eager step's results. The
fingerprint changes with everything the trace bakes in and stays put otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from runtime.configs import compiler_caches
from runtime.configs.capture import CaptureConfig
from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.execution import step_compiler, step_store
from runtime.execution.graph_runner import LOGITS_ALL, GraphRunner, StepKey, StepRecipe, StepState
from runtime.execution.step_compiler import fresh_function
from runtime.execution.step_store import (
    StepStore,
    external_objects,
    fingerprint,
    outputs_match,
    precompile,
)

OPTIONS = {"cpp_wrapper": False}  # inductor's Python wrapper: the faster compile


class Block(nn.Module):
    def __init__(self, width: int = 8, scale: float = 2.0, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(width, width)
        self.scale = scale

    def forward(self, x):
        return torch.relu(self.proj(x)) * self.scale


def step_of(block: Block, cache: torch.Tensor, rows: int = 2):
    """A step as the graph runner builds one: a fresh function closing over live objects
    (a module, a cache tensor it writes) and a plain value."""

    def body(x):
        out = block(x) + rows
        cache[: x.shape[0]] = out
        return out, cache.sum(0)

    return fresh_function(body, "captured_test_step")


def test_closure_objects_are_external_and_plain_values_are_saved():
    block, cache = Block(), torch.zeros(4, 8)
    external = external_objects(step_of(block, cache))
    assert sorted(map(id, external.values())) == sorted((id(block), id(cache)))


def test_the_fingerprint_follows_what_the_trace_bakes_in():
    x = torch.ones(2, 8)

    def digest(block=None, cache=None, rows=2, args=(x,), options=OPTIONS, label="decode bs 1"):
        block = Block() if block is None else block
        cache = torch.zeros(4, 8) if cache is None else cache
        return fingerprint(step_of(block, cache, rows), args, options, label)

    same = digest()
    assert digest(block=Block(seed=5)) == same  # other weights, same structure
    changed = [
        digest(block=Block(width=8, scale=3.0)),  # a module's constant
        digest(block=Block(width=16), args=(torch.ones(2, 16),)),  # parameter shapes
        digest(cache=torch.zeros(6, 8)),  # a closure tensor's shape
        digest(rows=3),  # a plain closure value
        digest(args=(torch.ones(3, 8),)),  # the arguments' shapes
        digest(args=(torch.ones(2, 8, dtype=torch.float64),)),
        digest(options={"cpp_wrapper": True}),
        digest(label="decode bs 2"),
    ]
    assert same not in changed and len(set(changed)) == len(changed)


def test_outputs_match_allows_rounding_only():
    a = torch.randn(4, 8)
    ids = torch.arange(4)
    assert outputs_match((a, ids, None), (a + 1e-5, ids + 1, None))  # integer values not compared
    assert not outputs_match((a,), (a + 0.1,))
    assert not outputs_match((a,), (a[:2],))
    assert not outputs_match((a, None), (a, a))
    assert not outputs_match((a,), (a, a))


LOAD_IN_A_FRESH_PROCESS = textwrap.dedent(
    """
    import sys
    import torch
    from torch._dynamo.utils import counters
    from runtime.execution.step_store import StepStore
    from tests.unit.test_step_store import Block, step_of

    block, cache = Block(seed=7), torch.zeros(4, 8)
    fn = step_of(block, cache)
    step = StepStore(sys.argv[1]).load(__import__("pathlib").Path(sys.argv[2]), fn)
    x = torch.randn(2, 8)
    with torch.inference_mode():
        out, total = step(x)
        expected = torch.relu(block.proj(x)) * 2.0 + 2
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(cache[:2], expected)  # it wrote this process's cache
    torch.testing.assert_close(total, expected.sum(0))
    assert not counters["stats"]["unique_graphs"], dict(counters["stats"])  # nothing traced
    print("loaded")
    """
)


def test_a_saved_step_loads_in_a_fresh_process_without_tracing(tmp_path):
    block, cache = Block(seed=1), torch.zeros(4, 8)
    fn = step_of(block, cache)
    args = (torch.randn(2, 8),)
    store = StepStore(tmp_path)
    path = store.path("captured_test_step", fingerprint(fn, args, OPTIONS, "test"))
    with torch.inference_mode():
        step = precompile(fn, args, OPTIONS)
        assert store.save(path, step, fn)
        torch.testing.assert_close(step(*args)[0], fn(*args)[0])
    done = subprocess.run(
        [sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, str(tmp_path), str(path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-3000:]


def test_a_damaged_artifact_loads_nothing(tmp_path):
    path = tmp_path / f"step{step_store.ARTIFACT_SUFFIX}"
    path.write_bytes(b"not a compiled step")
    assert StepStore(tmp_path).load(path, step_of(Block(), torch.zeros(4, 8))) is None


def test_the_store_keeps_its_most_recently_used_steps_under_its_limit(tmp_path):
    """Past its size limit the store removes the artifacts saved or loaded longest ago,
    and nothing else; a load counts as a use."""
    store = StepStore(tmp_path)
    paths = [tmp_path / f"step{i}{step_store.ARTIFACT_SUFFIX}" for i in range(5)]
    for age, path in zip((50, 40, 30, 20, 10), paths):
        path.write_bytes(b"x" * 100)
        os.utime(path, (1_000_000 - age, 1_000_000 - age))
    other = tmp_path / "notes.txt"
    other.write_bytes(b"y" * 1000)
    assert store.prune(max_bytes=1_000_000) == []
    assert sorted(store.prune(max_bytes=250)) == sorted(paths[:3])
    assert [p.exists() for p in paths] == [False, False, False, True, True] and other.exists()
    assert store.prune(max_bytes=250) == []

    block, cache = Block(seed=2), torch.zeros(4, 8)
    fn, args = step_of(block, cache), (torch.randn(2, 8),)
    saved = store.path("captured_test_step", fingerprint(fn, args, OPTIONS, "test"))
    with torch.inference_mode():
        assert store.save(saved, precompile(fn, args, OPTIONS), fn)
    os.utime(saved, (1, 1))  # saved long ago: the first to go
    assert store.load(saved, fn) is not None  # ... until a load uses it
    assert saved.stat().st_mtime > 1_000_000
    assert store.prune(max_bytes=saved.stat().st_size + 150) == [paths[3]]


@pytest.fixture
def precompiling(monkeypatch):
    """Graph runners precompile their steps; their cache directories are temporary ones,
    so inductor's stays where it is."""
    monkeypatch.setattr(step_compiler, "PRECOMPILE", True)
    if not compiler_caches.user_chose(compiler_caches.INDUCTOR_ENV):
        inductor_dir = CaptureConfig().resolved_cache_dir() / "inductor"
        monkeypatch.setenv(compiler_caches.INDUCTOR_ENV, str(inductor_dir))


def bare_runner() -> SimpleNamespace:
    """The little of a model runner a graph runner reads before any model step."""
    pool = SimpleNamespace(pad_req=0, max_context_len=64)
    return SimpleNamespace(
        device="cpu", slot_table=SimpleNamespace(req_pool=pool), kv_pool=None, call_model=None
    )


def recipe_runner(tmp_path, seed: int):
    """A graph runner whose one step (a caller-defined recipe) closes over a fresh block."""
    config = CaptureConfig(
        batch_sizes=(1,), background=False, cache_dir=str(tmp_path), inductor_options=OPTIONS
    )
    graph_runner = GraphRunner(bare_runner(), config, 1)
    block, cache = Block(seed=seed), torch.zeros(4, 8)
    body = step_of(block, cache)
    key = StepKey(
        ForwardMode.DECODE, 1, 1, CaptureHiddenMode.NULL, LOGITS_ALL, False, 0, recipe="test"
    )
    recipe = StepRecipe("test", body, lambda bucket: (torch.zeros(bucket, 8),))
    return graph_runner, graph_runner.captured_step(key, None, recipe), block


@pytest.mark.parametrize("stored", ["matches", "differs", "fails"])
def test_a_second_graph_runner_loads_the_step_unless_it_differs_from_eager(
    tmp_path, monkeypatch, precompiling, stored
):
    first, step, _ = recipe_runner(tmp_path, seed=1)
    first.compile_step(step)
    assert step.state is StepState.READY and step.precompiled and not step.loaded
    assert len(list(tmp_path.joinpath("steps").iterdir())) == 1

    if stored == "differs":  # the eager step disagrees with what was stored: compile afresh
        monkeypatch.setattr(step_compiler, "outputs_match", lambda got, expected: False)
    if stored == "fails":  # the stored step raises when run: compile afresh, not eager
        load = StepStore.load

        def failing_load(self, path, fn):
            step = load(self, path, fn)

            def fail(*args):
                raise RuntimeError("size mismatch")

            return fail if step is not None else None

        monkeypatch.setattr(StepStore, "load", failing_load)
    second, step, block = recipe_runner(tmp_path, seed=2)
    second.compile_step(step)
    assert step.state is StepState.READY and step.precompiled
    assert step.loaded is (stored == "matches")
    x = torch.randn(1, 8)
    with torch.inference_mode():
        out = second.compiler.call(step, (x,))[0]
    torch.testing.assert_close(out, torch.relu(block.proj(x)) * 2.0 + 2)


def test_a_background_graph_runner_prepares_the_store_before_any_step(
    tmp_path, monkeypatch, precompiling
):
    """The first load of a process (imports, the ISA probe) happens at start-up on the
    worker thread, not when traffic first meets a step."""
    prepared, pruned = threading.Event(), threading.Event()
    monkeypatch.setattr(step_store, "prepare", prepared.set)
    monkeypatch.setattr(StepStore, "prune", lambda store: pruned.set())
    runner = bare_runner()
    config = CaptureConfig(batch_sizes=(1,), cache_dir=str(tmp_path))
    graph_runner = GraphRunner(runner, config, 1)
    assert prepared.wait(30) and pruned.wait(30)
    assert graph_runner.compiler.worker._thread.name == "capture"
    inline = GraphRunner(runner, CaptureConfig(batch_sizes=(1,), background=False), 1)
    assert inline.compiler.worker is None  # nothing runs beside an inline runner


def test_the_vector_isa_is_probed_by_one_thread_at_a_time(monkeypatch):
    """Inductor's AVX-512 probe adds a flag to the ISA's shared flags while it test-builds
    and then restores them; two probes at once (the target's and the draft's compile
    workers) could leave the flag for good, and a process that compiled steps with other
    flags than the one loading them rebuilt every C++ wrapper. Here a probe of the same
    shape, started by two threads together, must leave the flags as they were and give
    both threads the same description."""
    isa = SimpleNamespace(flags="-mavx512f", probed=False)
    both_started = threading.Barrier(2)

    def pick_vec_isa():
        if not isa.probed:  # inductor caches the probe per ISA object, without a lock
            base = isa.flags
            isa.flags += " -mavx512bf16"
            threading.Event().wait(0.05)  # the test build
            isa.flags = base
            isa.probed = True
        return isa.flags

    import torch._inductor.cpu_vec_isa as cpu_vec_isa

    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", pick_vec_isa)
    step_store._platform_description.cache_clear()
    described = []

    def describe():
        both_started.wait()
        described.append(step_store.platform_description())

    threads = [threading.Thread(target=describe) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        step_store._platform_description.cache_clear()
    assert isa.flags == "-mavx512f"
    assert len(described) == 2 and described[0] == described[1]
    assert described[0].endswith("|-mavx512f")
