# SPDX-License-Identifier: Apache-2.0
"""One request can never hurt another (issue 14 A), at the engine: a worker step that
raises for one request aborts that request only, and every other request's output is the
output of a run without it, for positional caches (DeepSeek-V4) and recurrent state
(Qwen4Exp's Gated DeltaNet), plain and NEXTN; slots all come back. Errors while admitting
or committing one request stay with it; values that would fail inside a step are refused
when the request is made; duplicate ids and `n > 1` aborts on the `AsyncEngine`."""

from __future__ import annotations

import asyncio

import pytest

from runtime import Engine
from runtime.core.errors import DuplicateRequestError, InvalidRequestError
from runtime.engine.async_engine import AsyncEngine
from tests.engine.test_nextn import make_prompts
from tests.tiny_checkpoints import (
    build_tiny_qwen4_exp_mtp_checkpoint,
    build_tiny_v4_mtp_checkpoint,
    save_char_tokenizer,
)

GREEDY = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
BAD = "poisoned"


@pytest.fixture(scope="module")
def v4_ckpt(tmp_path_factory):
    path = build_tiny_v4_mtp_checkpoint(tmp_path_factory.mktemp("faults_v4"), seed=3)[0]
    save_char_tokenizer(path, 97)
    return path


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    return build_tiny_qwen4_exp_mtp_checkpoint(tmp_path_factory.mktemp("faults_qwen"), seed=4)[0]


def make_engine(path, spec=False, **kw) -> Engine:
    extra = dict(speculative_algorithm="NEXTN", speculative_num_steps=2) if spec else {}
    kw.setdefault("page_size", 4)
    return Engine(model_path=str(path), dtype="float32", max_running_requests=8, **kw, **extra)


def poison(engine: Engine, fail_from: int, after_forward: bool = True, times: int | None = None):
    """Make every worker step that takes request `BAD` to position `fail_from` or beyond
    raise, after the real step ran (its forward wrote cache rows for the whole batch: the
    worst case) or before it. `times` limits how often it fires (a transient fault)."""
    real_step = engine.worker.step
    fired = []

    def step(prefill, decode):
        reached = [c.end for c in prefill if c.req.rid == BAD]
        reached += [r.seq_len for r in decode if r.rid == BAD]
        fire = any(p >= fail_from for p in reached) and (times is None or len(fired) < times)
        if fire and not after_forward:
            fired.append(len(prefill) + len(decode))
            raise RuntimeError("kernel exploded")
        out = real_step(prefill, decode)
        if fire:
            fired.append(len(prefill) + len(decode))
            raise RuntimeError("kernel exploded")
        return out

    engine.worker.step = step
    return fired


def run(engine: Engine, reqs) -> None:
    table = engine.slot_table
    assert engine.flush_cache()
    start = table.allocator.available_tokens(), table.req_pool.available()
    for req in reqs:
        engine.add_request(req)
    while engine.has_work():
        engine.step()
    assert engine.flush_cache()  # the prefix cache gives back every page it kept
    assert (table.allocator.available_tokens(), table.req_pool.available()) == start
    assert start == (table.allocator.capacity_tokens, table.req_pool.max_reqs)


def reference(path, prompts, params, **kw) -> list[list[int]]:
    engine = make_engine(path, **kw)
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


def check_isolated(path, prompts, params, fail_at, after_forward=True, **kw):
    """Prompt 2 (of 7) is the culprit; it fails once it reaches `fail_at` tokens past its
    prompt (0: in its prefill)."""
    innocent = prompts[:2] + prompts[3:]
    expected = reference(path, innocent, params, **kw)
    engine = make_engine(path, **kw)
    bad_prompt = prompts[2]
    fired = poison(engine, len(bad_prompt) + fail_at, after_forward)
    reqs = [engine.make_request(p, params, rid=f"r{i}") for i, p in enumerate(innocent)]
    bad = engine.make_request(bad_prompt, params, rid=BAD)
    run(engine, reqs[:2] + [bad] + reqs[2:])
    assert bad.finish_reason.type == "abort" and "kernel exploded" in bad.finish_reason.message
    assert [r.finish_reason.type for r in reqs] == ["length"] * len(reqs)
    assert [r.output_ids for r in reqs] == expected
    assert fired[0] > 1 and fired[-1] == 1  # a batch failed first; the culprit, alone, last
    assert engine.scheduler.num_failed_steps == len(fired)
    assert not engine.scheduler.isolation.active
    return engine


@pytest.mark.parametrize("fail_at", [0, 5])
@pytest.mark.parametrize("spec", [False, True])
def test_a_step_failing_for_one_request_fails_only_that_request(v4_ckpt, spec, fail_at):
    prompts = make_prompts(7, seed=2, low=4, high=30)
    check_isolated(v4_ckpt, prompts, GREEDY, fail_at, spec=spec, chunked_prefill_size=16)


