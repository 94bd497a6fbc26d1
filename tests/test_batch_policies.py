"""The batch-size policies, as pure functions of what they observe."""

import pytest

from services.batcher.policy import (
    AdaptivePolicy, ArrivalRate, BaselinePolicy, FixedPolicy, LatencyProfile, QueueView, make_policy,
)

VIP, STANDARD = 1, 0


def view(now=10.0, oldest=10.0, level=STANDARD, waiting=1, running=(), max_rows=64):
    return QueueView(now, oldest, level, waiting, tuple(running), max_rows)


def test_latency_profile_learns_per_bucket_and_scales_to_unseen_sizes():
    profile = LatencyProfile(alpha=0.5)
    assert profile.estimate(8) is None
    profile.observe(8, 0.040)
    profile.observe(7, 0.060)  # same bucket (8): moves halfway
    assert profile.estimate(8) == pytest.approx(0.050)
    assert profile.estimate(32) == pytest.approx(0.200)  # 4x the rows of the nearest known bucket
    profile.observe(32, 0.100)
    # 16 is as near to 8 as to 32; the tie goes to the bucket learned first (8), scaled x2.
    assert profile.estimate(16) == pytest.approx(0.100)
    assert profile.estimate(2) == pytest.approx(0.0125)  # scaled down by rows ...
    assert profile.estimate(2, shrink=False) == pytest.approx(0.050)  # ... or, cautiously, not below its nearest


def test_latency_profile_tracks_how_much_batches_vary():
    profile = LatencyProfile(alpha=0.5, beta=0.5)
    profile.observe(32, 0.300)
    assert profile.estimate(32, deviations=2) == pytest.approx(0.300)  # one batch shows no variation yet
    profile.observe(32, 0.500)  # 200 ms off the average: the mean deviation moves halfway there
    assert profile.estimate(32) == pytest.approx(0.400)
    assert profile.estimate(32, deviations=2) == pytest.approx(0.400 + 2 * 0.100)
    assert profile.estimate(64, deviations=2) == pytest.approx(2 * 0.600)  # scaled like the average
    for _ in range(20):
        profile.observe(32, 0.400)  # steady again: the deviation fades
    assert profile.estimate(32, deviations=2) == pytest.approx(0.400, abs=0.001)


def test_arrival_rate_decays_with_time():
    rate = ArrivalRate(tau_s=1.0)
    for i in range(10):
        rate.observe(i * 0.1, 1)
    assert 4 < rate.rate(1.0) < 10
    assert rate.rate(10.0) < 0.01


def test_fixed_waits_only_while_a_batch_runs():
    policy = FixedPolicy(32, 0.005)
    assert policy.plan(view(max_rows=64)) == (32, 10.0)
    assert policy.plan(view(oldest=9.999, running=[(9.9, 8)], max_rows=16)) == (16, pytest.approx(10.004))


def test_baseline_rule_doubles_under_backlog_and_halves_when_quiet():
    policy = BaselinePolicy(0.005)
    for i in range(20):
        policy.observe_arrival(10.0, 1)
    assert policy.plan(view(waiting=150, max_rows=256))[0] == 64
    assert policy.plan(view(waiting=150, max_rows=256))[0] == 128
    assert policy.plan(view(waiting=150, max_rows=256))[0] == 128  # at most 128
    assert policy.plan(view(now=200.0, oldest=200.0, waiting=1, max_rows=256))[0] == 64  # < 0.5/s by then
    assert policy.plan(view(now=200.0, oldest=200.0, waiting=150, max_rows=32))[0] == 32  # the model's cap


def test_adaptive_sends_just_before_the_running_batch_finishes_within_the_target():
    policy = AdaptivePolicy(0.005, {VIP: 0.2, STANDARD: 1.0}, margin_s=0.002)
    assert policy.plan(view(running=[(9.99, 8)])) == (64, pytest.approx(10.0 + 0.005))  # nothing learned: fixed
    policy.observe_batch(64, 0.100)
    policy.observe_batch(8, 0.030)
    assert policy.plan(view()) == (64, 10.0)  # idle model: at once
    size, at = policy.plan(view(running=[(9.99, 8)]))
    assert size == 64 and at == pytest.approx(9.99 + 0.030 - 0.002 - 0.010)
    # A VIP lead that has already waited 150 ms of its 200 ms cannot wait for the model.
    size, at = policy.plan(view(oldest=9.85, level=VIP, running=[(9.99, 64)]))
    assert at == pytest.approx(10.0)


def test_policies_by_name():
    assert make_policy("adaptive", 32, 0.005, {}).name == "adaptive"
    with pytest.raises(ValueError, match="batch policy must be one of"):
        make_policy("magic", 32, 0.005, {})
