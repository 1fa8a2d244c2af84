# SPDX-License-Identifier: Apache-2.0
"""Captured decode, verify and draft steps (`runtime.execution.graph_runner`).

Each capturable step traces to one graph without a break (so a change that breaks capture
fails here), and replaying a captured step gives what the eager step gives: logits within
the parity tolerance, the same greedy tokens for plain decoding and NEXTN, with live
batches padded into a larger bucket and requests joining and leaving between replays.
Compiling costs minutes on a CPU; only the runner-level test compiles in the default run,
the engine-level ones are `slow`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from types import SimpleNamespace

import pytest
import torch

from runtime import Engine
from runtime.cache import PagedTokenAllocator, ReqToTokenPool, SlotTable
from runtime.configs.capture import DISABLE_ENV, CaptureConfig, default_cache_dir
from runtime.configs.model_config import ModelConfig
from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.engine.capture_warmup import captured_runners
from runtime.execution import compile_worker, step_compiler
from runtime.execution.graph_runner import GraphRunner, StepState, draft_round_function
from runtime.execution.model_input import ModelInput
from runtime.execution.model_runner import ModelRunner
from runtime.kernels import cpu_extension, tile_product
from runtime.kernels import grouped_gemm as grouped_gemm_mod
from runtime.layers import narrow_weights
from runtime.layers.moe import experts as experts_mod
from runtime.layers.narrow_weights import attach_narrow_copies
from runtime.model_loader.build import load_model
from runtime.models.registry import model_classes
from runtime.speculative.draft_batch import DraftBatch
from runtime.speculative.drafter import MTPDrafter
from tests.engine.test_engine import hf_greedy
from tests.tiny_checkpoints import (
    build_tiny_qwen4_exp_mtp_checkpoint,
    build_tiny_v4_mtp_checkpoint,
)

ATOL = 1e-4  # the parity tests' tolerance on fp32 logits
BUCKET = 4


def bucket_config(**overrides) -> CaptureConfig:
    """Bucket 4, compiled inline, with inductor's Python wrapper: it compiles in about half
    the time of the default C++ wrapper (the slow engine-level test covers that one)."""
    options = {"cpp_wrapper": False}
    return CaptureConfig(
        **{"batch_sizes": (BUCKET,), "background": False, "inductor_options": options, **overrides}
    )


def make_runners(path, steps=3, capture=None, draft=True, narrow=False):
    """Target (and draft) runners sharing one slot table, as the engine builds them.
    `narrow`: round the weights to bf16 values first, as a bf16 checkpoint's are, so the
    captured steps read bf16 copies (`narrow_weights`) as the engine's do."""
    config = ModelConfig.from_path(str(path), "float32")
    table = SlotTable(ReqToTokenPool(8, 256), PagedTokenAllocator(256, 4))
    target = ModelRunner(load_model(config, None, progress=False), config, table, steps + 1)
    if capture is not None:
        target.graph_runner = GraphRunner(target, capture, 8)
    drafter = None
    if draft:
        draft_cls = model_classes()[type(target.model).draft_architecture]
        model = load_model(config, draft_cls, progress=False)
        drafter = ModelRunner(model, config, table, steps + 1)
        drafter.model.set_embed_and_head(*target.model.get_embed_and_head())
    if narrow:
        models = [r.model for r in (target, drafter) if r is not None]
        for model in models:
            for param in model.parameters():
                param.data = param.data.bfloat16().to(param.dtype)
        assert attach_narrow_copies(models, min_numel=1) > 0  # the tiny model's are small
    return table, target, drafter


def prefill(table, runner, prompts):
    reqs = []
    for _ in prompts:
        req = table.open_request()
        table.reserve(req, 128)
        reqs.append(req)
    ids = torch.tensor([t for p in prompts for t in p])
    runner.forward(
        ModelInput(
            ForwardMode.EXTEND,
            ids,
            reqs,
            [0] * len(prompts),
            [len(p) for p in prompts],
            capture_hidden_mode=CaptureHiddenMode.FULL,
        )
    )
    return reqs


