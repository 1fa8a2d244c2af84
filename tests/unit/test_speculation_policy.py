# SPDX-License-Identifier: Apache-2.0
"""`speculation_policy`: a fixed batch-size limit, and the default measured choice per bucket
(a bucket speculates while `accept_length x plain step >= round`), driven here by synthetic
step times so each decision can be checked against the rule it implements."""

import pytest

from runtime.configs.speculative import SpeculativeConfig, parse_disable_by_batch_size
from runtime.speculative.speculation_policy import (
    FixedLimit,
    MeasuredSpeculation,
    speculation_policy,
)

BUCKETS = (1, 4, 16)


def bucket_for(n: int) -> int | None:
    return next((b for b in BUCKETS if b >= n), None)


def drive(policy, batch_size: int, steps: int, round_s: float, plain_s: float, accept: float):
    """`steps` decode steps at `batch_size`, each in the mode the policy picks; returns the
    modes (True: a verify round)."""
    modes = []
    for _ in range(steps):
        speculated = policy.speculates(batch_size)
        modes.append(speculated)
        seconds = round_s if speculated else plain_s
        policy.record(
            batch_size, speculated, seconds, tokens_per_request=accept if speculated else None
        )
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


def test_a_step_that_met_a_compiling_bucket_ends_the_probe_and_counts_nothing():
    """The plain step's bucket compiles when the first probe reaches it: the probe stops
    (speculation goes on) and comes back a period later; nothing unsettled is averaged."""
    policy = MeasuredSpeculation(bucket_for, warmup=3, probe=2, period=6)
    drive(policy, 4, 3, round_s=0.01, plain_s=0.02, accept=2.0)
    assert not policy.speculates(4)  # the first probe
    policy.record(4, False, 5.0, settled=False)  # an eager step while its bucket compiles
    costs = policy.buckets[4]
    assert costs.plain.samples == 0 and costs.probe_left == 0
    assert drive(policy, 4, 6, round_s=0.01, plain_s=0.02, accept=2.0) == [True] * 6
    assert drive(policy, 4, 3, round_s=0.01, plain_s=0.02, accept=2.0) == [False, False, True]
    assert policy.describe()["4"]["plain_ms"] == 20.0


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
