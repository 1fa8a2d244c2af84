# SPDX-License-Identifier: Apache-2.0
"""`NextNWorker`: NEXTN speculative decoding with an MTP draft (Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding"; the round is gpt-fast's
`generate.py::speculative_decode`, the batching SGLang's `eagle_worker.py` with topk 1).

    prefill chunk: target extend (capture hidden) -> [sample t] -> draft extend -> [d1..dS]
    decode round:  target verify [t, d1..dS] -> accept m drafts + one token -> commit
                   -> draft extend over the verified rows -> next drafts

New drafts travel back in each request's `TokenOutput.draft_tokens`; the scheduler keeps
them on the request for its next round, with the round's acceptance counters.

Caches need no explicit rollback: every cache row is keyed by position, verify and draft
only write positions at or after the committed length, and the next round rewrites the
rejected positions before anything reads them (rings are sized for one extra pass).
Recurrent state is the exception: `commit_verified` keeps the state after the last
accepted row.

A step may carry prefill chunks and verify rounds together (`supports_mixed`): the rounds run
first (a uniform batch: the target's captured verify step and the draft's captured steps),
then the chunks (an eager extend), so decoding never pauses while prompts prefill.

A greedy round whose logits nothing adjusts runs as one captured graph, acceptance and the
draft's steps included (`CapturedRound`); other rounds run the steps above one by one.

Speculation off in large batches (`speculation_policy`: vLLM's
`speculative_disable_by_batch_size`, or by default a choice measured per batch bucket): a
verify round scores `S + 1` rows per request, which pays while a step is bound by its fixed
costs and not once it is bound by compute. A decode step the policy runs plainly runs as
plain decoding (the target's captured decode step, capturing each row's hidden state) and
keeps, per request, the rows the draft has not run over (`UndraftedRows`). When the
requests speculate again, the draft first extends over all kept
rows of each such request, as over a prefill chunk, and proposes from the newest, as it
would after a verify round; then every request of the step verifies in one round. Prompt
chunks prefilled while the next decode step is expected to run plainly keep their rows the
same way instead of a draft pass (`_defers`). A request that finishes before speculating
again costs the draft nothing: its newest rows go with the state the prefix cache keeps
(`Req.owed_draft_rows`), and the draft runs over them only if a later request resumes
from that state (`_adopt_owed`), as it catches up over its own skipped rows.
"""

from __future__ import annotations

import contextlib
import time
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
from runtime.speculative.draft_batch import DraftBatch
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


@dataclass
class UndraftedRows:
    """Target rows of one request the draft has not run over: positions `start ..`, row p the
    target's hidden state at p and the token at p + 1. With a window-only draft (`reach`
    rows) only the newest `reach` rows are kept: the draft's pass over them would skip the
    older ones anyway (`MTPDrafter._rows_to_skip`)."""

    req: Req
    start: int
    hidden: list[torch.Tensor] = field(default_factory=list)  # [D] each
    following: list[int] = field(default_factory=list)

    def append(self, hidden: torch.Tensor, token: int, reach: int | None) -> None:
        """One row `[D]` followed by `token` (a plain decode step's: called per request and
        step, so without `extend`'s tensor round trip)."""
        self.hidden.append(hidden)
        self.following.append(token)
        self._keep_newest(reach)

    def extend(
        self, hidden: torch.Tensor, tokens: list[int], reach: int | None, skipped: int = 0
    ) -> None:
        """Rows `[n, D]` followed by `tokens`, at the positions right after the kept ones
        and `skipped` more (rows the caller already left out as older than `reach`)."""
        if skipped:
            self.start += len(self.following) + skipped
            self.hidden, self.following = [], []
        self.hidden.extend(hidden.unbind(0))
        self.following.extend(tokens)
        self._keep_newest(reach)

    def _keep_newest(self, reach: int | None) -> None:
        """Only the newest `reach` rows stay (all of them when `reach` is None)."""
        if reach is not None and len(self.following) > reach:
            drop = len(self.following) - reach
            del self.hidden[:drop], self.following[:drop]
            self.start += drop

    def __len__(self) -> int:
        return len(self.following)

    def owed(self) -> OwedDraftRows:
        return OwedDraftRows(self.start, torch.stack(self.hidden), tuple(self.following))

    @classmethod
    def resumed(cls, req: Req, owed: OwedDraftRows) -> UndraftedRows:
        return cls(req, owed.start, list(owed.hidden.unbind(0)), list(owed.following))


