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

from runtime.execution.graph_runner import GraphRunner
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