def prompts_of(lengths, seed=0, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------------------------
# one graph, no break


def assert_one_graph(runner: ModelRunner, inp: ModelInput) -> None:
    """The step `inp` runs traces into exactly one graph (padded into the bucket where the
    pool supports captured steps, as the graph runner runs it)."""
    graph_runner = GraphRunner(runner, bucket_config(), 8)
    key = graph_runner.step_key(inp)
    if graph_runner.capturable:
        assert key is not None, "a uniform decode/verify/draft step must be capturable"
        ctx, ids, hidden = graph_runner.padded_batch(inp, key)
        step_idx = key.spec_step_idx
    else:
        ctx, ids, hidden = runner.build_context(inp), inp.input_ids, inp.captured_hidden_states
        step_idx = inp.spec_step_idx

    def step(ctx, ids, hidden):
        out = runner.call_model(ctx, ids, hidden, step_idx)
        return out.next_token_logits, out.hidden_states

    with torch.inference_mode():
        explanation = torch._dynamo.explain(step)(ctx, ids, hidden)
    reasons = [b.reason for b in explanation.break_reasons]
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), reasons
    return {str(node.target) for graph in explanation.graphs for node in graph.graph.nodes}


def nextn_step_inputs(table, target, drafter, steps=3):
    """Three requests (bucket 4 pads one) after a prefill: the target's decode and verify
    inputs, the draft's extend over verified rows and a chained draft step."""
    prompts = prompts_of((9, 21, 30))
    reqs = prefill(table, target, prompts)
    width, hidden_width = steps + 1, None
    prefix = [len(p) for p in prompts]
    verify = ModelInput(
        ForwardMode.TARGET_VERIFY,
        torch.arange(3 * width) + 5,
        reqs,
        prefix,
        [width] * 3,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        logits_row_indices=None,
    )
    hidden_width = target.forward(verify).hidden_states.shape[1]
    decode = ModelInput(ForwardMode.DECODE, torch.tensor([3, 4, 5]), reqs, prefix, [1] * 3)
    # NEXTN's plain decode in large batches keeps each row's hidden state for the draft
    decode_hidden = ModelInput(
        ForwardMode.DECODE,
        torch.tensor([3, 4, 5]),
        reqs,
        prefix,
        [1] * 3,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        logits_row_indices=[0, 1, 2],
    )
    draft_extend = ModelInput(
        ForwardMode.DRAFT_EXTEND,
        torch.arange(3 * width) + 7,
        reqs,
        prefix,
        [width] * 3,
        capture_hidden_mode=CaptureHiddenMode.LAST,
        captured_hidden_states=torch.randn(3 * width, hidden_width),
        logits_row_indices=[0, width + 2, 2 * width + 1],
    )
    draft_step = ModelInput(
        ForwardMode.DECODE,
        torch.tensor([8, 9, 10]),
        reqs,
        [p + 2 for p in prefix],
        [1] * 3,
        capture_hidden_mode=CaptureHiddenMode.LAST,
        captured_hidden_states=torch.randn(3, hidden_width),
        spec_step_idx=1,
    )
    target_steps = {"decode": decode, "decode with hidden": decode_hidden, "verify": verify}
    return target_steps, {"extend": draft_extend, "step": draft_step}


@pytest.fixture(scope="module")
def v4_mtp(tmp_path_factory):
    """(checkpoint dir, transformers target model) of a DeepSeek-V4 with an MTP layer."""
    return build_tiny_v4_mtp_checkpoint(tmp_path_factory.mktemp("capture_v4"), seed=7)[:2]


@pytest.fixture(scope="module")
def qwen_mtp(tmp_path_factory):
    """(checkpoint dir, transformers target model) of a Qwen4Exp with an MTP layer."""
    return build_tiny_qwen4_exp_mtp_checkpoint(tmp_path_factory.mktemp("capture_qwen"), seed=9)[:2]


def checkpoint_of(family: str, request):
    return request.getfixturevalue("v4_mtp" if family == "deepseek_v4" else "qwen_mtp")