@dataclass(frozen=True)
class DecodeMark:
    """The end of a pure decode step, for a measured policy: when, its bucket and mode, and
    the count of unsettled captured-step runs then."""

    end: float
    bucket: int
    speculated: bool
    unsettled: int


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
        self.target, self.drafter, self.spec = target, drafter, spec
        self.eos_ids, self.generator = eos_ids, generator
        # rows per draft pass over skipped rows (the prefill chunk budget; None: any)
        self.max_pass_rows = chunk_budget(max_pass_rows)
        self.vocab_size = target.model_config.vocab_size
        self.stats = SpecStats(spec.num_steps)
        self.policy = speculation_policy(
            spec.disable_by_batch_size, spec.measured, measured_buckets(target)
        )
        self.undrafted: dict[str, UndraftedRows] = {}  # by request id
        self._last_decode: DecodeMark | None = None  # the previous step, if pure decode
        self.captured_round = CapturedRound(target, drafter.runner, spec.num_steps)

    @property
    def speculation(self) -> NextNWorker:
        """The `Worker` protocol's speculation facet (`SpeculationFacet`): this worker
        itself, which holds the drafter, policy, counters and fused round."""
        return self

    def reserve_ahead(self) -> int:
        """Verify writes up to `seq_len - 1 + S`, draft steps up to `seq_len + 2S - 2`."""
        return 2 * self.spec.num_steps

    def speculates(self, reqs: Sequence[Req], beside_prompts: bool = False) -> bool:
        """Whether a decode step over `reqs` runs verify rounds (a measured policy weighs
        their own acceptance so far; `beside_prompts`: the step carries prompt chunks too,
        which a measured policy decides by compute alone)."""
        history = [round_history(r) for r in reqs]
        return self.policy.speculates(len(reqs), history, beside_prompts=beside_prompts)

    def step(
        self, prefill: Sequence[Chunk], decode: Sequence[Req]
    ) -> tuple[list[TokenOutput], list[TokenOutput]]:
        self._adopt_owed([c.req for c in prefill] + list(decode))
        decode_out, speculated, caught_up = [], False, False
        counters = (self.stats.verify_rounds, self.stats.emitted_tokens)
        if decode:
            speculated = self.speculates(decode, beside_prompts=bool(prefill))
            if speculated:
                fresh = self._catch_up(decode)
                caught_up = bool(fresh)
                decode_out = self._verify(decode, fresh)
            else:
                decode_out = self._decode_plain(decode)
        prefill_out = self._prefill(prefill, decode) if prefill else []
        if self.policy.measured:
            pure_decode = len(decode) if decode and not prefill else 0
            self._time_step(pure_decode, speculated, caught_up, counters)
        return prefill_out, decode_out

    def _time_step(
        self, batch_size: int, speculated: bool, caught_up: bool, counters: tuple[int, int]
    ) -> None:
        """A measured policy learns the rounds' acceptance from every step that ran rounds,
        and step times from consecutive pure decode steps (`batch_size` > 0: no prompt
        chunk) in the same mode and bucket: the time from the end of the first to the end
        of the second is one step with everything the engine does per step (scheduling,
        outputs, a server's streaming), which a round pays once for several tokens. A round
        that first caught the draft up pays for the switch, not for itself; steps that met
        a bucket still compiling are unsettled."""
        now, unsettled = time.perf_counter(), self._unsettled_runs()
        rounds = self.stats.verify_rounds - counters[0]
        if rounds:
            self.policy.record_accept(rounds, (self.stats.emitted_tokens - counters[1]) / rounds)
        last, self._last_decode = self._last_decode, None
        if not batch_size:
            return
        bucket = self.policy.bucket_of(batch_size)
        self._last_decode = DecodeMark(now, bucket, speculated, unsettled)
        if last is None or (last.bucket, last.speculated) != (bucket, speculated) or caught_up:
            return
        self.policy.record(
            batch_size, speculated, now - last.end, settled=unsettled == last.unsettled
        )

    def _unsettled_runs(self) -> int:
        """Steps so far that met a bucket still compiling (`GraphRunner.unsettled_runs`)."""
        return sum(g.unsettled_runs for g in self._graph_runners())

    def _graph_runners(self) -> list:
        """The target's and the draft's graph runners, where they capture."""
        runners = (self.target, self.drafter.runner)
        return [r.graph_runner for r in runners if r.graph_runner is not None]

    def release(self, reqs: Sequence[Req], keep_state: bool = False) -> list[list[int] | None]:
        """`reqs` leave the running batch (finished, retracted or aborted) and their rows are
        dropped. `keep_state`: the prefix cache keeps their state. With a window-only draft
        a finished request's rows (its newest `kv_reach`) go with it
        (`Req.owed_draft_rows`): the draft runs over them only for a later request that
        resumes from that state. Otherwise the draft runs over the rows now
        (`_draft_skipped`), so the cached draft state is what speculating every step leaves; a
        request that is not finished (retracted, to resume right there) also gets the
        drafts of its next round. Returns those drafts, None for the others."""
        kept = {r.rid: self.undrafted.pop(r.rid) for r in reqs if r.rid in self.undrafted}
        if not kept or not keep_state:
            return [None] * len(reqs)
        window_only = self.drafter.runner.model.kv_reach is not None
        now = []
        for rows in kept.values():
            if rows.req.finished and window_only:
                rows.req.owed_draft_rows = rows.owed()
            else:
                now.append(rows)
        if not now:
            return [None] * len(reqs)
        drafted = self._draft_skipped(now, [not k.req.finished for k in now])
        drafts = {rows.req.rid: d for rows, d in zip(now, drafted)}
        return [drafts.get(r.rid) for r in reqs]

    def owed_draft_rows(self, req: Req) -> OwedDraftRows | None:
        """The rows the draft has not run over for `req` (a copy: they keep growing here),
        for a snapshot of its state taken now."""
        rows = self.undrafted.get(req.rid)
        return rows.owed() if rows else None

    def _adopt_owed(self, reqs: Sequence[Req]) -> None:
        """Requests resumed from a cached state the draft has not run over all of take its
        rows as their own skipped ones: their prompt chunks defer and their first
        speculating step catches the draft up over those rows and theirs together, which
        leaves the draft's cache as a draft pass at the first request's release would have."""
        for req in reqs:
            if req.owed_draft_rows is not None:
                self.undrafted[req.rid] = UndraftedRows.resumed(req, req.owed_draft_rows)
                req.owed_draft_rows = None

    def _decode_plain(self, reqs: Sequence[Req]) -> list[TokenOutput]:
        """One plain decode step (exactly `PlainWorker`'s sampling), keeping each row for
        the draft to run over once the requests speculate again."""
        chunks = [Chunk(r, r.seq_len - 1, r.seq_len) for r in reqs]
        outputs, hidden = self._target_over(chunks, ForwardMode.DECODE)
        self.stats.plain_decode_tokens += len(reqs)
        reach = self.drafter.runner.model.kv_reach
        hidden = hidden[: len(reqs)].clone().unbind(0)
        for req, output, row in zip(reqs, outputs, hidden):
            req.spec_plain_decode_tokens += 1
            kept = self.undrafted.get(req.rid)
            if kept is None:
                kept = self.undrafted[req.rid] = UndraftedRows(req, req.seq_len - 1)
            kept.append(row, output.tokens[0], reach)
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

    def _catch_up(self, reqs: Sequence[Req]) -> dict[str, list[int]]:
        """Drafts for this step's round of the requests that decoded without speculation:
        the draft runs over every row it skipped (the newest one is followed by the
        request's newest token) and proposes from the newest, as it does after a verify
        round. By request id; empty when every request has its drafts already."""
        behind = [self.undrafted.pop(r.rid) for r in reqs if r.rid in self.undrafted]
        if not behind:
            return {}
        drafts = self._draft_skipped(behind, [True] * len(behind))
        return {rows.req.rid: drafted for rows, drafted in zip(behind, drafts)}

    def _draft_skipped(
        self, kept: Sequence[UndraftedRows], propose: Sequence[bool]
    ) -> list[list[int] | None]:
        """The draft over the rows `kept` holds, in passes of whole requests of at most
        `max_pass_rows` rows together (one request's rows may exceed it alone), as the
        scheduler chunks prompts: a batch that stopped speculating right after its prompts
        owes a window of rows per request, and one pass over all of them (8,000 rows at 64
        requests of the default model) needs several times the transient memory of any
        prefill chunk, which a process then allocates afresh. Drafts per request, in
        order (None where `propose` is False). A pass takes a captured step that is ready
        or runs eagerly, and queues no compile: its rows per request are the plain steps
        it missed, a count no warm-up meets, each a step of its own (compiled inline, one
        stalled a benchmark's timed batch), and such passes are rare."""
        drafts: list[list[int] | None] = []
        with no_new_compiles(self._graph_runners()):
            for group in pass_groups([len(k) for k in kept], self.max_pass_rows):
                kept_group = [kept[i] for i in group]
                batch = catch_up_draft_batch(kept_group, [propose[i] for i in group])
                drafts += self.drafter.draft(batch)
        return drafts

    def _prefill(self, chunks: Sequence[Chunk], decoding: Sequence[Req]) -> list[TokenOutput]:
        """Target extend, a token for every chunk that completes its prompt, then the draft
        over the same rows (proposing only for the completing chunks), except for chunks
        it defers (`_defers`)."""
        outputs, hidden = self._target_over(chunks, ForwardMode.EXTEND)
        defer = self._defers(chunks, decoding)
        now = [i for i, deferred in enumerate(defer) if not deferred]
        if now:
            rows = hidden if len(now) == len(chunks) else hidden[chunk_rows(chunks, now)]
            batch = prefill_draft_batch([chunks[i] for i in now], [outputs[i] for i in now], rows)
            for i, drafted in zip(now, self.drafter.draft(batch)):
                outputs[i].draft_tokens = drafted
        if len(now) < len(chunks):
            self._keep_undrafted(chunks, outputs, hidden, defer)
        return outputs

    def _keep_undrafted(self, chunks, outputs, hidden: torch.Tensor, defer: list[bool]) -> None:
        """The deferred chunks' rows (the newest `kv_reach` of them) join their requests'
        `UndraftedRows`; a chunk that completes its prompt (or resumes a retracted request)
        gets placeholder drafts, replaced by the catch-up's before any round verifies."""
        reach = self.drafter.runner.model.kv_reach
        spans = chunk_spans(chunks)
        for chunk, output, deferred, (begin, end) in zip(chunks, outputs, defer, spans):
            if not deferred:
                continue
            req = chunk.req
            kept = self.undrafted.setdefault(req.rid, UndraftedRows(req, chunk.start))
            rows = hidden[max(begin, end - reach) : end].clone()
            following = following_tokens(chunk, output)[-len(rows) :]
            kept.extend(rows, following, reach, skipped=chunk.length - len(rows))
            if chunk.completes or chunk.resumes:
                output.draft_tokens = DRAFTS_TO_COME * self.spec.num_steps

    def _defers(self, chunks: Sequence[Chunk], decoding: Sequence[Req]) -> list[bool]:
        """Which chunks leave their rows to the draft's catch-up (`UndraftedRows`) instead
        of a draft pass now. While the next decode step is expected to run without
        speculation (the policy's choice for this step's decode batch plus the requests
        of its chunks), a pass now may be wasted: a request that
        finishes before speculation resumes needs no draft pass (its newest `kv_reach`
        rows go with the state the prefix cache keeps). A chunk of a request with rows
        kept already defers too (a request resumed from a state the draft owes rows,
        `_adopt_owed`, included), since the draft reads the rows before it. Only with a
        window-only draft: a draft reading every row would keep every prompt row's hidden
        state."""
        if self.policy.plain_from() is None and not self.undrafted:
            return [False] * len(chunks)  # nothing skipped, nothing to skip
        if self.drafter.runner.model.kv_reach is None:
            return [False] * len(chunks)
        # the batch these prompts decode in: the running one plus every chunk's request (a
        # request whose prompt does not complete here still joins it within a few steps; a
        # step of partial chunks alone would otherwise ask about an empty batch)
        off = not self.speculates([*decoding, *(c.req for c in chunks)], beside_prompts=True)
        return [off or c.req.rid in self.undrafted for c in chunks]

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


