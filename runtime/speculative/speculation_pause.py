# SPDX-License-Identifier: Apache-2.0
"""Switching speculation off and on (`NextNWorker` asks the policy each step): what the
draft owes while it does not run, and how it catches up.

A decode step run plainly keeps, per request, the target rows the draft has not run over
(`UndraftedRows`); so does a prompt chunk deferred while the next decode step is expected
to run plainly (`defers`). When the requests speculate again, `catch_up` runs the draft over
every kept row of each, as over a prefill chunk, and proposes from the newest, as it would
after a verify round. A request that finishes first owes its newest `kv_reach` rows with
the state the prefix cache keeps (`Req.owed_draft_rows`); a request resuming from that
state adopts them (`adopt_owed`). `StepClock` times consecutive pure decode steps for a
measured policy. Contract: the draft's cache after a catch-up is the one speculating every
step would have left, so outputs never depend on when speculation was off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from runtime.core.request import OwedDraftRows, Req
from runtime.core.step_io import Chunk, TokenOutput
from runtime.execution.graph_runner import no_new_compiles
from runtime.speculative.draft_batch import DraftBatch, chunk_spans, following_tokens


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


class SpeculationPause:
    """The policy's choice per step, and the rows the draft owes while speculation is off,
    by request id (`undrafted`)."""

    def __init__(
        self, drafter, policy, num_steps: int, max_pass_rows: int | None, graph_runners: Callable
    ):
        """`drafter`, `policy`: the worker's (`NextNWorker.drafter` and `.policy` are these,
        swapped here by whoever swaps them); `graph_runners()`: the runners whose compiles
        a catch-up pass must not queue."""
        self.drafter, self.policy, self.num_steps = drafter, policy, num_steps
        self.max_pass_rows, self.graph_runners = max_pass_rows, graph_runners
        self.undrafted: dict[str, UndraftedRows] = {}

    def speculates(self, reqs: Sequence[Req], beside_prompts: bool = False) -> bool:
        """Whether a decode step over `reqs` runs verify rounds (a measured policy weighs
        their own acceptance so far; `beside_prompts`: the step carries prompt chunks too,
        which a measured policy decides by compute alone)."""
        history = [round_history(r) for r in reqs]
        return self.policy.speculates(len(reqs), history, beside_prompts=beside_prompts)

    @property
    def reach(self) -> int | None:
        return self.drafter.runner.model.kv_reach

    def adopt_owed(self, reqs: Sequence[Req]) -> None:
        """Requests resumed from a cached state the draft has not run over all of take its
        rows as their own skipped ones: their prompt chunks defer and their first
        speculating step catches the draft up over those rows and theirs together, which
        leaves the draft's cache as a draft pass at the first request's release would have."""
        for req in reqs:
            if req.owed_draft_rows is not None:
                self.undrafted[req.rid] = UndraftedRows.resumed(req, req.owed_draft_rows)
                req.owed_draft_rows = None

    def keep_decoded(
        self, reqs: Sequence[Req], outputs: Sequence[TokenOutput], hidden: torch.Tensor
    ) -> None:
        """A plain decode step's row of each request (`hidden` `[>= bs, D]`, followed by the
        token it sampled), kept for the draft to run over once the requests speculate."""
        reach = self.reach
        for req, output, row in zip(reqs, outputs, hidden[: len(reqs)].clone().unbind(0)):
            kept = self.undrafted.get(req.rid)
            if kept is None:
                kept = self.undrafted[req.rid] = UndraftedRows(req, req.seq_len - 1)
            kept.append(row, output.tokens[0], reach)

    def defers(self, chunks: Sequence[Chunk], decoding: Sequence[Req]) -> list[bool]:
        """Which chunks leave their rows to the draft's catch-up (`UndraftedRows`) instead
        of a draft pass now. While the next decode step is expected to run without
        speculation (the policy's choice for this step's decode batch plus the requests
        of its chunks), a pass now may be wasted: a request that
        finishes before speculation resumes needs no draft pass (its newest `kv_reach`
        rows go with the state the prefix cache keeps). A chunk of a request with rows
        kept already defers too (a request resumed from a state the draft owes rows,
        `adopt_owed`, included), since the draft reads the rows before it. Only with a
        window-only draft: a draft reading every row would keep every prompt row's hidden
        state."""
        if self.policy.plain_from() is None and not self.undrafted:
            return [False] * len(chunks)  # nothing skipped, nothing to skip
        if self.reach is None:
            return [False] * len(chunks)
        # the batch these prompts decode in: the running one plus every chunk's request (a
        # request whose prompt does not complete here still joins it within a few steps; a
        # step of partial chunks alone would otherwise ask about an empty batch)
        off = not self.speculates([*decoding, *(c.req for c in chunks)], beside_prompts=True)
        return [off or c.req.rid in self.undrafted for c in chunks]

    def keep_deferred(
        self,
        chunks: Sequence[Chunk],
        outputs: Sequence[TokenOutput],
        hidden: torch.Tensor,
        defer: Sequence[bool],
    ) -> None:
        """The deferred chunks' rows (the newest `kv_reach` of them) join their requests'
        `UndraftedRows`; a chunk that completes its prompt (or resumes a retracted request)
        gets placeholder drafts, replaced by the catch-up's before any round verifies."""
        reach = self.reach
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
                output.draft_tokens = DRAFTS_TO_COME * self.num_steps

    def catch_up(self, reqs: Sequence[Req]) -> dict[str, list[int]]:
        """Drafts for this step's round of the requests that decoded without speculation:
        the draft runs over every row it skipped (the newest one is followed by the
        request's newest token) and proposes from the newest, as it does after a verify
        round. By request id; empty when every request has its drafts already."""
        behind = [self.undrafted.pop(r.rid) for r in reqs if r.rid in self.undrafted]
        if not behind:
            return {}
        drafts = self.draft_skipped(behind, [True] * len(behind))
        return {rows.req.rid: drafted for rows, drafted in zip(behind, drafts)}

    def release(self, reqs: Sequence[Req], keep_state: bool = False) -> list[list[int] | None]:
        """`reqs` leave the running batch (finished, retracted or aborted) and their rows are
        dropped. `keep_state`: the prefix cache keeps their state. With a window-only draft
        a finished request's rows (its newest `kv_reach`) go with it
        (`Req.owed_draft_rows`): the draft runs over them only for a later request that
        resumes from that state. Otherwise the draft runs over the rows now
        (`draft_skipped`), so the cached draft state is what speculating every step leaves; a
        request that is not finished (retracted, to resume right there) also gets the
        drafts of its next round. Returns those drafts, None for the others."""
        kept = {r.rid: self.undrafted.pop(r.rid) for r in reqs if r.rid in self.undrafted}
        if not kept or not keep_state:
            return [None] * len(reqs)
        window_only = self.reach is not None
        now = []
        for rows in kept.values():
            if rows.req.finished and window_only:
                rows.req.owed_draft_rows = rows.owed()
            else:
                now.append(rows)
        if not now:
            return [None] * len(reqs)
        drafted = self.draft_skipped(now, [not k.req.finished for k in now])
        drafts = {rows.req.rid: d for rows, d in zip(now, drafted)}
        return [drafts.get(r.rid) for r in reqs]

    def owed_draft_rows(self, req: Req) -> OwedDraftRows | None:
        """The rows the draft has not run over for `req` (a copy: they keep growing here),
        for a snapshot of its state taken now."""
        rows = self.undrafted.get(req.rid)
        return rows.owed() if rows else None

    def draft_skipped(
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
        with no_new_compiles(self.graph_runners()):
            for group in pass_groups([len(k) for k in kept], self.max_pass_rows):
                kept_group = [kept[i] for i in group]
                batch = catch_up_draft_batch(kept_group, [propose[i] for i in group])
                drafts += self.drafter.draft(batch)
        return drafts


class StepClock:
    """What a measured policy learns from each step (`record_accept`, `record`); the policy
    and the counters are the worker's at each call (a calibration swaps both)."""

    def __init__(self, unsettled_runs: Callable[[], int]):
        """`unsettled_runs()`: steps so far that met a bucket still compiling
        (`GraphRunner.unsettled_runs`)."""
        self.unsettled_runs = unsettled_runs
        self._last_decode: DecodeMark | None = None  # the previous step, if pure decode

    @staticmethod
    def begin(stats) -> tuple[int, int]:
        """The acceptance counters of `stats` (`SpecStats`) before a step (for `end`)."""
        return stats.verify_rounds, stats.emitted_tokens

    def end(
        self,
        policy,
        stats,
        counters: tuple[int, int],
        batch_size: int,
        speculated: bool,
        caught_up: bool,
    ) -> None:
        """A measured policy learns the rounds' acceptance from every step that ran rounds,
        and step times from consecutive pure decode steps (`batch_size` > 0: no prompt
        chunk) in the same mode and bucket: the time from the end of the first to the end
        of the second is one step with everything the engine does per step (scheduling,
        outputs, a server's streaming), which a round pays once for several tokens. A round
        that first caught the draft up pays for the switch, not for itself; steps that met
        a bucket still compiling are unsettled."""
        if not policy.measured:
            return
        now, unsettled = time.perf_counter(), self.unsettled_runs()
        rounds = stats.verify_rounds - counters[0]
        if rounds:
            policy.record_accept(rounds, (stats.emitted_tokens - counters[1]) / rounds)
        last, self._last_decode = self._last_decode, None
        if not batch_size:
            return
        bucket = policy.bucket_of(batch_size)
        self._last_decode = DecodeMark(now, bucket, speculated, unsettled)
        if last is None or (last.bucket, last.speculated) != (bucket, speculated) or caught_up:
            return
        policy.record(batch_size, speculated, now - last.end, settled=unsettled == last.unsettled)


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


# a deferred request's drafts until its first speculating step drafts them (`catch_up`):
# the scheduler decodes a request that has drafts, and a verify round takes the caught-up
# ones instead
DRAFTS_TO_COME = [0]


def round_history(req: Req) -> tuple[int, int]:
    """`(rounds, tokens)` a request's verify rounds have yielded so far (accepted drafts plus
    each round's own token)."""
    accepted = sum(m * rounds for m, rounds in enumerate(req.spec_accept_hist))
    return req.spec_verify_ct, req.spec_verify_ct + accepted