@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("family", ["deepseek_v4", "qwen4_exp"])
def test_decode_verify_and_draft_steps_trace_to_one_graph(family, narrow, request, monkeypatch):
    """`narrow`: the weights have bf16 copies and the narrow-weight kernel is loaded, so
    the products take the reduction, the kernel and the experts' narrow form; otherwise the
    GEMMs and the experts' gathered form, and their sorted form from the verify's pairs on."""
    monkeypatch.setattr(experts_mod, "SORTED_MIN_PAIRS", BUCKET * 4 * 2)
    if narrow and not cpu_extension.load(default_cache_dir()):
        pytest.skip("the narrow-weight kernel cannot be built here")
    table, target, drafter = make_runners(checkpoint_of(family, request)[0], narrow=narrow)
    target_steps, draft_steps = nextn_step_inputs(table, target, drafter)
    ops = set()
    for inp in target_steps.values():
        ops |= assert_one_graph(target, inp)
    for inp in draft_steps.values():
        ops |= assert_one_graph(drafter, inp)
    # the verify's rows (bucket x 4) are enough for the AMX tile products where usable
    tiles = narrow and tile_product.ready() and BUCKET * 4 >= narrow_weights.TILE_MIN_ROWS
    assert any("tile_product" in op for op in ops) == tiles, sorted(ops)


@pytest.mark.parametrize("hot_vocab", [False, True])
@pytest.mark.parametrize("family", ["deepseek_v4", "qwen4_exp"])
def test_draft_round_traces_to_one_graph(family, hot_vocab, request):
    """The merged draft round (extend, argmax, two chained steps) is one graph too, also
    with a hot-vocabulary head (`--speculative-token-map`)."""
    table, target, drafter = make_runners(checkpoint_of(family, request)[0])
    if hot_vocab:
        drafter.model.use_hot_vocab(range(0, drafter.model_config.vocab_size, 3))
    _, draft_steps = nextn_step_inputs(table, target, drafter)
    extend = draft_steps["extend"]
    graph_runner = GraphRunner(drafter, bucket_config(), 8)
    key = graph_runner.round_key(extend, 3)
    assert key is not None, "a uniform draft extend over verified rows must be capturable"
    positions = [p + g + 1 for p, g in zip(extend.prefix_lens, (0, 2, 1))]
    contexts, ids, hidden = graph_runner.padded_round(extend, positions, key)
    assert len(contexts) == 3
    round_fn = draft_round_function(drafter, key)
    with torch.inference_mode():
        explanation = torch._dynamo.explain(round_fn)(contexts, ids, hidden, key.spec_step_idx)
    reasons = [b.reason for b in explanation.break_reasons]
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), reasons


# ---------------------------------------------------------------------------------------
# captured == eager


def state_rewind(pool):
    """Running a step twice on the same caches rewrites the same position-keyed rows, but
    advances a recurrent state (Qwen4Exp's Gated DeltaNet) twice: returns a function that
    puts the recurrent states back as they are now."""
    saved = [(buf, buf.clone()) for buf in getattr(pool, "ssm_state", {}).values()]

    def rewind():
        for buf, copy in saved:
            buf.copy_(copy)

    return rewind


