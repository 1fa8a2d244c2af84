# SPDX-License-Identifier: Apache-2.0
"""Captured steps beside the prefix cache, fault isolation and retraction.

Each scenario runs on an engine whose runners replay captured steps (bucket 4, compiled
inline with inductor's Python wrapper, as in `test_captured_steps.py`) and is held against
plain eager decoding without a prefix cache: the same greedy tokens. The prefix cache
restores ring snapshots and borrows pages that captured decode steps then address through
their prepared metadata; a step that raises after its captured forward wrote the whole
padded batch is bisected down to its culprit; NEXTN rounds (captured verify and draft steps)
share steps with prefill chunks while a small pool keeps retracting requests. The plain
engine is built and compiled once per model family; the NEXTN test compiles three more
steps and is `slow`, and so is every Qwen4Exp scenario (whose snapshots also carry the
Gated DeltaNet recurrent state and PLE rings the captured steps resume from).
"""

from __future__ import annotations

import pytest

from runtime import Engine
from runtime.core.forward_mode import ForwardMode
from runtime.execution.graph_runner import GraphRunner
from tests.engine.test_captured_steps import BUCKET, bucket_config
from tests.engine.test_fault_isolation import BAD, poison, run
from tests.engine.test_nextn import make_prompts
from tests.tiny_checkpoints import build_tiny_qwen4_exp_mtp_checkpoint, build_tiny_v4_mtp_checkpoint

GREEDY = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}


@pytest.fixture(
    scope="module", params=["deepseek_v4", pytest.param("qwen4_exp", marks=pytest.mark.slow)]
)
def ckpt(request, tmp_path_factory):
    build = (
        build_tiny_v4_mtp_checkpoint
        if request.param == "deepseek_v4"
        else build_tiny_qwen4_exp_mtp_checkpoint
    )
    return build(tmp_path_factory.mktemp(f"captured_serving_{request.param}"), seed=3)[0]


def capture(engine: Engine, **config) -> dict[str, list[tuple[ForwardMode, bool]]]:
    """Give the engine's runners captured steps (`bucket_config(**config)`); returns, per
    runner role, the mode of each of its forwards that has a captured step and whether it
    replayed it (a whole captured draft round counts as the draft extend it starts with, a
    whole fused NEXTN round as the target verify it starts with)."""
    runners = [engine.runner] + ([engine.worker.drafter.runner] if engine.spec_config else [])
    replays = {}
    for runner in runners:
        graph_runner = GraphRunner(
            runner, bucket_config(**config), engine.config.max_running_requests
        )
        seen = replays[runner.role] = []

        def try_recipe(key, *args, real=graph_runner.try_recipe, seen=seen):
            out = real(key, *args)
            seen.append((ForwardMode.TARGET_VERIFY, out is not None))
            return out

        graph_runner.try_recipe = try_recipe

        def try_forward(inp, graph_runner=graph_runner, real=graph_runner.try_forward, seen=seen):
            out = real(inp)
            if graph_runner.step_key(inp) is not None:
                seen.append((inp.forward_mode, out is not None))
            return out

        def try_draft_round(
            inp, *args, graph_runner=graph_runner, real=graph_runner.try_draft_round, seen=seen
        ):
            out = real(inp, *args)
            if graph_runner.round_key(inp, args[-1]) is not None:  # the extend and the chain
                seen.append((ForwardMode.DRAFT_EXTEND, out is not None))
            return out

        graph_runner.try_forward = try_forward
        graph_runner.try_draft_round = try_draft_round
        runner.graph_runner = graph_runner
    return replays


def eager_outputs(path, prompts, params, **kw) -> list[list[int]]:
    """Plain decoding, eager, no prefix cache: the oracle."""
    engine = Engine(
        model_path=str(path), dtype="float32", page_size=4, disable_radix_cache=True, **kw
    )
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


@pytest.fixture(scope="module")
def captured_plain(ckpt):
    engine = Engine(
        model_path=str(ckpt),
        dtype="float32",
        page_size=4,
        max_running_requests=BUCKET,
        radix_snapshot_interval=8,
    )
    return engine, capture(engine)["target"]


def test_prefix_cache_hits_feed_captured_decode_steps(ckpt, captured_plain):
    """A second turn resumes from the snapshot its first turn's captured decode steps left,
    and requests sharing the first prompt's leading tokens borrow its pages and restore a
    snapshot taken mid-prefill: their captured decode steps (three requests padded into
    bucket 4) give the tokens of eager decoding without a cache."""
    engine, replays = captured_plain
    common = make_prompts(1, seed=21, low=40, high=41)[0]
    first = common + [11, 12, 13]
    assert engine.flush_cache()
    (one,) = engine.generate(input_ids=[first], sampling_params=GREEDY)
    second = [first + one["output_ids"] + [9, 10]]
    second += [common + tail for tail in make_prompts(2, seed=22, low=2, high=9)]
    replays.clear()
    outs = engine.generate(input_ids=second, sampling_params=GREEDY)
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    # the whole first turn but its newest token (in no cache yet); the shared 40 tokens
    # down to the last snapshot point (every 8) whose next token is still shared
    assert cached == [len(first) + GREEDY["max_new_tokens"] - 1, 32, 32]
    assert replays and all(replayed for _, replayed in replays)
    expected = eager_outputs(ckpt, [first] + second, GREEDY)
    assert [one["output_ids"]] + [o["output_ids"] for o in outs] == expected


