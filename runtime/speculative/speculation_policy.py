# SPDX-License-Identifier: Apache-2.0
"""Whether a decode step speculates: a fixed batch-size limit, or one measured per bucket.

A verify round pays while it costs less than the plain decode steps its tokens would
otherwise take: true where a step is bound by fixed costs, false once the batch makes it
compute-bound. Where that lies depends on the device, model, dtype and acceptance, so:

* `FixedLimit` is vLLM's `speculative_disable_by_batch_size`: decode steps of at least
  `limit` requests run without speculation (None: every step speculates).
* `MeasuredSpeculation` (`auto`, the default) times decode steps per captured bucket and
  mode, and speculates while `accept_length x plain_seconds >= (1 + margin) x
  round_seconds`, with hysteresis, periodic probes of the other mode, steps beside a
  compile timed apart, an optional start-up calibration (`calibrate`), and the decode rows
  of steps carrying prompt chunks decided by calibrated times (`compute_pays`).

Either way a request's tokens are plain decoding's. The decisions are rank 0's alone, so
ranks never disagree. The rules and why: docs/architecture.md section 3.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


class FixedLimit:
    """Speculate in decode steps of fewer than `limit` requests (None: always)."""

    measured = False

    def __init__(self, limit: int | None):
        self.limit = limit

    def speculates(
        self, batch_size: int, history: Sequence[tuple[int, int]] = (), beside_prompts=False
    ) -> bool:
        return self.limit is None or batch_size < self.limit

    def reset(self) -> None:
        """Nothing measured to forget."""

    def plain_from(self) -> int | None:
        """The smallest batch that decodes without speculation (None: none does)."""
        return self.limit

    def describe(self) -> dict:
        return {}


@dataclass
class RecentCost:
    """Seconds per decode step of one bucket in one mode: the median of the newest 8
    timings (a median, since a step the server's other threads or the machine slowed now
    and then must not move the choice)."""

    recent: deque = field(default_factory=lambda: deque(maxlen=8))
    samples: int = 0

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)
        self.samples += 1

    @property
    def seconds(self) -> float | None:
        return statistics.median(self.recent) if self.recent else None


@dataclass
class BucketCosts:
    """What one bucket measured, and the probe of the mode it is not using, if one runs."""

    round: RecentCost = field(default_factory=RecentCost)
    plain: RecentCost = field(default_factory=RecentCost)
    # steps that met a step of the bucket still compiling (eager, or padded to a larger
    # bucket, beside a compile): a mode's stand-in until its settled steps are timed
    loading_round: RecentCost = field(default_factory=RecentCost)
    loading_plain: RecentCost = field(default_factory=RecentCost)
    calibrated: tuple[float, float] | None = None  # (round, plain) seconds before the traffic
    since_probe: int = 0  # steps since the last probe ended (or since the first one)
    probe_left: int = 0  # steps of `probe_speculates` still to run
    probe_speculates: bool = False
    period: int = 0  # steps between probes now (0: no probe has started here yet)
    speculating: bool | None = None  # the latest choice outside a probe (None: none yet)
    accept_length: float | None = None  # the latest batch's (None: the traffic's)


class MeasuredSpeculation:
    """Speculate in a bucket while its measured rounds yield tokens faster than plain steps
    (see the module docstring). `bucket_for(batch_size)` names the bucket of a batch (its
    captured step's; None: the batch size itself)."""

    measured = True

    def __init__(
        self,
        bucket_for: Callable[[int], int | None],
        *,
        warmup: int = 8,
        probe: int = 4,
        period: int = 64,
        max_period: int = 1024,
        smoothing: float = 1 / 256,
        prior_rounds: float = 4.0,
        margin: float = 0.15,
        hysteresis: float = 0.15,
    ):
        self.bucket_for = bucket_for
        self.warmup, self.probe, self.period, self.smoothing = warmup, probe, period, smoothing
        self.prior_rounds = prior_rounds
        self.max_period, self.margin, self.hysteresis = max_period, margin, hysteresis
        self.buckets: dict[int, BucketCosts] = {}
        self.request_rounds = 0  # rounds seen, one per request in each
        self._accept_sum = self._accept_weight = 0.0

    def reset(self) -> None:
        """Forget every measurement (after a warm-up whose steps timed compiles)."""
        self.buckets.clear()
        self.request_rounds = 0
        self._accept_sum = self._accept_weight = 0.0

    @property
    def accept_length(self) -> float | None:
        """Tokens per request per round: the exponentially weighted mean over request-rounds
        (bias-corrected, as Adam's moments, so the first rounds are not pulled to zero)."""
        return self._accept_sum / self._accept_weight if self._accept_weight else None

    def batch_accept_length(self, history: Sequence[tuple[int, int]]) -> float | None:
        """Expected tokens per request per round of a batch whose requests ran `(rounds,
        tokens)` so far: the mean over the requests of `(prior_rounds x traffic's +
        tokens) / (prior_rounds + rounds)` (the traffic's `accept_length` where `history`
        is empty; None before any round)."""
        prior = self.accept_length
        if prior is None or not history:
            return prior
        weight = self.prior_rounds
        return statistics.fmean((weight * prior + t) / (weight + r) for r, t in history)

    def record_accept(self, requests: int, tokens_per_request: float) -> None:
        """A step's rounds: `requests` of them yielding `tokens_per_request` on average. Each
        request-round weighs as much as a round of one request, so one round of a large
        batch outweighs a few rounds of one request, whose acceptance swings from round to
        round."""
        keep = (1 - self.smoothing) ** requests
        self._accept_sum = keep * self._accept_sum + (1 - keep) * tokens_per_request
        self._accept_weight = keep * self._accept_weight + (1 - keep)
        self.request_rounds += requests

    def calibrate(self, bucket: int, round_seconds: list[float], plain_seconds: list[float]):
        """Both modes' step times at `bucket`, timed before the traffic (`StepTimer`): until
        the traffic has timed both, the bucket chooses by their medians (see
        `speculation_pays`) as soon as the traffic's rounds give an accept length, and it
        probes the mode it does not use a period later (not after `warmup` rounds)."""
        costs = self.buckets.setdefault(bucket, BucketCosts())
        costs.calibrated = statistics.median(round_seconds), statistics.median(plain_seconds)
        costs.period = costs.period or self.period

    def bucket_of(self, batch_size: int) -> int:
        return self.bucket_for(batch_size) or batch_size

    def _costs(self, batch_size: int) -> BucketCosts:
        return self.buckets.setdefault(self.bucket_of(batch_size), BucketCosts())

    def speculation_pays(self, costs: BucketCosts) -> bool:
        """Whether a round's tokens come faster than plain steps', by the margin, and by the
        hysteresis too where the bucket decodes plainly now (True until both modes, or the
        bucket's calibration, and the accept length over at least `warmup` request-rounds
        are measured)."""
        if costs.calibrated is None:
            round_s = _newest_seconds(costs.round, costs.loading_round)
            plain_s = _newest_seconds(costs.plain, costs.loading_plain)
        else:
            round_s, plain_s = costs.round.seconds, costs.plain.seconds
            # the traffic's steps cost more than the calibration's by about as much in either
            # mode (a server's scheduling and streaming are per step, not per row): a mode
            # the traffic has not timed (a probe's worth of steps: one step finishing many
            # requests costs more than the steps around it) is its calibrated time plus the
            # other mode's extra
            round_s = round_s if len(costs.round.recent) >= self.probe else None
            plain_s = plain_s if len(costs.plain.recent) >= self.probe else None
            calibrated_round, calibrated_plain = costs.calibrated
            if round_s is None and plain_s is None:
                round_s, plain_s = costs.calibrated
            elif round_s is None:
                round_s = calibrated_round + plain_s - calibrated_plain
            elif plain_s is None:
                plain_s = calibrated_plain + round_s - calibrated_round
        if round_s is None or plain_s is None:
            return True
        if self.request_rounds < self.warmup:
            return True
        return self._rounds_win(costs, round_s, plain_s)

    def _rounds_win(self, costs: BucketCosts, round_s: float, plain_s: float) -> bool:
        """`accept x plain_s >= (1 + margin) x round_s`, with the hysteresis added to the
        margin where the bucket decodes plainly now."""
        margin = self.margin + (self.hysteresis if costs.speculating is False else 0.0)
        accept = self.accept_length if costs.accept_length is None else costs.accept_length
        return accept * plain_s >= (1 + margin) * round_s

    def speculates(
        self, batch_size: int, history: Sequence[tuple[int, int]] = (), beside_prompts=False
    ) -> bool:
        """Whether a decode step of `batch_size` requests runs a verify round; `history`:
        each request's `(rounds, tokens)` so far (`batch_accept_length`; empty: the
        traffic's accept length stands for the batch's). `beside_prompts`: the step also
        carries prompt chunks (`compute_pays`)."""
        costs = self.buckets.get(self.bucket_of(batch_size))
        if costs is None:
            return True  # nothing measured here yet
        costs.accept_length = self.batch_accept_length(history) if history else None
        if beside_prompts and costs.calibrated is not None and self.request_rounds >= self.warmup:
            return self.compute_pays(costs)
        if costs.probe_left:
            return costs.probe_speculates
        costs.speculating = self.speculation_pays(costs)
        return costs.speculating

    def compute_pays(self, costs: BucketCosts) -> bool:
        """Whether rounds pay by the bucket's calibrated step times alone, for decode rows
        beside prompt chunks: the traffic's times are of decode-only steps, where a
        server's per-step work (streaming, scheduling) makes a plain step dear and a
        round, paying it once for several tokens, cheap; beside a chunk's extend that work
        is paid once for the step either way, and what a round costs more is its compute.
        The same margin, and the hysteresis where the bucket decodes plainly now."""
        return self._rounds_win(costs, *costs.calibrated)

    def record(self, batch_size: int, speculated: bool, seconds: float, *, settled=True) -> None:
        """One decode step's time. `settled`: every captured step it ran was its own bucket's
        and ready (no compile ran or was pending); an unsettled step is timed apart, as its
        mode's stand-in until settled steps of that mode are timed."""
        costs = self._costs(batch_size)
        probing = costs.probe_left > 0 and speculated == costs.probe_speculates
        if settled:
            (costs.round if speculated else costs.plain).add(seconds)
        else:
            (costs.loading_round if speculated else costs.loading_plain).add(seconds)
        if probing:
            costs.probe_left -= 1
            if not costs.probe_left:
                # a probe that changed nothing comes back twice as late (a probe of rounds in
                # a bucket decoding plainly first catches the draft up over every request's
                # skipped rows), one that changed the choice after the base period
                kept = self.speculation_pays(costs) != costs.probe_speculates
                costs.period = min(2 * costs.period, self.max_period) if kept else self.period
                costs.since_probe = 0
            return
        costs.since_probe += 1
        # the first probe comes after `warmup` rounds, the others a period after the last
        if costs.since_probe >= (costs.period or self.warmup):
            costs.probe_speculates = not self.speculation_pays(costs)
            costs.probe_left, costs.since_probe = self.probe, 0
            costs.period = costs.period or self.period

    def plain_from(self) -> int | None:
        """Any batch may decode without speculation."""
        return 1

    def describe(self) -> dict:
        """Per bucket: whether it speculates now and what it measured (for server info)."""
        out = {}
        for bucket, costs in sorted(self.buckets.items()):
            out[str(bucket)] = {
                "speculates": self.speculation_pays(costs),
                "round_ms": _ms(costs.round.seconds),
                "plain_ms": _ms(costs.plain.seconds),
                "rounds": costs.round.samples,
                "plain_steps": costs.plain.samples,
            }
            if costs.accept_length is not None:
                out[str(bucket)]["batch_accept_length"] = round(costs.accept_length, 3)
            if costs.calibrated is not None:
                round_s, plain_s = costs.calibrated
                out[str(bucket)].update(
                    calibrated_round_ms=_ms(round_s), calibrated_plain_ms=_ms(plain_s)
                )
            if costs.loading_round.samples or costs.loading_plain.samples:
                out[str(bucket)].update(
                    loading_round_ms=_ms(costs.loading_round.seconds),
                    loading_plain_ms=_ms(costs.loading_plain.seconds),
                )
        return out


class StepTimer:
    """Every decode step in one mode (`speculate`), each settled step's time kept by
    bucket: a calibration run before the traffic (`runtime.engine.speculation_calibration`)
    whose timings become a `MeasuredSpeculation`'s prior. Its rounds' acceptance, on
    made-up prompts, says nothing about the traffic's and is dropped."""

    measured = True

    def __init__(self, bucket_of: Callable[[int], int], speculate: bool):
        self.bucket_of, self.speculate = bucket_of, speculate
        self.seconds: dict[int, list[float]] = {}

    def speculates(
        self, batch_size: int, history: Sequence[tuple[int, int]] = (), beside_prompts=False
    ) -> bool:
        return self.speculate

    def record(self, batch_size: int, speculated: bool, seconds: float, *, settled=True) -> None:
        if settled and speculated == self.speculate:
            self.seconds.setdefault(self.bucket_of(batch_size), []).append(seconds)

    def record_accept(self, requests: int, tokens_per_request: float) -> None:
        """Made-up prompts' acceptance: not the traffic's."""

    def plain_from(self) -> int | None:
        return None if self.speculate else 1

    def describe(self) -> dict:
        return {}


def _newest_seconds(settled: RecentCost, loading: RecentCost) -> float | None:
    """A mode's cost: its settled steps' once any are timed, else its unsettled steps'."""
    return settled.seconds if settled.samples else loading.seconds


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def speculation_policy(
    limit: int | None, measured: bool, bucket_for: Callable[[int], int | None] | None
) -> FixedLimit | MeasuredSpeculation:
    """`measured` (`--speculative-disable-by-batch-size auto`) where the steps are captured
    (`bucket_for` not None); eager steps' costs swing with every compile and allocation, so
    an engine without captured steps follows `limit` (None: always speculate)."""
    if measured and bucket_for is not None:
        return MeasuredSpeculation(bucket_for)
    return FixedLimit(limit)