@pytest.mark.parametrize(
    "family,moe_form",
    [
        ("deepseek_v4", "narrow"),
        ("deepseek_v4", "gathered"),
        ("deepseek_v4", "sorted"),
        ("qwen4_exp", "narrow"),
    ],
)
def test_captured_decode_matches_eager_logits_with_padding_and_churn(
    family, moe_form, request, monkeypatch
):
    """Decode steps of 1 to 4 live requests in bucket 4 (requests join and leave between
    steps, contexts grow past one padded entry count of the compressed layers, or of the
    key blocks with QSA's selection active; one live request pads into bucket 4 while its own
    bucket 1 is compiling): each captured step's logits equal the eager step's on the same
    caches. The weights hold bf16 values, so the captured step reads their bf16 copies.
    `moe_form`: the routed experts' form in the captured step (bucket 4's 8 pairs take the
    narrow-weight kernel; "gathered" and "sorted" turn it off, "sorted" lowers
    `SORTED_MIN_PAIRS` below them). Products of up to 8 rows take the kernel too."""
    if moe_form == "narrow" and not cpu_extension.load(default_cache_dir()):
        pytest.skip("the narrow-weight kernel cannot be built here")
    if moe_form != "narrow":
        monkeypatch.setattr(experts_mod, "KERNEL_MAX_PAIRS", 0)
    if moe_form == "sorted":
        monkeypatch.setattr(experts_mod, "SORTED_MIN_PAIRS", BUCKET * 2)
    grouped = []  # grouped GEMMs run by the experts' sorted form (the custom op's body)
    product = grouped_gemm_mod.grouped_gemm
    monkeypatch.setattr(
        grouped_gemm_mod, "grouped_gemm", lambda *a: grouped.append(1) or product(*a)
    )
    path = request.getfixturevalue("tiny_v4" if family == "deepseek_v4" else "qwen_mtp")[0]
    config = bucket_config(batch_sizes=(1, BUCKET))
    table, runner, _ = make_runners(path, capture=config, draft=False, narrow=True)
    graph_runner = runner.graph_runner
    prompts = prompts_of((30, 7, 66, 12), seed=3)
    live = dict(zip(range(3), prefill(table, runner, prompts[:3])))
    lengths = {i: len(prompts[i]) for i in live}
    tokens = {i: prompts[i][-1] for i in live}
    for step in range(8):
        if step == 3:  # a fourth request joins
            live[3] = prefill(table, runner, prompts[3:4])[0]
            lengths[3], tokens[3] = len(prompts[3]), prompts[3][-1]
        if step == 6:  # three leave
            del live[0], live[2], live[3]
        order = sorted(live)
        inp = ModelInput(
            ForwardMode.DECODE,
            torch.tensor([tokens[i] for i in order]),
            [live[i] for i in order],
            [lengths[i] for i in order],
            [1] * len(order),
        )
        if len(order) == 1:  # bucket 1 still compiling: the step pads into bucket 4
            graph_runner.captured_step(graph_runner.step_key(inp)).state = StepState.COMPILING
        rewind = state_rewind(runner.kv_pool)
        runner.graph_runner = None
        eager = runner.forward(inp).next_token_logits
        rewind()
        runner.graph_runner = graph_runner
        before = len(grouped)
        captured = runner.forward(inp).next_token_logits
        assert (len(grouped) > before) == (family == "deepseek_v4" and moe_form == "sorted")
        assert captured.shape == eager.shape == (len(order), eager.shape[1])
        torch.testing.assert_close(captured, eager, atol=ATOL, rtol=0, msg=f"step {step}")
        for i, token in zip(order, eager.argmax(-1).tolist()):
            tokens[i], lengths[i] = token, lengths[i] + 1
    assert [s for _, s, _ in graph_runner.compiled_steps()] == ["ready", "compiling"]
    one_request = graph_runner.step_key(inp)  # the last steps' own bucket, still compiling
    assert one_request.bucket == 1 and graph_runner.captured_step(one_request).runs == 0
    assert graph_runner.captured_step(dataclasses.replace(one_request, bucket=BUCKET)).runs == 8


