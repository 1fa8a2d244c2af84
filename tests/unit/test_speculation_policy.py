# SPDX-License-Identifier: Apache-2.0
"""`speculation_policy`: a fixed batch-size limit, and the default measured choice per bucket
(a bucket speculates while `accept_length x plain step >= round`), driven here by synthetic
step times so each decision can be checked against the rule it implements."""

import pytest

from runtime.configs.speculative import SpeculativeConfig, parse_disable_by_batch_size
from runtime.speculative.speculation_policy import (
    FixedLimit,
    MeasuredSpeculation,
    StepTimer,
    speculation_policy,
)

BUCKETS = (1, 4, 16)


def bucket_for(n: int) -> int | None:
    return next((b for b in BUCKETS if b >= n), None)


def drive(
    policy,
    batch_size: int,
    steps: int,
    round_s: float,
    plain_s: float,
    accept: float,
    settled=lambda speculated: True,
):
    """`steps` decode steps at `batch_size`, each in the mode the policy picks and settled
    as `settled(speculated)` says; returns the modes (True: a verify round)."""
    modes = []
    for _ in range(steps):
        speculated = policy.speculates(batch_size)
        modes.append(speculated)
        if speculated:
            policy.record_accept(batch_size, accept)
        seconds = round_s if speculated else plain_s
        policy.record(batch_size, speculated, seconds, settled=settled(speculated))
    return modes


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, (None, False)),
        ("none", (None, False)),
        ("auto", (None, True)),
        ("AUTO", (None, True)),
        (8, (8, False)),
        ("8", (8, False)),
    ],
)
def test_the_flag_takes_a_batch_size_auto_or_none(value, expected):
    assert parse_disable_by_batch_size(value) == expected


@pytest.mark.parametrize("value", [0, "0", -3, "eight", "8.5", 2.5, ""])
def test_a_bad_value_names_the_flag_and_its_choices(value):
    with pytest.raises(ValueError, match="--speculative-disable-by-batch-size.*'auto'"):
        parse_disable_by_batch_size(value)


def test_auto_resolves_to_a_measured_config_and_is_no_error_without_speculation():
    spec = SpeculativeConfig.resolve("NEXTN", disable_by_batch_size="auto")
    assert spec.measured and spec.disable_by_batch_size is None
    assert spec.describe_limit() == "auto"
    assert SpeculativeConfig.resolve(None, disable_by_batch_size="auto") is None
    with pytest.raises(ValueError, match="need --speculative-algorithm"):
        SpeculativeConfig.resolve(None, disable_by_batch_size=4)


def test_a_fixed_limit_speculates_below_it():
    policy = FixedLimit(8)
    assert [policy.speculates(n) for n in (1, 7, 8, 30)] == [True, True, False, False]
    assert all(FixedLimit(None).speculates(n) for n in (1, 64))


def test_without_captured_steps_auto_falls_back_to_the_fixed_limit():
    assert isinstance(speculation_policy(None, True, bucket_for), MeasuredSpeculation)
    fallback = speculation_policy(None, True, None)
    assert isinstance(fallback, FixedLimit) and fallback.limit is None
    assert speculation_policy(4, False, bucket_for).limit == 4


def test_a_bucket_where_rounds_pay_keeps_speculating_after_its_probe():
    """Rounds of 10 ms yielding 3 tokens against plain steps of 5 ms: after `warmup` rounds
    a probe of `probe` plain steps, then speculation again (3 x 5 >= 10)."""
    policy = MeasuredSpeculation(bucket_for, warmup=8, probe=4, period=128)
    modes = drive(policy, 1, 40, round_s=0.010, plain_s=0.005, accept=3.0)
    assert modes[:8] == [True] * 8
    assert modes[8:12] == [False] * 4
    assert modes[12:] == [True] * 28
    assert policy.describe()["1"] == {
        "speculates": True,
        "round_ms": 10.0,
        "plain_ms": 5.0,
        "rounds": 36,
        "plain_steps": 4,
    }


