"""The batch-size policies, as pure functions of what they observe."""

import pytest

from services.batcher.policy import (
    AdaptivePolicy,
    ArrivalRate,
    BaselinePolicy,
    FixedPolicy,
    QueueView,
    RowCost,
    make_policy,
)
from services.common.latency import LatencyProfile
from services.common.tier import Tier

pytestmark = pytest.mark.unit

VIP, STANDARD = Tier.VIP, Tier.STANDARD


def view(now=10.0, oldest=10.0, level=STANDARD, waiting=1, running=(), max_rows=64, slots=1):
    return QueueView(now, oldest, level, waiting, tuple(running), max_rows, slots)


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
    for _i in range(20):
        policy.observe_arrival(10.0, 1, STANDARD)
    assert policy.plan(view(waiting=150, max_rows=256))[0] == 64
    assert policy.plan(view(waiting=150, max_rows=256))[0] == 128
    assert policy.plan(view(waiting=150, max_rows=256))[0] == 128  # at most 128
    assert policy.plan(view(now=200.0, oldest=200.0, waiting=1, max_rows=256))[0] == 64  # < 0.5/s by then
    assert policy.plan(view(now=200.0, oldest=200.0, waiting=150, max_rows=32))[0] == 32  # the model's cap


def test_row_cost_is_learned_per_row_in_each_size_class():
    cost = RowCost()
    assert cost.seconds(4) is None
    cost.observe(3, 0.030)  # class 4, 10 ms a row
    assert cost.seconds(4) == pytest.approx(0.040)
    assert cost.seconds(32) == pytest.approx(0.320)  # no class 32 yet: the nearest class's cost per row
    cost.observe(32, 0.160)
    assert cost.seconds(32) == pytest.approx(0.160)
    assert cost.seconds(16) == pytest.approx(0.080)  # nearer 32 (5 ms a row) than 4 (10 ms a row)
    assert cost.seconds(8) == pytest.approx(0.080)  # nearer 4


def learned_adaptive(rate_per_s: float, level=STANDARD, max_rows=32) -> AdaptivePolicy:
    """A policy that has seen batches cost 12 ms a row alone, 8 ms in batches
    of 4 and 7.5 ms in batches of 32, and `rate_per_s` rows arriving at `level`
    over the last 10 s."""
    policy = AdaptivePolicy(max_rows, 0.005, {VIP: 0.2, STANDARD: 1.0}, headroom=1.5, tau_s=2.0)
    policy.observe_batch(1, 0.012)
    policy.observe_batch(4, 0.032)
    policy.observe_batch(32, 0.240)
    for i in range(int(10 * rate_per_s)):
        policy.observe_arrival(i / rate_per_s, 1, level)
    return policy


def test_adaptive_sends_full_batches_until_it_has_seen_batches_run():
    policy = AdaptivePolicy(32, 0.005, {VIP: 0.2, STANDARD: 1.0})
    assert policy.plan(view(slots=2)) == (32, 10.0)  # an idle model: at once
    assert policy.plan(view(oldest=9.999, running=[(9.99, 8)], slots=2)) == (32, pytest.approx(10.004))


def test_adaptive_sends_the_smallest_batch_that_keeps_up_with_arrivals():
    # 20 rows a second: one row at a time serves 2 / 0.012 = 167 a second on two slots.
    assert learned_adaptive(20).plan(view(waiting=2, slots=2, max_rows=64)) == (1, 10.0)
    # 150 a second needs 225 with headroom: 4 rows a batch serve 2 * 4 / 0.032 = 250.
    assert learned_adaptive(150).size(view(waiting=6, slots=2)) == 4
    # On one slot, 125 a second: not even 32-row batches keep up, so the least overhead per row.
    assert learned_adaptive(150).size(view(waiting=2, slots=1)) == 32
    # Overload: the configured size, never more than the model's own cap.
    assert learned_adaptive(400).size(view(waiting=2, slots=2, max_rows=16)) == 16
    # Arrivals at one level do not make batches of the other bigger.
    assert learned_adaptive(400, level=VIP).size(view(level=STANDARD, waiting=1, slots=2)) == 1


def test_adaptive_grows_the_batch_to_take_a_backlog_in_one_round():
    # A light rate, but more waiting than one small batch per slot takes: a closed loop
    # of callers at saturation looks like this, and small batches would lower its rate.
    assert learned_adaptive(20).size(view(waiting=3, slots=2)) == 2
    assert learned_adaptive(20).size(view(waiting=3, slots=2, running=[(9.9, 2)])) == 4  # one slot free
    assert learned_adaptive(20).size(view(waiting=20, slots=2)) == 16
    assert learned_adaptive(20).size(view(waiting=100, slots=2)) == 32


def test_adaptive_batches_never_run_longer_than_the_level_target():
    # 32 rows take 240 ms, past VIP's 200 ms target: 16 (120 ms) instead.
    assert learned_adaptive(20, level=VIP).size(view(level=VIP, waiting=60, slots=2)) == 16
    assert learned_adaptive(20, level=VIP, max_rows=24).size(view(level=VIP, waiting=60, slots=2)) == 24  # 180 ms
    assert learned_adaptive(20).size(view(level=STANDARD, waiting=60, slots=2)) == 32  # within 1 s


def test_policies_by_name():
    assert make_policy("adaptive", 32, 0.005, {}).name == "adaptive"
    assert make_policy("adaptive", 32, 0.005, {}).size(view(max_rows=64)) == 32
    with pytest.raises(ValueError, match="batch policy must be one of"):
        make_policy("magic", 32, 0.005, {})