@pytest.mark.parametrize("family", ["deepseek_v4", "qwen4_exp"])
def test_captured_draft_round_matches_eager_drafter(family, request):
    """Draft rounds of 1 to 4 live requests in bucket 4 (requests join and leave between
    rounds, each round accepts a different number of drafts per request; one live request
    pads into bucket 4 while its own bucket 1 is compiling): the merged captured round
    (extend over the verified rows and the chained steps in one graph, reading the bf16
    copies of weights that hold bf16 values) proposes exactly the eager step-by-step
    drafter's tokens from the same caches."""
    steps, width = 3, 4
    table, target, runner = make_runners(
        checkpoint_of(family, request)[0], steps=steps, narrow=True
    )
    graph_runner = GraphRunner(runner, bucket_config(batch_sizes=(1, BUCKET)), 8)
    drafter = MTPDrafter(runner, steps)
    g = torch.Generator().manual_seed(11)
    prompts = prompts_of((30, 7, 66, 12), seed=5)

    def join(indices):
        """Target prefill, then the eager draft over the prompt rows (fills its cache)."""
        chosen = [prompts[i] for i in indices]
        reqs = prefill(table, target, chosen)
        hidden = target.forward(
            ModelInput(
                ForwardMode.EXTEND,
                torch.tensor([t for p in chosen for t in p]),
                reqs,
                [0] * len(chosen),
                [len(p) for p in chosen],
                capture_hidden_mode=CaptureHiddenMode.FULL,
            )
        ).hidden_states
        batch = DraftBatch(
            reqs=[SimpleNamespace(req_pool_idx=r, grammar=None) for r in reqs],
            prefix_lens=[0] * len(chosen),
            extend_lens=[len(p) for p in chosen],
            next_tokens=torch.tensor([t for p in chosen for t in p[1:] + [p[0]]]),
            target_hidden=hidden,
            gather_rows=[len(p) - 1 for p in chosen],
            propose=[True] * len(chosen),
        )
        runner.graph_runner = None
        drafter.draft(batch)
        return dict(zip(indices, reqs)), hidden.shape[1]

    live, hidden_width = join([0, 1, 2])
    lengths = {i: len(prompts[i]) for i in live}
    for step in range(7):
        if step == 3:  # a fourth request joins
            joined, _ = join([3])
            live.update(joined)
            lengths[3] = len(prompts[3])
        if step == 5:  # three leave
            del live[0], live[2], live[3]
        order = sorted(live)
        bs = len(order)
        accepted = torch.randint(0, width, (bs,), generator=g).tolist()
        batch = DraftBatch(
            reqs=[SimpleNamespace(req_pool_idx=live[i], grammar=None) for i in order],
            prefix_lens=[lengths[i] for i in order],
            extend_lens=[width] * bs,
            next_tokens=torch.randint(2, 97, (bs * width,), generator=g),
            target_hidden=torch.randn(bs * width, hidden_width, generator=g),
            gather_rows=accepted,
            propose=[True] * bs,
        )
        key = graph_runner.round_key(drafter._extend_input(batch), steps)
        assert key.draft_steps == steps
        if bs == 1:  # bucket 1 still compiling: the round pads into bucket 4
            graph_runner.captured_step(key, batch.target_hidden).state = StepState.COMPILING
        bucket_round = graph_runner.captured_step(
            dataclasses.replace(key, bucket=BUCKET), batch.target_hidden
        )
        runs_before = bucket_round.runs
        rewind = state_rewind(runner.kv_pool)
        runner.graph_runner = None
        eager = drafter.draft(batch)
        rewind()
        runner.graph_runner = graph_runner
        captured = drafter.draft(batch)
        assert captured == eager, f"round {step}"
        assert bucket_round.runs == runs_before + 1  # the round ran captured, in bucket 4
        for i, m in zip(order, accepted):
            lengths[i] += m + 1
    assert bucket_round.runs == 7  # all seven rounds ran captured


# ---------------------------------------------------------------------------------------
# engine level: greedy tokens (slow: compiles the target decode, verify and draft steps)

GREEDY = {"temperature": 0, "ignore_eos": True}


def staggered_generate(engine, prompts, lengths, waits=None):
    """Requests join while others run and leave at different times (different lengths):
    request i is followed by `waits[i]` steps (default `i % 3`) before the next joins."""
    waits = [i % 3 for i in range(len(prompts))] if waits is None else waits
    reqs = []
    for ids, n, wait in zip(prompts, lengths, waits):
        reqs.append(engine.make_request(ids, {**GREEDY, "max_new_tokens": n}))
        engine.add_request(reqs[-1])
        for _ in range(wait):
            if engine.has_work():
                engine.step()
    while engine.has_work():
        engine.step()
    return [list(r.output_ids) for r in reqs]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v4", "qwen4_exp"])