def test_a_bucket_where_rounds_cost_more_than_their_tokens_decodes_plainly():
    """Rounds of 40 ms yielding 3 tokens against plain steps of 12 ms: the tokens of a round
    take 36 ms as plain steps, so after the probe the bucket decodes plainly."""
    policy = MeasuredSpeculation(bucket_for, warmup=8, probe=4, period=128)
    modes = drive(policy, 16, 30, round_s=0.040, plain_s=0.012, accept=3.0)
    assert modes[:8] == [True] * 8 and modes[8:] == [False] * 22
    assert not policy.speculates(9)  # the same bucket (16)
    assert policy.speculates(1)  # another bucket still starts by speculating


def test_the_losing_mode_is_probed_every_period_and_the_choice_follows_a_change():
    """Plain wins at first; a probe of rounds after the base period, and as it changes
    nothing the next comes twice as late. Once the rounds turn cheap (better acceptance,
    say), that probe's timings outnumber the old ones in the median and the bucket goes
    back to speculating."""
    policy = MeasuredSpeculation(bucket_for, warmup=2, probe=5, period=10)
    modes = drive(policy, 4, 22, round_s=0.030, plain_s=0.010, accept=2.0)
    # 2 rounds, a 5-step plain probe (2 x 10 ms < 1.15 x 30 ms: plain wins), 10 plain
    # steps, a 5-round probe
    assert modes == [True] * 2 + [False] * 15 + [True] * 5
    later = drive(policy, 4, 26, round_s=0.015, plain_s=0.010, accept=2.0)
    # the probe kept the choice: the next comes 20 plain steps later; its 5 rounds of 15 ms
    # make the median round 15 ms, and 2 x 10 >= 1.15 x 15
    assert later == [False] * 20 + [True] * 6
    assert policy.describe()["4"]["round_ms"] == 15.0


def test_steps_beside_a_compile_are_timed_apart_and_decide_until_settled_ones_exist():
    """A bucket whose steps all load in the background: rounds of 300 ms yielding 3 tokens
    against plain steps of 50 ms, none settled. After `warmup` rounds the probe of plain
    steps decides by those times (3 x 50 < 1.15 x 300) instead of speculating until a
    compile ends, and the bucket decodes plainly until its probe of rounds a period later.
    The steps are ready by then: the probe's settled rounds of 20 ms replace the loading
    ones (3 x 50 >= 1.15 x 20: speculation resumes), and the next probe's settled plain
    steps of 10 ms replace theirs and keep it (3 x 10 >= 1.15 x 20)."""
    policy = MeasuredSpeculation(bucket_for, warmup=3, probe=2, period=6)
    loading = drive(policy, 4, 11, 0.300, 0.050, 3.0, settled=lambda s: False)
    assert loading == [True] * 3 + [False] * 8
    described = policy.describe()["4"]
    assert described["round_ms"] is None and described["plain_ms"] is None
    assert (described["loading_round_ms"], described["loading_plain_ms"]) == (300.0, 50.0)
    ready = drive(policy, 4, 12, 0.020, 0.010, 3.0, settled=lambda s: True)
    assert ready == [True] * 8 + [False] * 2 + [True] * 2
    assert (policy.describe()["4"]["round_ms"], policy.describe()["4"]["plain_ms"]) == (20, 10)


def test_a_settled_mode_replaces_its_loading_time_the_other_keeps_its_own():
    """Only the rounds' bucket still loads: settled plain steps of 12 ms against rounds
    timed at 40 ms beside the compile decode plainly (3 x 12 < 1.15 x 40)."""
    policy = MeasuredSpeculation(bucket_for, warmup=2, probe=2, period=100)
    modes = drive(policy, 16, 8, 0.040, 0.012, 3.0, settled=lambda s: not s)
    assert modes == [True] * 2 + [False] * 6
    costs = policy.buckets[16]
    assert costs.round.samples == 0 and costs.loading_round.samples == 2
    assert costs.plain.samples == 6 and costs.loading_plain.samples == 0