def test_a_failing_captured_step_fails_only_its_culprit(ckpt, captured_plain):
    """The step raises after its captured forward wrote cache rows for every request of the
    padded batch; bisection retracts and re-runs the suspects (nothing of theirs kept) until
    the culprit fails alone. The others get the output of a run without it."""
    engine, replays = captured_plain
    prompts = make_prompts(5, seed=2, low=4, high=30)
    innocent = prompts[:2] + prompts[3:]
    fired = poison(engine, len(prompts[2]) + 5)
    replays.clear()
    try:
        reqs = [engine.make_request(p, GREEDY, rid=f"r{i}") for i, p in enumerate(innocent)]
        bad = engine.make_request(prompts[2], GREEDY, rid=BAD)
        run(engine, reqs[:2] + [bad] + reqs[2:])
    finally:
        del engine.worker.step  # the worker's own step again
    assert bad.finish_reason.type == "abort" and "kernel exploded" in bad.finish_reason.message
    assert [r.finish_reason.type for r in reqs] == ["length"] * len(reqs)
    assert [r.output_ids for r in reqs] == eager_outputs(ckpt, innocent, GREEDY)
    assert fired[0] > 1 and fired[-1] == 1
    assert not engine.scheduler.isolation.active
    assert replays and all(replayed for _, replayed in replays)


def test_mixed_plain_steps_replay_the_captured_decode(ckpt, captured_plain):
    """Requests that join while others decode share steps with them: the decode rows of
    such a step replay the captured decode step and only the prompt chunks run eagerly;
    the tokens are those of eager decoding without a cache (which runs each mixed step as
    one forward)."""
    engine, replays = captured_plain
    prompts = make_prompts(6, seed=5, low=5, high=40)
    params = [{**GREEDY, "max_new_tokens": n} for n in (6, 18, 11, 24, 9, 15)]
    mixed, decoding, real_step = [], [], engine.worker.step

    def step(prefill, decode):
        mixed.append(bool(prefill) and bool(decode))
        decoding.append(bool(decode))
        return real_step(prefill, decode)

    engine.worker.step = step
    replays.clear()
    try:
        reqs = [engine.make_request(p, sp) for p, sp in zip(prompts, params)]
        run(engine, reqs)
    finally:
        del engine.worker.step
    assert any(mixed)
    # every step with decode rows, mixed or not, replayed the captured decode step once
    assert [mode for mode, _ in replays] == [ForwardMode.DECODE] * sum(decoding)
    assert all(replayed for _, replayed in replays)
    assert [r.output_ids for r in reqs] == eager_outputs(ckpt, prompts, params)


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False])
def test_captured_nextn_under_retraction_equals_plain(ckpt, fused):
    """NEXTN with captured rounds (each greedy round one graph, or the verify and the
    draft's steps as separate captured steps), prefill chunks of 16 sharing steps with
    verify rounds, in a pool so small that requests keep being retracted and resumed: the
    tokens of plain eager decoding, every slot back."""
    prompts = make_prompts(6, seed=4, low=6, high=46)
    params = {**GREEDY, "max_new_tokens": 40}
    engine = Engine(
        model_path=str(ckpt),
        dtype="float32",
        page_size=4,
        chunked_prefill_size=16,
        max_total_tokens=160,
        max_running_requests=BUCKET,
        speculative_algorithm="NEXTN",
        speculative_num_steps=2,
    )
    replays = capture(engine, fused_round=fused)
    mixed = []
    real_step = engine.worker.step

    def step(prefill, decode):
        mixed.append(bool(prefill) and bool(decode))
        return real_step(prefill, decode)

    engine.worker.step = step
    reqs = [engine.make_request(p, params) for p in prompts]
    run(engine, reqs)
    assert [r.finish_reason.type for r in reqs] == ["length"] * len(reqs)
    assert [r.output_ids for r in reqs] == eager_outputs(ckpt, prompts, params)
    assert engine.scheduler.num_retractions > 0 and any(mixed)
    # the target's verify rounds (whole rounds where fused); step by step the draft's
    # extend over the verified rows and its chained steps, which also chain a prompt's
    # proposals after its (eager) draft extend
    assert {mode for mode, _ in replays["target"]} == {ForwardMode.TARGET_VERIFY}
    draft_modes = {mode for mode, _ in replays["draft"]}
    assert draft_modes == (
        {ForwardMode.DECODE} if fused else {ForwardMode.DRAFT_EXTEND, ForwardMode.DECODE}
    )
    assert all(replayed for seen in replays.values() for _, replayed in seen)