def test_captured_engines_equal_eager_plain(family, request, monkeypatch, tmp_path):
    """Plain and NEXTN engines (greedy rounds fused into one graph or run step by step,
    speculation off in larger batches, a hot-vocabulary draft head) replaying
    captured steps (bucket 4, 1 to 4 live requests) give the eager plain engine's greedy
    tokens, which equal transformers' `generate` (contexts long enough for QSA's selection
    and past one padded key-block count)."""
    path, hf = checkpoint_of(family, request)
    prompts = prompts_of((5, 23, 40, 11, 33), seed=4)
    lengths = [30, 12, 25, 40, 18]
    common = dict(model_path=str(path), dtype="float32", page_size=4)
    reference = staggered_generate(Engine(**common, disable_cuda_graph=True), prompts, lengths)
    for ids, n, tokens in zip(prompts, lengths, reference):
        assert tokens == hf_greedy(hf, ids, n)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    nextn = {
        "speculative_algorithm": "NEXTN",
        "speculative_num_steps": 3,
        "speculative_disable_by_batch_size": "none",
    }
    # the one limited to 3 decodes without speculation in batches of 3 and 4 (the captured
    # decode step with hidden states), then catches the draft up as the batch shrinks
    hot_table = tmp_path / "freq.json"
    hot_table.write_text(json.dumps(list(range(0, 97, 2))))
    variants = (
        {},
        # greedy rounds run fused (`CapturedRound`); the default policy times them
        {**nextn, "speculative_disable_by_batch_size": "auto"},
        {**nextn, "disable_fused_nextn_round": True},  # verify, then the draft's round
        {**nextn, "speculative_disable_by_batch_size": 3},
        {**nextn, "speculative_token_map": str(hot_table)},  # a hot-vocabulary draft head
    )
    for spec in variants:
        engine = Engine(**common, cuda_graph_bs=[BUCKET], capture_compile="inline", **spec)
        assert staggered_generate(engine, prompts, lengths) == reference, spec
        runners = [engine.runner] + ([engine.worker.drafter.runner] if spec else [])
        for runner in runners:
            states = runner.graph_runner.compiled_steps()
            assert states and all(s == "ready" for _, s, _ in states), states
        target_steps = [name for name, _, _ in engine.runner.graph_runner.compiled_steps()]
        fused = f"nextn round bs {BUCKET} x 4 rows"
        assert (fused in target_steps) == (
            spec.get("disable_fused_nextn_round") is None and bool(spec)
        )
        if spec.get("speculative_disable_by_batch_size") == "auto":
            measured = engine.stats().spec_buckets[str(BUCKET)]
            assert measured["rounds"] > 0 and measured["round_ms"] > 0, measured
        if spec.get("speculative_disable_by_batch_size") == 3:
            target_steps = [name for name, _, _ in engine.runner.graph_runner.compiled_steps()]
            assert "decode bs 4" in target_steps, target_steps


def test_cuda_runner_records_inline_and_warns_about_compiling_on_first_use(caplog):
    """On a CUDA device a bucket is recorded in the calling thread even in the background
    mode (recording beside the serving thread's synchronising calls would fail them), and
    `--enable-torch-compile` without `startup` warns that each step then compiles on first
    use. Nothing here touches a GPU: the runner is only constructed and asked."""
    pool = SimpleNamespace(pad_req=0, max_context_len=64)
    runner = SimpleNamespace(device="cuda", slot_table=SimpleNamespace(req_pool=pool), kv_pool=None)
    plain = GraphRunner(runner, CaptureConfig(batch_sizes=(1, 4)), 4)
    assert plain.cuda and "CUDA graphs" in plain.describe()
    assert "recorded on first use" in plain.describe()
    recorded = []
    plain.compiler.compile_step = recorded.append  # what `schedule` does with a pending step
    plain.compiler.schedule("step")
    assert recorded == ["step"] and plain.compiler.worker is None  # no worker thread
    with caplog.at_level("WARNING", logger="runtime.execution.step_compiler"):
        compiled = GraphRunner(runner, CaptureConfig(batch_sizes=(1,), torch_compile=True), 4)
    assert "torch.compile + CUDA graphs" in compiled.describe()
    assert any("--capture-compile startup" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="runtime.execution.step_compiler"):
        GraphRunner(runner, CaptureConfig(torch_compile=True, background=False), 4)
    assert not caplog.records


def test_steps_that_meet_their_bucket_not_ready_are_counted_unsettled(tiny_v4, monkeypatch):
    """A measured speculation policy times steps that met their own bucket compiling (or
    about to) apart from the others: `unsettled_runs` counts them, and only them. A step kind that
    start-up left uncompiled (it runs eagerly for good) is settled."""
    from runtime.execution.graph_runner import LOGITS_PER_REQUEST, StepKey

    _, runner, _ = make_runners(tiny_v4[0], capture=bucket_config(batch_sizes=(1, 2)), draft=False)
    graph_runner = runner.graph_runner
    scheduled = []

    def schedule(step):
        scheduled.append(step)
        step.state = StepState.COMPILING  # as the background compile thread's queue does

    monkeypatch.setattr(graph_runner.compiler, "schedule", schedule)
    key = StepKey(ForwardMode.DECODE, 1, 1, CaptureHiddenMode.NULL, LOGITS_PER_REQUEST, False, 0)
    assert graph_runner.compiler.ready_step(key, None) is None and graph_runner.unsettled_runs == 1
    assert graph_runner.compiler.ready_step(key, None) is None and graph_runner.unsettled_runs == 2
    scheduled[0].state = StepState.READY
    assert graph_runner.compiler.ready_step(key, None) is scheduled[0]
    assert graph_runner.unsettled_runs == 2
    graph_runner.compiles_on_demand = False
    assert graph_runner.compiler.ready_step(dataclasses.replace(key, bucket=2), None) is None
    assert graph_runner.unsettled_runs == 2 and len(scheduled) == 1