def test_a_reset_forgets_the_warm_up():
    policy = MeasuredSpeculation(bucket_for, warmup=1, probe=1)
    drive(policy, 1, 3, round_s=0.05, plain_s=0.01, accept=1.0)
    assert not policy.speculates(1)
    policy.reset()
    assert policy.speculates(1) and policy.describe() == {} and policy.accept_length is None


def test_rounds_must_beat_plain_steps_by_the_margin():
    """A round's 3 tokens as plain steps of 10 ms take 30 ms: a round of 28 ms is faster, but
    by less than the 15% margin for what speculating costs outside its rounds, so the
    bucket decodes plainly; at 25 ms (30 >= 1.15 x 25) it speculates."""
    for round_s, speculates in ((0.028, False), (0.025, True)):
        policy = MeasuredSpeculation(bucket_for, warmup=2, probe=2, period=100, smoothing=1.0)
        modes = drive(policy, 16, 8, round_s=round_s, plain_s=0.010, accept=3.0)
        assert modes[:4] == [True, True, False, False]
        assert modes[4:] == [speculates] * 4
        assert policy.describe()["16"]["speculates"] is speculates


def test_a_bucket_decoding_plainly_needs_the_hysteresis_too_to_speculate_again():
    """Rounds of 30 ms yielding 3 tokens against plain steps of 12 ms: a round's tokens
    come 1.2x faster than plain steps, above the 15% margin but below it plus the 15%
    hysteresis. A bucket that speculates keeps speculating; one that decodes plainly
    (its rounds took 40 ms before) stays plain after its probe of 30 ms rounds, where
    rounds of 25 ms (1.44x) turn speculation back on."""
    kwargs = dict(warmup=2, probe=4, period=4, smoothing=1.0)
    speculating = MeasuredSpeculation(bucket_for, **kwargs)
    modes = drive(speculating, 16, 10, round_s=0.030, plain_s=0.012, accept=3.0)
    assert modes == [True] * 2 + [False] * 4 + [True] * 4
    for round_s, resumes in ((0.030, False), (0.025, True)):
        plain = MeasuredSpeculation(bucket_for, **kwargs)
        modes = drive(plain, 16, 6, round_s=0.040, plain_s=0.012, accept=3.0)
        assert modes == [True] * 2 + [False] * 4
        # 4 plain steps, a probe of 4 rounds, then the choice
        modes = drive(plain, 16, 10, round_s=round_s, plain_s=0.012, accept=3.0)
        assert modes == [False] * 4 + [True] * 4 + [resumes] * 2


def test_the_accept_length_weighs_each_request_round_alike():
    """An exponentially weighted mean over request-rounds, bias-corrected: the first round
    is taken as it is, a round of 16 requests all but replaces rounds of one request, and
    a round of one request moves it by `smoothing`."""
    policy = MeasuredSpeculation(bucket_for, smoothing=0.2)
    assert policy.accept_length is None
    policy.record_accept(1, 4.0)
    assert policy.accept_length == pytest.approx(4.0)
    policy.record_accept(1, 1.0)  # (0.8 x 0.2 x 4 + 0.2 x 1) / (1 - 0.8^2)
    assert policy.accept_length == pytest.approx((0.64 + 0.2) / 0.36)
    policy.record_accept(16, 2.0)
    assert policy.accept_length == pytest.approx(2.0, abs=0.1)
    assert policy.request_rounds == 18


def test_a_bucket_waits_for_warmup_request_rounds_before_it_decodes_plainly():
    """Costs known in both modes, but one request's first rounds say little about the
    acceptance: plain steps only once `warmup` request-rounds are in."""
    policy = MeasuredSpeculation(bucket_for, warmup=8)
    policy.calibrate(4, [0.030] * 4, [0.010] * 4)
    policy.record_accept(1, 1.0)
    assert policy.speculates(4)
    policy.record_accept(3, 1.0)
    policy.record_accept(4, 1.0)
    assert not policy.speculates(4)  # 1 x 10 ms < 1.15 x 30 ms