@pytest.mark.parametrize("spec", [False, True])
def test_isolation_with_prefixes_shared_through_the_prefix_cache(v4_ckpt, spec):
    """Prompts that share 40 tokens: the suspects re-run from the prefix cache's pages and
    state snapshots, which the failed forward never wrote (a request only writes positions
    past its cached prefix), and nothing the failed step computed is cached."""
    common = make_prompts(1, seed=12, low=40, high=41)[0]
    prompts = [common + tail for tail in make_prompts(7, seed=13, low=2, high=12)]
    engine = check_isolated(v4_ckpt, prompts, GREEDY, 4, spec=spec, radix_snapshot_interval=8)
    assert engine.prefix_cache.hit_tokens > 0  # some requests did start from the cache


def test_a_failure_before_the_forward_is_isolated_too(v4_ckpt):
    prompts = make_prompts(7, seed=5, low=4, high=30)
    check_isolated(v4_ckpt, prompts, GREEDY, 3, after_forward=False)


@pytest.mark.parametrize("spec", [False, True])
def test_recurrent_state_is_rebuilt_for_the_innocent_requests(qwen_ckpt, spec):
    """Gated DeltaNet updates its state in place: re-running the failed step would apply
    it twice. The innocent requests' outputs prove their state was rebuilt instead."""
    prompts = make_prompts(7, seed=3, low=4, high=30, vocab=128)
    check_isolated(qwen_ckpt, prompts, GREEDY, 4, spec=spec)


def test_seeded_sampling_of_the_others_is_unchanged(v4_ckpt):
    prompts = make_prompts(7, seed=8, low=4, high=30)
    params = {**GREEDY, "temperature": 1.0, "sampling_seed": 42}
    check_isolated(v4_ckpt, prompts, params, 6, spec=True)


def test_a_transient_failure_aborts_nobody(v4_ckpt):
    """A step that fails once and then succeeds (the fault is not reproduced when its
    requests are re-run): nobody is aborted and the outputs are unchanged."""
    prompts = make_prompts(6, seed=4, low=4, high=30)
    expected = reference(v4_ckpt, prompts, GREEDY)
    engine = make_engine(v4_ckpt)
    fired = poison(engine, 0, times=1)
    reqs = [
        engine.make_request(p, GREEDY, rid=BAD if i == 3 else f"r{i}")
        for i, p in enumerate(prompts)
    ]
    run(engine, reqs)
    assert len(fired) == 1 and fired[0] > 1
    assert [r.finish_reason.type for r in reqs] == ["length"] * len(reqs)
    assert [r.output_ids for r in reqs] == expected