def test_compile_buckets_repeats_every_seen_step_at_each_bucket(tiny_v4, monkeypatch):
    """A benchmark's warm-up meets each step kind at one batch size; `compile_buckets` then
    compiles those kinds at every requested bucket the runner has (the compile itself is
    stubbed here: which steps get compiled is what is checked)."""
    config = bucket_config(batch_sizes=(1, 2, 4))
    table, runner, _ = make_runners(tiny_v4[0], capture=config, draft=False)
    graph_runner = runner.graph_runner
    compiled = []

    def fake_compile(step):
        compiled.append(step.key)
        step.state = StepState.READY

    monkeypatch.setattr(graph_runner.compiler, "compile_step", fake_compile)
    prompts = prompts_of((9,), seed=5)
    reqs = prefill(table, runner, prompts)
    inp = ModelInput(ForwardMode.DECODE, torch.tensor([prompts[0][-1]]), reqs, [9], [1])
    key = graph_runner.step_key(inp)
    graph_runner.captured_step(key).state = StepState.READY  # as if the warm-up had run it
    graph_runner.compile_buckets([1, 2, 4, 8])  # 8 is not one of the runner's buckets
    assert compiled == [dataclasses.replace(key, bucket=b) for b in (2, 4)]


@pytest.mark.slow
def test_default_model_captured_steps_read_narrow_copies(monkeypatch):
    """The embedded model is bf16 on disk: served in fp32 with captured steps, its products
    read bf16 copies of the weights (`narrow_weights`), and plain and NEXTN greedy output
    equal eager plain decoding's (which reads the fp32 weights)."""
    prompts = ["def add(a, b):\n", "import os\n\nclass Config:\n", "for i in range("]
    params = [{**GREEDY, "max_new_tokens": n} for n in (24, 40, 16)]
    eager = Engine(dtype="float32", disable_cuda_graph=True).generate(prompts, params)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    for spec in ({}, {"speculative_algorithm": "NEXTN"}):
        engine = Engine(dtype="float32", cuda_graph_bs=[BUCKET], capture_compile="inline", **spec)
        narrow = [n for n, _ in engine.runner.model.named_buffers() if n.endswith("_narrow")]
        assert any("experts" in n for n in narrow) and any("lm_head" in n for n in narrow)
        outs = engine.generate(prompts, params)
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in eager], spec


def test_narrow_copies_follow_the_flag_and_the_dtype(monkeypatch):
    """The embedded bf16 model in fp32 with captured steps gets bf16 copies (of its routed
    experts, linear layers and LM head, one copy of the head target and draft share when
    the draft scores the whole vocabulary; with the model's own hot vocabulary, the
    default, the draft's smaller head has its own); `--disable-narrow-weights`,
    `--disable-cuda-graph` or bf16 weights get none. Nothing compiles here (no step
    runs)."""
    monkeypatch.delenv(DISABLE_ENV, raising=False)

    def copies(**kw):
        engine = Engine(capture_compile="inline", speculative_algorithm="NEXTN", **kw)
        models = [engine.runner.model, engine.worker.drafter.runner.model]
        return [
            (name, buf)
            for m in models
            for name, buf in m.named_buffers()
            if name.endswith("_narrow")
        ]

    made = copies(dtype="float32", speculative_token_map="none")
    assert made and all(b.dtype == torch.bfloat16 for _, b in made)
    assert any("experts" in n for n, _ in made) and any("wq_b" in n for n, _ in made)
    heads = [b for n, b in made if "lm_head" in n]
    assert len(heads) == 2 and len({b.data_ptr() for b in heads}) == 1
    heads = [b for n, b in copies(dtype="float32") if "lm_head" in n]
    assert sorted(b.shape[0] for b in heads) == [2049, 4096]
    assert not copies(dtype="float32", disable_narrow_weights=True)
    assert not copies(dtype="float32", disable_cuda_graph=True)
    assert not copies(dtype="bfloat16")