def test_a_calibrated_bucket_chooses_from_the_first_accept_length_and_probes_a_period_later():
    """Both modes timed before the traffic: the large bucket decodes plainly from the step
    after its first round of 16 requests instead of after `warmup` rounds and a probe, and
    its first probe of rounds comes a period later."""
    policy = MeasuredSpeculation(bucket_for, warmup=8, probe=2, period=20)
    policy.calibrate(16, [0.040] * 6, [0.012] * 5)
    policy.calibrate(1, [0.010] * 6, [0.005] * 6)
    modes = drive(policy, 16, 25, round_s=0.040, plain_s=0.012, accept=3.0)
    # the period counts every settled step since the calibration, the first round included
    assert modes == [True] + [False] * 19 + [True] * 2 + [False] * 3
    assert policy.describe()["16"] == {
        "speculates": False,
        "round_ms": 40.0,
        "plain_ms": 12.0,
        "rounds": 3,
        "plain_steps": 22,
        "calibrated_round_ms": 40.0,
        "calibrated_plain_ms": 12.0,
    }
    assert drive(policy, 1, 12, round_s=0.010, plain_s=0.005, accept=3.0) == [True] * 12


def test_decode_rows_beside_prompt_chunks_speculate_by_the_calibrated_compute_alone():
    """Decode-only steps under load: plain 27 ms, rounds 65 ms for 3.1 tokens, so rounds
    pay (3.1 x 27 >= 1.15 x 65). Their calibrated compute: plain 16 ms, rounds 52 ms, so
    beside a prompt chunk (whose step pays the per-step work either way) they do not
    (3.1 x 16 < 1.15 x 52). Without a calibration, or before `warmup` request-rounds, a
    step beside prompts decides as a decode-only one."""
    policy = MeasuredSpeculation(bucket_for, warmup=8, probe=2, period=1000)
    policy.calibrate(16, [0.052] * 4, [0.016] * 4)
    assert policy.speculates(16, beside_prompts=True)  # no acceptance known yet
    policy.record_accept(16, 3.1)
    drive(policy, 16, 6, round_s=0.065, plain_s=0.027, accept=3.1)
    assert policy.speculates(16)
    assert not policy.speculates(16, beside_prompts=True)
    assert policy.speculates(16)  # the decode-only choice is left as it was
    uncalibrated = MeasuredSpeculation(bucket_for, warmup=1, probe=2, period=1000)
    uncalibrated.record_accept(16, 3.1)
    drive(uncalibrated, 16, 6, round_s=0.065, plain_s=0.027, accept=3.1)
    assert uncalibrated.speculates(16, beside_prompts=True) == uncalibrated.speculates(16)
    assert all(FixedLimit(8).speculates(n, beside_prompts=True) == (n < 8) for n in (4, 16))


def test_a_mode_the_traffic_has_not_timed_costs_its_calibration_plus_the_others_extra():
    """Calibrated: rounds of 40 ms, plain steps of 12 ms, so with 3 tokens a round plain
    steps win. Under load the plain steps take 24 ms: once a probe's worth of them (3) is
    timed, that is 12 ms more per step, so a round is taken for 52 ms, and 3 x 24 >= 1.15 x
    52 makes rounds pay; the rounds the bucket then runs take 70 ms (3 x 24 < 1.15 x 70),
    which decides once 3 are timed."""
    policy = MeasuredSpeculation(bucket_for, warmup=1, probe=3, period=100)
    policy.calibrate(16, [0.040] * 4, [0.012] * 4)
    policy.record_accept(16, 3.0)
    modes = drive(policy, 16, 8, round_s=0.070, plain_s=0.024, accept=3.0)
    assert modes == [False] * 3 + [True] * 3 + [False] * 2
    assert policy.describe()["16"]["round_ms"] == 70.0


def test_a_step_timer_keeps_the_settled_steps_of_its_mode_by_bucket():
    timer = StepTimer(lambda n: bucket_for(n) or n, speculate=True)
    assert timer.speculates(64) and timer.plain_from() is None
    assert StepTimer(bucket_for, speculate=False).plain_from() == 1
    timer.record(3, True, 0.02)
    timer.record(4, True, 0.03)
    timer.record(2, True, 1.0, settled=False)  # met a compile
    timer.record(1, True, 0.01)
    timer.record(1, False, 0.5)  # not its mode
    timer.record_accept(4, 1.0)  # made-up prompts: ignored
    assert timer.seconds == {4: [0.02, 0.03], 1: [0.01]}


