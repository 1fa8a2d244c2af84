# SPDX-License-Identifier: Apache-2.0
"""`NextNWorker`: NEXTN speculative decoding with an MTP draft (Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding"; the round is gpt-fast's
`generate.py::speculative_decode`, the batching SGLang's `eagle_worker.py` with topk 1).

    prefill chunk: target extend (capture hidden) -> [sample t] -> draft extend -> [d1..dS]
    decode round:  target verify [t, d1..dS] -> accept m drafts + one token -> commit
                   -> draft extend over the verified rows -> next drafts

Output equals plain decoding. New drafts travel back in `TokenOutput.draft_tokens`; the
scheduler keeps them on the request for its next round. Caches need no rollback: rows are
keyed by position and rejected positions are rewritten before anything reads them;
recurrent state keeps the state after the last accepted row (`commit_verified`). Mixed
steps run the verify rounds first, then the prefill chunks; a greedy round nothing adjusts
runs as one captured graph (`CapturedRound`); large batches may decode plainly
(`speculation_policy`, `speculation_pause`). Details: docs/architecture.md, 3 and 7.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.configs.speculative import SpeculativeConfig
from runtime.constrained import bitmask as grammar_bitmask
from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.core.request import OwedDraftRows, Req
from runtime.core.step_io import Chunk, TokenOutput, chunk_budget
from runtime.execution.graph_runner import no_new_compiles
from runtime.execution.model_runner import ModelInput, ModelRunner
from runtime.execution.penalties import RowHistory, adjust_logits
from runtime.execution.sampler import SamplingBatch
from runtime.execution.worker import (
    LogitRows,
    chunk_input,
    chunk_outputs,
    sampling_bitmask,
    token_ids_logprob_outputs,
    token_logprob_outputs,
)
from runtime.speculative.acceptance import VerifyResult, verify
from runtime.speculative.captured_round import CapturedRound
from runtime.speculative.draft_batch import DraftBatch, chunk_spans, following_tokens
from runtime.speculative.speculation_pause import (
    SpeculationPause,
    StepClock,
    UndraftedRows,
)
from runtime.speculative.speculation_policy import speculation_policy


@dataclass
class SpecStats:
    """Engine-wide acceptance counters."""

    num_steps: int
    verify_rounds: int = 0
    emitted_tokens: int = 0  # accepted drafts + the final token, per round
    accepted_at: list[int] = field(default_factory=list)  # [i]: rounds that accepted draft i+1
    plain_decode_tokens: int = 0  # tokens of decode steps that ran without speculation

    def __post_init__(self):
        self.accepted_at = [0] * self.num_steps

    def record(self, num_accepted: Sequence[int]) -> None:
        for m in num_accepted:
            self.verify_rounds += 1
            self.emitted_tokens += m + 1
            for i in range(m):
                self.accepted_at[i] += 1

    @property
    def avg_accept_length(self) -> float | None:
        """Tokens per verify round (accepted drafts + 1), over the rounds that ran: within
        `[1, num_steps + 1]`; None before the first round."""
        return self.emitted_tokens / self.verify_rounds if self.verify_rounds else None

    def acceptance_rate_per_position(self) -> list[float]:
        return [a / self.verify_rounds if self.verify_rounds else 0.0 for a in self.accepted_at]


class NextNWorker:
    supports_mixed = True
    needs_drafts = True  # a request decodes once a prefill step has drafted for it

    def __init__(
        self,
        target: ModelRunner,
        drafter,
        spec: SpeculativeConfig,
        eos_ids: set[int],
        generator: torch.Generator | None = None,
        max_pass_rows: int | None = None,
    ):
        self.target, self.spec = target, spec
        self.eos_ids, self.generator = eos_ids, generator
        self.vocab_size = target.model_config.vocab_size
        self.stats = SpecStats(spec.num_steps)
        policy = speculation_policy(
            spec.disable_by_batch_size, spec.measured, measured_buckets(target)
        )
        # rows per draft pass over skipped rows: the prefill chunk budget (None: any)
        self.pause = SpeculationPause(
            drafter, policy, spec.num_steps, chunk_budget(max_pass_rows), self._graph_runners
        )
        self.clock = StepClock(self._unsettled_runs)
        self.captured_round = CapturedRound(target, drafter.runner, spec.num_steps)

    # the drafter and the policy live with the pause (a calibration or a test swaps them here)
    drafter = property(lambda self: self.pause.drafter)
    policy = property(lambda self: self.pause.policy)

    @drafter.setter
    def drafter(self, drafter) -> None:
        self.pause.drafter = drafter

    @policy.setter
    def policy(self, policy) -> None:
        self.pause.policy = policy

    @property
    def undrafted(self) -> dict[str, UndraftedRows]:
        """The rows the draft owes per request id (`SpeculationPause`)."""
        return self.pause.undrafted

    @property
    def speculation(self) -> NextNWorker:
        """The `Worker` protocol's speculation facet (`SpeculationFacet`): this worker
        itself, which holds the drafter, policy, counters and fused round."""
        return self

    def reserve_ahead(self) -> int:
        """Verify writes up to `seq_len - 1 + S`, draft steps up to `seq_len + 2S - 2`."""
        return 2 * self.spec.num_steps

    def speculates(self, reqs: Sequence[Req], beside_prompts: bool = False) -> bool:
        """`SpeculationPause.speculates`: whether a decode step over `reqs` runs rounds."""
        return self.pause.speculates(reqs, beside_prompts)

    def step(
        self, prefill: Sequence[Chunk], decode: Sequence[Req]
    ) -> tuple[list[TokenOutput], list[TokenOutput]]:
        """Decode first (a verify round, or a plain step while speculation is off), then the
        prompt chunks (target extend, then the draft over the same rows)."""
        self.pause.adopt_owed([c.req for c in prefill] + list(decode))
        counters = self.clock.begin(self.stats)
        decode_out, speculated, caught_up = [], False, False
        if decode:
            speculated = self.speculates(decode, beside_prompts=bool(prefill))
            if speculated:
                fresh = self.pause.catch_up(decode)  # drafts of requests that were paused
                caught_up = bool(fresh)
                decode_out = self._verify(decode, fresh)
            else:
                decode_out = self._decode_plain(decode)
        prefill_out = self._prefill(prefill, decode) if prefill else []
        pure_decode = len(decode) if decode and not prefill else 0
        self.clock.end(self.policy, self.stats, counters, pure_decode, speculated, caught_up)
        return prefill_out, decode_out

    def _unsettled_runs(self) -> int:
        """Steps so far that met a bucket still compiling (`GraphRunner.unsettled_runs`)."""
        return sum(g.unsettled_runs for g in self._graph_runners())

    def _graph_runners(self) -> list:
        """The target's and the draft's graph runners, where they capture."""
        runners = (self.target, self.drafter.runner)
        return [r.graph_runner for r in runners if r.graph_runner is not None]

    # --- while speculation is off (`speculation_pause`) --------------------------------------
    def release(self, reqs: Sequence[Req], keep_state: bool = False) -> list[list[int] | None]:
        """`reqs` leave the running batch; `SpeculationPause.release`."""
        return self.pause.release(reqs, keep_state)

    def owed_draft_rows(self, req: Req) -> OwedDraftRows | None:
        """`SpeculationPause.owed_draft_rows`."""
        return self.pause.owed_draft_rows(req)

    def _decode_plain(self, reqs: Sequence[Req]) -> list[TokenOutput]:
        """One plain decode step (exactly `PlainWorker`'s sampling), keeping each row for
        the draft to run over once the requests speculate again."""
        chunks = [Chunk(r, r.seq_len - 1, r.seq_len) for r in reqs]
        outputs, hidden = self._target_over(chunks, ForwardMode.DECODE)
        self.stats.plain_decode_tokens += len(reqs)
        for req in reqs:
            req.spec_plain_decode_tokens += 1
        self.pause.keep_decoded(reqs, outputs, hidden)
        return outputs

    def _target_over(
        self, chunks: Sequence[Chunk], mode: ForwardMode
    ) -> tuple[list[TokenOutput], torch.Tensor]:
        """The target over `chunks`, every row's hidden state captured for the draft, and the
        token of each chunk that completes its request (plain decoding's sampling)."""
        rows = LogitRows(chunks)
        bitmask = sampling_bitmask(chunks, self.vocab_size)  # host work before the forward
        inp = chunk_input(chunks, mode, CaptureHiddenMode.FULL)
        inp.logits_row_indices = rows.rows
        out = self.target.forward(inp)
        outputs = chunk_outputs(
            chunks,
            rows,
            out.next_token_logits,
            self.vocab_size,
            self.eos_ids,
            self.generator,
            bitmask,
        )
        return outputs, out.hidden_states

    def _prefill(self, chunks: Sequence[Chunk], decoding: Sequence[Req]) -> list[TokenOutput]:
        """Target extend, a token for every chunk that completes its prompt, then the draft
        over the same rows (proposing only for the completing chunks), except for chunks
        it defers (`SpeculationPause.defers`)."""
        outputs, hidden = self._target_over(chunks, ForwardMode.EXTEND)
        defer = self.pause.defers(chunks, decoding)
        now = [i for i, deferred in enumerate(defer) if not deferred]
        if now:
            rows = hidden if len(now) == len(chunks) else hidden[chunk_rows(chunks, now)]
            batch = prefill_draft_batch([chunks[i] for i in now], [outputs[i] for i in now], rows)
            for i, drafted in zip(now, self.drafter.draft(batch)):
                outputs[i].draft_tokens = drafted
        if len(now) < len(chunks):
            self.pause.keep_deferred(chunks, outputs, hidden, defer)
        return outputs

    def _verify(self, reqs: Sequence[Req], fresh: dict[str, list[int]]) -> list[TokenOutput]:
        """One round per request, as gpt-fast's `speculative_decode`: the target scores the
        pending drafts (`fresh` ones for requests that just caught up) in one pass, accepts
        a prefix, commits it, and the draft proposes the next round's tokens from the
        verified rows."""
        drafts = pending_drafts(reqs, fresh)  # [bs, S]
        verify = verify_input(reqs, drafts)
        fusable = self._fusable(reqs)
        fused = self.captured_round.run(verify) if fusable else None
        if fused is not None:
            self._commit(reqs, fused.result)
            return self._round_outputs(reqs, drafts, fused.result, fused.logits, fused.next_drafts)
        compiles = contextlib.nullcontext()
        if fusable and self.captured_round.loading(len(reqs)):
            # the round runs step by step only until its fused graph is ready: the separate
            # steps, which only other rounds need, do not join the queue of compiles ahead
            # of what the traffic will use
            compiles = no_new_compiles(self._graph_runners())
        with compiles:
            bitmask = verify_bitmask(reqs, drafts, self.vocab_size)  # host work first
            out = self.target.forward(verify)  # [bs * (S + 1)] rows
            result = self._accept(reqs, drafts, out.next_token_logits, bitmask)
            self._commit(reqs, result)
            next_drafts = self.drafter.draft(redraft_batch(reqs, drafts, result, out.hidden_states))
        return self._round_outputs(reqs, drafts, result, out.next_token_logits, next_drafts)

    def _fusable(self, reqs: Sequence[Req]) -> bool:
        """Whether the round runs in one captured graph (`CapturedRound`): its acceptance is
        greedy and nothing adjusts the logits; otherwise it runs as separate steps."""
        fused = self.captured_round
        return fused.enabled() and fused.serves(reqs, self.eos_ids)

    def _accept(
        self,
        reqs: Sequence[Req],
        drafts: torch.Tensor,
        logits: torch.Tensor,
        bitmask: torch.Tensor | None = None,
    ) -> VerifyResult:
        """How many drafts each request keeps and the token after them, from the logits
        adjusted as plain decoding would see each row: penalties, then the grammar's mask
        of that row (`verify_bitmask`), so every accepted token is one the grammar allows."""
        adjusted = penalised_verify_logits(logits, reqs, drafts, self.eos_ids)
        logits = grammar_bitmask.apply(adjusted, bitmask, unadjusted=logits)
        # acceptance runs where the logits are; its small result comes back to the host,
        # where the round's bookkeeping (drafts, the draft's next batch) lives
        device = logits.device
        sampling = SamplingBatch.from_params(
            [r.sampling_params for r in reqs], self.vocab_size, device
        )
        first_positions = torch.tensor([r.num_cached for r in reqs], device=device)
        result = verify(logits, drafts.to(device), sampling, first_positions, self.generator)
        return VerifyResult(result.num_accepted.cpu(), result.final_tokens.cpu())

    def _commit(self, reqs: Sequence[Req], result: VerifyResult) -> None:
        """Recurrent caches keep the state after the last accepted row; positional caches
        need nothing (see the module docstring)."""
        self.target.commit_verified(
            torch.tensor([r.req_pool_idx for r in reqs]), result.num_accepted
        )

    def _round_outputs(
        self,
        reqs: Sequence[Req],
        drafts: torch.Tensor,
        result: VerifyResult,
        logits: torch.Tensor,
        next_drafts: list[list[int] | None],
    ) -> list[TokenOutput]:
        """Emitted tokens (with logprobs where asked), the round's acceptance and the next
        drafts per request; the engine-wide counters."""
        num_accepted = result.num_accepted.tolist()
        self.stats.record(num_accepted)
        tokens = result.tokens(drafts)
        first_rows = [b * (drafts.shape[1] + 1) for b in range(len(reqs))]
        logprobs = token_logprob_outputs(reqs, logits, tokens, first_rows)
        ids_logprobs = token_ids_logprob_outputs(reqs, logits, tokens, first_rows)
        outputs = []
        for emitted, lp, ids_lp, m, drafted in zip(
            tokens, logprobs, ids_logprobs, num_accepted, next_drafts
        ):
            values, top = lp if lp is not None else (None, None)
            outputs.append(
                TokenOutput(
                    emitted,
                    values,
                    top,
                    token_ids_logprobs=ids_lp,
                    num_accepted_drafts=m,
                    draft_tokens=drafted,
                )
            )
        return outputs


# ---------------------------------------------------------------------------------------
# Round inputs
# ---------------------------------------------------------------------------------------


def measured_buckets(target: ModelRunner):
    """The target's bucket of a batch size where its decode steps are captured (the buckets
    a measured policy times), else None."""
    graph_runner = target.graph_runner
    if graph_runner is None or not graph_runner.capturable:
        return None
    return graph_runner.bucket_for


def pending_drafts(reqs: Sequence[Req], fresh: dict[str, list[int]]) -> torch.Tensor:
    """`[bs, S]`: the drafts each request got from its previous step, or this step's when
    it caught up (`fresh`, by request id)."""
    return torch.tensor([fresh.get(r.rid, r.draft_tokens) for r in reqs], dtype=torch.long)


def verify_input(reqs: Sequence[Req], drafts: torch.Tensor) -> ModelInput:
    """Rows `[t_last, d1..dS]` per request from position `num_cached` on; every row scored
    and every row's hidden state captured (the draft reads them all)."""
    width = drafts.shape[1] + 1
    last = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long)
    ids = torch.cat([last.unsqueeze(1), drafts], dim=1).flatten()  # [bs * (S + 1)]
    return ModelInput(
        ForwardMode.TARGET_VERIFY,
        ids,
        [r.req_pool_idx for r in reqs],
        [r.num_cached for r in reqs],
        [width] * len(reqs),
        capture_hidden_mode=CaptureHiddenMode.FULL,
        logits_row_indices=None,
    )


def verify_bitmask(reqs: Sequence[Req], drafts: torch.Tensor, vocab_size: int):
    """Grammar bitmask of the verify rows (None without grammars): row j of request b is
    masked by its grammar after drafts d1..dj, each matcher walked over the drafts
    tentatively and rolled back to the committed output."""
    return grammar_bitmask.verify_bitmask([r.grammar for r in reqs], drafts.tolist(), vocab_size)


def penalised_verify_logits(
    logits: torch.Tensor, reqs: Sequence[Req], drafts: torch.Tensor, eos_ids: set[int]
) -> torch.Tensor:
    """Row j of request b sees the history plain decoding would have there: its output so
    far plus drafts d1..dj. Returns new logits (the raw ones still give the logprobs)."""
    width = drafts.shape[1] + 1
    histories = [
        RowHistory(r, tuple(d[:j])) for r, d in zip(reqs, drafts.tolist()) for j in range(width)
    ]
    return adjust_logits(logits, histories, eos_ids)


def redraft_batch(
    reqs: Sequence[Req], drafts: torch.Tensor, result: VerifyResult, target_hidden: torch.Tensor
) -> DraftBatch:
    """The verified rows for the draft. Row j is followed by d_{j+1} while drafts were
    accepted and by the final token at row m; rows past m carry stale tokens whose draft
    cache entries the next round rewrites. The draft proposes from row m."""
    bs, steps = drafts.shape
    following = torch.cat([drafts, result.final_tokens.unsqueeze(1)], dim=1)  # [bs, S + 1]
    following[torch.arange(bs), result.num_accepted] = result.final_tokens
    return DraftBatch(
        reqs=reqs,
        prefix_lens=[r.num_cached for r in reqs],
        extend_lens=[steps + 1] * bs,
        next_tokens=following.flatten(),
        target_hidden=target_hidden,
        gather_rows=result.num_accepted.tolist(),
        propose=[True] * bs,
        pending_tokens=result.tokens(drafts) if any(r.grammar for r in reqs) else None,
    )


def chunk_rows(chunks: Sequence[Chunk], picked: Sequence[int]) -> torch.Tensor:
    """Indices of the rows of `chunks[i]` for `i in picked` in the step's `[sum len, D]`."""
    spans = chunk_spans(chunks)
    return torch.cat([torch.arange(*spans[i]) for i in picked])


def prefill_draft_batch(
    chunks: Sequence[Chunk], outputs: Sequence[TokenOutput], target_hidden: torch.Tensor
) -> DraftBatch:
    """A prefill step's rows for the draft. The row at position p is followed by the token
    at p + 1: a prompt token, or for a completing chunk's last row the token just sampled.
    Completing chunks get proposals, and so do resuming ones (a retracted request rebuilt
    up to its newest token, which follows the last row): its next verify round is the one
    it would have run without the retraction. The others only fill the draft's cache."""
    following = [t for c, o in zip(chunks, outputs) for t in following_tokens(c, o)]
    return DraftBatch(
        reqs=[c.req for c in chunks],
        prefix_lens=[c.start for c in chunks],
        extend_lens=[c.length for c in chunks],
        next_tokens=torch.tensor(following, dtype=torch.long),
        target_hidden=target_hidden,
        gather_rows=[c.length - 1 for c in chunks],
        propose=[c.completes or c.resumes for c in chunks],
        pending_tokens=[o.tokens for o in outputs] if any(c.req.grammar for c in chunks) else None,
    )