# Qwen4Exp's half is slow-marked: the default run stays within its time budget
@pytest.mark.parametrize(
    "family", ["deepseek_v4", pytest.param("qwen4_exp", marks=pytest.mark.slow)]
)
def test_guards_of_captured_steps_hold_for_every_batch(family, request, monkeypatch, eager_dynamo):
    """Captured calls skip dynamo's guards, except while another thread compiles
    (`GuardSkipping`), when every call evaluates them: a guard that a later batch fails
    would then recompile in the serving thread (minutes, mid-traffic). With the guards
    evaluated on every call and a recompile made an error, NEXTN (greedy rounds fused,
    sampled ones step by step) and plain engines serve batches of 1 to 4 requests joining
    and leaving, contexts growing past a padded entry count, with plain decoding's greedy
    tokens. Dynamo's eager backend stands in for inductor: guards are dynamo's."""
    import torch._dynamo.config as dynamo_config

    path, _ = checkpoint_of(family, request)
    prompts = prompts_of((5, 23, 40, 11, 33), seed=5)
    lengths = [30, 12, 25, 40, 18]
    common = dict(model_path=str(path), dtype="float32", page_size=4)
    reference = staggered_generate(Engine(**common, disable_cuda_graph=True), prompts, lengths)
    monkeypatch.setattr(step_compiler, "guard_skipping", step_compiler.GuardSkipping(False))
    monkeypatch.setattr(dynamo_config, "error_on_recompile", True)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    nextn = {"speculative_algorithm": "NEXTN", "speculative_disable_by_batch_size": "none"}
    for spec in ({}, nextn):
        engine = Engine(**common, cuda_graph_bs=[1, BUCKET], capture_compile="inline", **spec)
        assert staggered_generate(engine, prompts, lengths) == reference, spec
        sampled = {"temperature": 1.0, "sampling_seed": 2, "max_new_tokens": 9}
        engine.generate(input_ids=prompts[:3], sampling_params=sampled)
        states = [
            s for r in captured_runners(engine) for _, s, _ in r.graph_runner.compiled_steps()
        ]
        assert states and set(states) == {"ready"}, states


def test_serving_while_steps_compile_in_the_background(request, monkeypatch, eager_dynamo):
    """The default mode: each step compiles on a worker thread the first time a batch needs
    it while the serving thread runs it eagerly, then replays it. No compile fails, every
    request gets plain decoding's greedy tokens throughout, and greedy rounds end up fused
    at every bucket. Dynamo's eager backend stands in for inductor."""
    path, _ = checkpoint_of("deepseek_v4", request)
    prompts = prompts_of((5, 23, 40, 11), seed=8)
    lengths = [16, 9, 20, 12]
    common = dict(model_path=str(path), dtype="float32", page_size=4)
    reference = staggered_generate(Engine(**common, disable_cuda_graph=True), prompts, lengths)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    engine = Engine(
        **common,
        speculative_algorithm="NEXTN",
        cuda_graph_bs=[1, 2, BUCKET],
        capture_compile="background",
    )
    graph_runners = [r.graph_runner for r in captured_runners(engine)]

    def states():
        return [(name, state) for g in graph_runners for name, state, _ in g.compiled_steps()]

    for _ in range(3):  # while the steps the batches meet compile
        assert staggered_generate(engine, prompts, lengths) == reference
    assert all(g.wait_until_idle(timeout=300) for g in graph_runners)
    assert staggered_generate(engine, prompts, lengths) == reference  # replaying them
    assert all(g.wait_until_idle(timeout=300) for g in graph_runners)
    assert all(state != "failed" for _, state in states()), states()
    rounds = {name: state for name, state in states() if name.startswith("nextn round")}
    assert rounds == {f"nextn round bs {b} x 4 rows": "ready" for b in (1, 2, BUCKET)}
    if hasattr(os, "getpriority"):  # the compile threads yield to serving
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        capture = [t for t in threading.enumerate() if t.name == "capture"]
        assert capture
        for thread in capture:
            niceness = os.getpriority(os.PRIO_PROCESS, thread.native_id)
            assert niceness == min(mine + compile_worker.COMPILE_NICENESS, 19)