def test_a_batch_accept_length_is_its_requests_own_shrunk_toward_the_traffics():
    policy = MeasuredSpeculation(bucket_for, prior_rounds=4)
    assert policy.batch_accept_length([(3, 9)]) is None  # no round of the traffic yet
    policy.record_accept(16, 3.0)
    assert policy.batch_accept_length([]) == pytest.approx(3.0)
    # a fresh request: the traffic's 3.0; one with 4 rounds of 2 tokens: (4 x 3 + 8) / 8
    assert policy.batch_accept_length([(0, 0), (4, 8)]) == pytest.approx((3.0 + 2.5) / 2)
    assert policy.batch_accept_length([(400, 400)]) == pytest.approx((12 + 400) / 404)


def slow_tail_then_fresh_batch(policy) -> bool:
    """Batch 16 speculating at 3.3 tokens a round (calibrated: a round 2.57 plain steps, so
    rounds pay up to the margin from 2.96 tokens on), then the batch's four slowest
    requests finishing alone in bucket 4 at 2.2 tokens a round, then a fresh batch of 16:
    whether that batch speculates."""
    policy.calibrate(16, [0.027] * 4, [0.0105] * 4)
    policy.calibrate(4, [0.012] * 4, [0.005] * 4)
    rounds = [(0, 0)] * 16
    for _ in range(15):
        policy.speculates(16, rounds)
        policy.record_accept(16, 3.3)
        policy.record(16, True, 0.027)
        rounds = [(r + 1, t + 3.3) for r, t in rounds]
    slow = [(15, 15 * 2.6)] * 4
    for _ in range(8):
        policy.speculates(4, slow)
        policy.record_accept(4, 2.2)
        policy.record(4, True, 0.012)
        slow = [(r + 1, t + 2.2) for r, t in slow]
    return policy.speculates(16, [(0, 0)] * 16)


def test_a_fresh_batch_is_not_judged_by_the_slow_end_of_the_one_before():
    """The traffic's accept length remembers a few hundred request-rounds, so the last
    rounds of a batch's slowest requests (32 request-rounds at 2.2 after 240 at 3.3) leave
    it above the break-even and a fresh batch speculates. With the earlier memory of a few
    request-rounds (smoothing 0.2) the tail set it to 2.2 and the fresh batch decoded
    plainly."""
    assert slow_tail_then_fresh_batch(MeasuredSpeculation(bucket_for, warmup=1, period=1000))
    short_memory = MeasuredSpeculation(bucket_for, warmup=1, period=1000, smoothing=0.2)
    assert not slow_tail_then_fresh_batch(short_memory)


def test_one_poor_round_of_a_large_batch_does_not_flip_its_bucket():
    """A batch of 16 whose requests accepted 3.3 a round over 10 rounds has one round at
    2.5 on average (a swing of 0.8, about what 16 requests' mean does now and then): its
    requests' own histories keep the batch near 3.2, above the break-even 2.96, so it
    keeps speculating, where the traffic's short-memory mean alone would have fallen to
    2.5 and, once plain, needed the hysteresis as well to come back."""
    policy = MeasuredSpeculation(bucket_for, warmup=1, period=1000, smoothing=0.2)
    policy.calibrate(16, [0.027] * 4, [0.0105] * 4)
    history = [(10, 33.0)] * 16
    policy.record_accept(16, 3.3)
    assert policy.speculates(16, history)
    policy.record_accept(16, 2.5)
    history = [(11, 35.5)] * 16
    assert policy.speculates(16, history)
    assert policy.describe()["16"]["batch_accept_length"] == pytest.approx(
        (4 * policy.accept_length + 35.5) / 15, abs=1e-3
    )
    assert not policy.speculates(16)  # the traffic's mean alone: 2.5
