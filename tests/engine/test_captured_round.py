# SPDX-License-Identifier: Apache-2.0
"""A greedy NEXTN round in one captured graph (`runtime.speculative.captured_round`).

The fused round (target verify, greedy acceptance, the draft's pass over the verified rows
and its chained steps, whose metadata the graph derives from the accept counts) must give
what the round run step by step and eagerly gives on the same caches: the same accept
counts, bonus tokens and next drafts, and the verify logits within the parity tolerance,
with requests joining and leaving and a live batch padded into its bucket.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runtime import Engine
from runtime.configs.capture import DISABLE_ENV
from runtime.execution.graph_runner import GraphRunner, StepState
from runtime.speculative.acceptance import verify_greedy
from runtime.speculative.captured_round import CapturedRound
from runtime.speculative.drafter import MTPDrafter
from runtime.speculative.nextn_worker import redraft_batch, verify_input
from tests.engine.test_captured_steps import (
    ATOL,
    BUCKET,
    bucket_config,
    checkpoint_of,
    make_runners,
    prefill,
    prompts_of,
    qwen_mtp,  # noqa: F401 (fixtures)
    state_rewind,
    v4_mtp,  # noqa: F401
)

STEPS, WIDTH = 3, 4


def greedy_drafts(target, reqs, accepted: list[int]) -> torch.Tensor:
    """Drafts `[bs, S]` the target accepts exactly `accepted[b]` of: the target's own greedy
    continuation (built one position per eager verify pass), the first rejected one
    replaced by another token."""
    drafts = torch.zeros((len(reqs), STEPS), dtype=torch.long)
    for j in range(STEPS + 1):
        logits = target.forward(verify_input(reqs, drafts)).next_token_logits
        pred = logits.view(len(reqs), WIDTH, -1).argmax(-1)
        if j < STEPS:
            drafts[:, j] = pred[:, j]
    for b, m in enumerate(accepted):
        if m < STEPS:
            drafts[b, m] = (pred[b, m] + 1) % logits.shape[-1]
    return drafts


@pytest.mark.parametrize("family", ["deepseek_v4", "qwen4_exp"])
def test_fused_round_equals_the_eager_round(family, request):
    table, target, draft = make_runners(checkpoint_of(family, request)[0], steps=STEPS)
    config = bucket_config()
    graph_runners = GraphRunner(target, config, 8), GraphRunner(draft, config, 8)
    fused = CapturedRound(target, draft, STEPS)
    drafter = MTPDrafter(draft, STEPS)
    prompts = prompts_of((30, 7, 66, 12), seed=5)
    g = torch.Generator().manual_seed(3)
    live = {}

    def join(indices):
        pools = prefill(table, target, [prompts[i] for i in indices])
        for i, pool in zip(indices, pools):
            live[i] = SimpleNamespace(
                req_pool_idx=pool,
                num_cached=len(prompts[i]),
                output_ids=[prompts[i][-1]],
                grammar=None,
            )

    def attach(on: bool):
        target.graph_runner, draft.graph_runner = graph_runners if on else (None, None)

    join([0, 1, 2])
    seen = set()
    for round_idx in range(6):
        if round_idx == 2:
            join([3])  # four live requests fill the bucket
        if round_idx == 4:
            del live[0], live[3]
        reqs = [live[i] for i in sorted(live)]
        attach(False)
        accepted = torch.randint(0, STEPS + 1, (len(reqs),), generator=g).tolist()
        drafts = greedy_drafts(target, reqs, accepted)
        rewind = state_rewind(target.kv_pool)
        verify = verify_input(reqs, drafts)
        out = target.forward(verify)
        eager = verify_greedy(out.next_token_logits, drafts)
        eager_drafts = drafter.draft(redraft_batch(reqs, drafts, eager, out.hidden_states))
        rewind()
        attach(True)
        assert fused.enabled()
        got = fused.run(verify)
        assert got is not None, "the round's bucket is compiled inline"
        assert got.result.num_accepted.tolist() == accepted
        assert torch.equal(got.result.final_tokens, eager.final_tokens)
        assert got.next_drafts == eager_drafts, f"round {round_idx}"
        torch.testing.assert_close(got.logits, out.next_token_logits, atol=ATOL, rtol=0)
        seen.update(accepted)
        target.commit_verified(torch.tensor([r.req_pool_idx for r in reqs]), eager.num_accepted)
        for req, m, last in zip(reqs, accepted, eager.final_tokens.tolist()):
            req.num_cached += m + 1
            req.output_ids.append(last)
    assert len(seen) >= 3, seen  # rounds accepted different numbers of drafts
    steps = graph_runners[0].compiled_steps()
    assert steps == [(f"nextn round bs {BUCKET} x {WIDTH} rows", "ready", steps[0][2])]


def test_rounds_waiting_for_their_fused_graph_queue_no_step_only_other_rounds_need(
    request, monkeypatch
):
    """While a bucket's fused round compiles in the background, its greedy rounds run step
    by step eagerly without queueing the separate verify and draft steps (greedy traffic
    never uses them once the fused graph is ready: they would only delay it); a sampled
    round, which the fused graph cannot serve, queues them as usual. Compiles are stubbed
    (queued steps stay compiling); the tokens are plain decoding's either way."""
    path = str(checkpoint_of("deepseek_v4", request)[0])
    prompts = [[1, 5, 9, 13, 17, 21, 25], [1, 40, 41, 42, 43, 44, 45, 46, 47]]
    greedy = {"temperature": 0, "max_new_tokens": 12}
    common = dict(model_path=path, dtype="float32", page_size=4)
    plain = Engine(**common, disable_cuda_graph=True)
    expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=greedy)]
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    engine = Engine(
        **common,
        speculative_algorithm="NEXTN",
        speculative_num_steps=STEPS,
        speculative_disable_by_batch_size="none",
        cuda_graph_bs=[BUCKET],
    )
    queued = []
    for name, runner in (("target", engine.runner), ("draft", engine.worker.drafter.runner)):

        def schedule(step, name=name):
            queued.append(f"{name} {step.key.describe()}")
            step.state = StepState.COMPILING  # as the background thread's queue does

        monkeypatch.setattr(runner.graph_runner.compiler, "schedule", schedule)
    outs = engine.generate(input_ids=prompts, sampling_params=greedy)
    assert [o["output_ids"] for o in outs] == expected
    # the draft's chained steps after each prompt's extend, and the fused round
    assert sorted(queued) == [
        f"draft decode bs {BUCKET}",
        f"target nextn round bs {BUCKET} x 4 rows",
    ]
    sampled = {"temperature": 1.0, "sampling_seed": 3, "max_new_tokens": 6}
    engine.generate(input_ids=prompts[:1], sampling_params=sampled)
    assert f"target target_verify bs {BUCKET} x {WIDTH} rows" in queued[2:], queued