def test_an_error_while_committing_one_request_stays_with_it(v4_ckpt):
    """The detokenizer of one request raises: that request is aborted, the others finish."""
    prompts = ["def fib(n): return n", "hello world", "x = [i for i in range(3)]"]
    engine = make_engine(v4_ckpt)
    expected = [o["output_ids"] for o in engine.generate(prompts, GREEDY)]
    reqs = [engine.make_request(engine.tokenize(p), GREEDY) for p in prompts]

    def broken_add(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken detokenizer")

    reqs[1].detokenizer.add = broken_add
    run(engine, reqs)
    assert reqs[1].finish_reason.type == "abort" and "broken detokenizer" in str(
        reqs[1].finish_reason.message
    )
    assert [reqs[0].output_ids, reqs[2].output_ids] == [expected[0], expected[2]]


def test_a_prompt_longer_than_the_pool_is_refused_without_harm(v4_ckpt):
    """Within the context length but longer than the KV pool: refused when the request is
    made; one that slips past (built by hand) is rejected at admission, alone, without
    leaking a slot, while the request queued behind it runs."""
    engine = make_engine(v4_ckpt, max_total_tokens=64)
    long, short = list(range(3, 83)), list(range(3, 13))
    with pytest.raises(InvalidRequestError, match="KV cache holds 64") as err:
        engine.make_request(long, GREEDY)
    assert err.value.param == "input_ids"
    sneaky = engine.make_request(short, GREEDY)
    sneaky.prompt_ids = long  # what an Engine API caller could build by hand
    ok = engine.make_request(short, GREEDY)
    run(engine, [sneaky, ok])
    assert sneaky.finish_reason.type == "abort" and "pool holds 64" in sneaky.finish_reason.message
    assert ok.finish_reason.type == "length" and len(ok.output_ids) == GREEDY["max_new_tokens"]


BAD_VALUES = [
    ({"sampling_seed": 2**64}, "sampling_seed"),
    ({"sampling_seed": -(2**63) - 1}, "sampling_seed"),
    ({"sampling_seed": 2**63 - 1, "n": 2}, "sampling_seed"),
    ({"sampling_seed": 1.5}, "sampling_seed"),
    ({"min_new_tokens": 4, "stop_token_ids": [999999]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"stop": "\ud800"}, "stop"),
]


@pytest.mark.parametrize("params,param", BAD_VALUES)
def test_values_that_would_fail_inside_a_step_are_refused_up_front(v4_ckpt, params, param):
    engine = make_engine(v4_ckpt)
    with pytest.raises(InvalidRequestError) as err:
        engine.make_requests([5, 6, 7], {**GREEDY, **params})
    assert err.value.param == param


@pytest.mark.parametrize(
    "call,param",
    [
        (lambda e: e.make_request([5, 6, 4096 + 1], GREEDY), "input_ids"),
        (lambda e: e.make_request([5, 6, -1], GREEDY), "input_ids"),
        (lambda e: e.make_request("abc", GREEDY), "input_ids"),
        (lambda e: e.make_request([5, 6], GREEDY, rid=7), "rid"),
        (lambda e: e.make_request([5, 6], GREEDY, top_logprobs_num=-1), "top_logprobs_num"),
        (lambda e: e.tokenize("ab\udc00c"), "text"),
        (lambda e: e.tokenize("a" * (e.limits.max_text_chars + 1)), "text"),
    ],
)
def test_prompts_and_options_are_checked(v4_ckpt, call, param):
    engine = make_engine(v4_ckpt)
    with pytest.raises(InvalidRequestError) as err:
        call(engine)
    assert err.value.param == param


# -- AsyncEngine ---------------------------------------------------------------------------


@pytest.fixture
def loop_engine(v4_ckpt):
    observed = []
    runner = AsyncEngine(make_engine(v4_ckpt), on_step=lambda *step: observed.append(step))
    yield runner, observed
    runner.shutdown()


def test_a_live_request_id_is_refused_and_the_first_request_is_unaffected(loop_engine):
    runner, _ = loop_engine
    engine = runner.engine
    expected = engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"]

    async def scenario():
        first = engine.make_request([5, 6, 7], GREEDY, rid="same")
        task = asyncio.ensure_future(runner.generate(first))
        await asyncio.sleep(0)
        second = engine.make_request([9, 9], GREEDY, rid="same")
        with pytest.raises(DuplicateRequestError):
            runner.submit([second])
        twins = engine.make_requests([5, 6], {**GREEDY, "n": 2}, rid="same")  # same-0, same-1
        with pytest.raises(DuplicateRequestError):
            runner.submit(twins)  # the client id "same" is live
        result = await task
        again = await runner.generate(engine.make_request([5, 6, 7], GREEDY, rid="same"))
        return result, again

    result, again = asyncio.run(scenario())
    assert list(result.output_ids) == expected and list(again.output_ids) == expected
    assert runner.stats.is_idle and not runner.is_live("same")


def test_the_client_id_of_an_n_request_aborts_its_choices(loop_engine):
    runner, _ = loop_engine
    engine = runner.engine

    async def scenario():
        reqs = engine.make_requests([5, 6, 7], {**GREEDY, "max_new_tokens": 900, "n": 3}, rid="p")
        runner.submit(reqs)
        streams = [runner.stream(r) for r in reqs]
        first = await asyncio.gather(*(s.__anext__() for s in streams))
        assert runner.abort("p") == ["p-0", "p-1", "p-2"]
        assert runner.abort("nobody") == []
        finals = list(first)
        for i, stream in enumerate(streams):
            async for snapshot in stream:
                finals[i] = snapshot
        return finals

    finals = asyncio.run(scenario())
    assert [f.aborted for f in finals] == [True] * 3
    assert all(f.completion_tokens < 900 for f in finals)
    assert runner.stats.is_idle


def test_requests_with_no_tokens_to_generate_are_reported(loop_engine):
    runner, observed = loop_engine

    async def scenario():
        return await runner.generate(
            runner.engine.make_request([5, 6], {**GREEDY, "max_new_tokens": 0})
        )

    result = asyncio.run(scenario())
    assert result.finished and result.completion_tokens == 0
    assert any(r.rid == result.rid and r.finished for step in observed for r in step[0])


def test_shutdown_aborts_what_is_left(v4_ckpt):
    runner = AsyncEngine(make_engine(v4_ckpt))

    async def scenario():
        req = runner.engine.make_request([5, 6, 7], {**GREEDY, "max_new_tokens": 900})
        stream = runner.stream(req)
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, runner.shutdown)
        last = None
        async for snapshot in stream:
            last = snapshot
        return last

    last = asyncio.run(scenario())
    assert last.aborted and "shutting down" in last.finish_reason.message
    assert not runner.alive
