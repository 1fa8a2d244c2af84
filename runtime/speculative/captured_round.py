# SPDX-License-Identifier: Apache-2.0
"""A whole greedy NEXTN round in one captured graph: target verify, acceptance, the draft's
pass over the verified rows and its chained steps (SGLang captures the target verify and
the EAGLE draft steps as separate CUDA graphs; fusing them removes the host work between).

    verify [t, d1..dS] -> greedy acceptance (m, bonus) -> following tokens
    -> draft extend over the S + 1 rows -> pick row m -> S - 1 chained draft steps
       (`execution/draft_chain.py`, the chain the eager drafter runs)

Each request's accept count `m` decides only values inside the graph (which extend row the
draft scores, the chained steps' positions and their metadata via `prepare_in_step`);
everything else is prepared on the host before the graph runs. The fused round serves
batches whose acceptance the graph can decide: every request greedy, no logit adjustment
(penalties, `min_new_tokens`), no grammar, a single-rank engine. Other rounds run as
separate steps (`NextNWorker._verify`) with the same tokens. Details:
docs/architecture.md, "Module notes".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.core.forward_context import ForwardContext
from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.core.request import Req
from runtime.execution.draft_chain import draft_chain
from runtime.execution.graph_runner import LOGITS_ALL, StepKey, StepRecipe
from runtime.execution.model_runner import ModelInput, ModelRunner
from runtime.execution.penalties import needs_adjustment
from runtime.speculative.acceptance import VerifyResult, verify_greedy

ROUND_NAME = "nextn round"


@dataclass
class RoundOutput:
    result: VerifyResult  # on the host
    logits: torch.Tensor  # [bs * (S + 1), V] the verify rows' logits (logprobs read them)
    next_drafts: list[list[int]]  # [bs][S]


class CapturedRound:
    def __init__(self, target: ModelRunner, draft: ModelRunner, num_steps: int):
        self.target, self.draft, self.num_steps = target, draft, num_steps
        self.width = num_steps + 1
        self.recipe = StepRecipe(ROUND_NAME, round_body(target, draft, num_steps), self._padding)

    # --- which rounds ----------------------------------------------------------------------
    def enabled(self) -> bool:
        """Both models capture their steps, on one rank, and the draft's pass over a round
        reads every verified row (no window shorter than the round to skip rows by)."""
        runners = (self.target, self.draft)
        reach = self.draft.model.kv_reach
        return (
            all(r.graph_runner is not None and r.graph_runner.capturable for r in runners)
            and all(r.broadcaster is None for r in runners)
            and self.target.graph_runner.config.fused_round
            and (reach is None or reach >= self.width)
        )

    def serves(self, reqs: Sequence[Req], eos_ids: set[int]) -> bool:
        """Whether the round of `reqs` is decided by greedy acceptance of unadjusted logits."""
        return all(
            r.sampling_params.is_greedy and r.grammar is None and not needs_adjustment(r, eos_ids)
            for r in reqs
        )

    def key(self, batch_size: int) -> StepKey | None:
        bucket = self.target.graph_runner.bucket_for(batch_size)
        if bucket is None or self.draft.graph_runner.bucket_for(bucket) != bucket:
            return None
        return StepKey(
            ForwardMode.TARGET_VERIFY,
            self.width,
            bucket,
            CaptureHiddenMode.FULL,
            LOGITS_ALL,
            False,
            0,
            recipe=ROUND_NAME,
        )

    def loading(self, batch_size: int) -> bool:
        """Whether the round of `batch_size` requests waits for its own bucket to compile."""
        key = self.key(batch_size)
        return key is not None and self.target.graph_runner.loading(key)

    # --- running ---------------------------------------------------------------------------
    @torch.inference_mode()  # as every forward (and the compile) runs
    def run(self, verify: ModelInput) -> RoundOutput | None:
        """The round whose target verify is `verify` (`[t, d1..dS]` per request), or None
        when no bucket of it is ready (it compiles meanwhile) and the round must run step by
        step."""
        bs = len(verify.extend_lens)
        key = self.key(bs)
        if key is None:
            return None
        pools, prefixes = list(verify.req_pool_indices), list(verify.prefix_lens)
        outputs = self.target.graph_runner.try_recipe(
            key, self.recipe, lambda bucket: self._args(pools, prefixes, verify.input_ids, bucket)
        )
        if outputs is None:
            return None
        logits, num_accepted, final, proposals = outputs
        return RoundOutput(
            VerifyResult(num_accepted[:bs].cpu(), final[:bs].cpu()),
            logits[: bs * self.width],
            proposals[:bs].tolist(),
        )

    def _args(self, pools: list[int], prefixes: list[int], ids: torch.Tensor, bucket: int):
        """The round's arguments, the batch padded to `bucket` with the padding request
        (`ids`: the verify rows, `S + 1` per request)."""
        target, draft = self.target.graph_runner, self.draft.graph_runner
        pad = bucket - len(pools)
        pools = pools + [target.pad_req] * pad
        prefixes = prefixes + [0] * pad
        ids = torch.cat([ids, ids.new_zeros(pad * self.width)])
        full = CaptureHiddenMode.FULL
        verify_ctx = target.prepared_context(
            ForwardMode.TARGET_VERIFY, pools, prefixes, self.width, full
        )
        # the chained steps reach `num_steps - 1` positions past the extend's rows
        extend_ctx = draft.prepared_context(
            ForwardMode.DRAFT_EXTEND, pools, prefixes, self.width, full, reach=self.num_steps - 1
        )
        device = verify_ctx.device
        return (
            verify_ctx,
            ids.to(device),
            extend_ctx,
            torch.tensor(prefixes, dtype=torch.long, device=device),
        )

    def _padding(self, bucket: int) -> tuple:
        return self._args([], [], torch.zeros(0, dtype=torch.long), bucket)


def round_body(target: ModelRunner, draft: ModelRunner, num_steps: int):
    """The captured round (see the module docstring): returns (verify logits
    `[bucket * (S + 1), V]`, accept counts `[bucket]`, the token after the accepted drafts
    `[bucket]`, the next drafts `[bucket, S]`)."""
    call_target, call_draft = target.call_model, draft.call_model
    canonical = getattr(draft.model, "canonical_spec_step", None)
    chain_steps = tuple(i if canonical is None else canonical(i) for i in range(1, num_steps))
    draft_pool, req_to_token = draft.kv_pool, draft.slot_table.req_to_token
    width = num_steps + 1

    def nextn_round(verify_ctx, ids, extend_ctx, first_positions):
        bs = first_positions.shape[0]
        out = call_target(verify_ctx, ids, None, 0)
        logits = out.next_token_logits
        drafts = ids.view(bs, width)[:, 1:]
        accepted = verify_greedy(logits, drafts)
        num, final = accepted.num_accepted, accepted.final_tokens
        # row j is followed by d_{j+1} while drafts were accepted and by the bonus at row m;
        # rows past m carry stale tokens whose draft cache rows the next round rewrites
        following = torch.cat([drafts, final.unsqueeze(1)], dim=1)
        following = following.scatter(1, num.unsqueeze(1), final.unsqueeze(1))
        # the draft scores only row m of each request (the row the step-by-step drafter
        # scores): one row of the vocabulary product instead of S + 1
        rows = torch.arange(bs, device=num.device) * width + num
        extend_ctx = dataclasses.replace(extend_ctx, logits_row_indices=rows)
        extended = call_draft(extend_ctx, following.flatten(), out.hidden_states, 0)
        pools = verify_ctx.req_pool_indices

        def step(i, tokens, hidden):
            ctx = ForwardContext.decode_rows(
                pools, first_positions + num + i, req_to_token, draft_pool, CaptureHiddenMode.LAST
            )
            ctx.attn_metadata = draft_pool.prepare_in_step(ctx, extend_ctx.attn_metadata)
            return call_draft(ctx, tokens, hidden, chain_steps[i - 1])

        hidden = extended.hidden_states[rows]
        proposals = draft_chain(extended.next_token_logits, hidden, num_steps, step)
        return logits, num, final, proposals

    return nextn_round