def round_history(req: Req) -> tuple[int, int]:
    """`(rounds, tokens)` a request's verify rounds have yielded so far (accepted drafts plus
    each round's own token)."""
    accepted = sum(m * rounds for m, rounds in enumerate(req.spec_accept_hist))
    return req.spec_verify_ct, req.spec_verify_ct + accepted


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


def pass_groups(lengths: Sequence[int], max_rows: int | None) -> list[range]:
    """Consecutive indices of `lengths` in groups of at most `max_rows` rows together (a
    single longer one alone); one group when `max_rows` is None."""
    if max_rows is None:
        return [range(len(lengths))]
    groups, start, rows = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and rows + n > max_rows:
            groups.append(range(start, i))
            start, rows = i, 0
        rows += n
    if start < len(lengths):
        groups.append(range(start, len(lengths)))
    return groups


def catch_up_draft_batch(kept: Sequence[UndraftedRows], propose: Sequence[bool]) -> DraftBatch:
    """The draft's pass over the rows requests decoded without speculation, proposing from
    each request's newest row where `propose` says so. Their grammars have seen every
    emitted token already."""
    reqs = [k.req for k in kept]
    return DraftBatch(
        reqs=reqs,
        prefix_lens=[k.start for k in kept],
        extend_lens=[len(k) for k in kept],
        next_tokens=torch.tensor([t for k in kept for t in k.following], dtype=torch.long),
        target_hidden=torch.stack([h for k in kept for h in k.hidden]),
        gather_rows=[len(k) - 1 for k in kept],
        propose=list(propose),
        pending_tokens=[[] for _ in kept] if any(r.grammar for r in reqs) else None,
        from_latest_target=False,
    )


# a deferred request's drafts until its first speculating step drafts them (`_catch_up`):
# the scheduler decodes a request that has drafts, and a verify round takes the caught-up
# ones instead
DRAFTS_TO_COME = [0]


def following_tokens(chunk: Chunk, output: TokenOutput) -> list[int]:
    """The token after each row of `chunk`: the next prompt token, or for the last row of a
    completing chunk the token just sampled."""
    req = chunk.req
    return req.all_ids[chunk.start + 1 : chunk.end] + (output.tokens or [req.all_ids[chunk.end]])


def chunk_spans(chunks: Sequence[Chunk]) -> list[tuple[int, int]]:
    """Each chunk's rows `[begin, end)` in the step's `[sum len, D]`."""
    spans, end = [], 0
    for c in chunks:
        spans.append((end, end + c.length))
        end += c.length
    return spans


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
