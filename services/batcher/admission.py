"""Admission: who may wait for a batch, and for how long.

A request is refused at once (RESOURCE_EXHAUSTED, with a retry hint) when its
level is full or when the work ahead of it would not leave it time to be
answered; one still waiting once its batch could no longer run in time is
refused then (give up); one past its deadline expires (DEADLINE_EXCEEDED).
These decisions read what each tier's batches take and how fast they
complete, which Admission learns from every batch sent (sent, ran, ended)."""

import asyncio
import collections
import itertools
import logging
import math
from collections.abc import Callable

from services.batcher import metrics
from services.batcher.config import QueuePolicy
from services.batcher.levels import Levels
from services.batcher.pending import Pending
from services.batcher.slots import SlotPool
from services.common import errors
from services.common.latency import CAUTIOUS_DEVIATIONS, MovingTime
from services.common.tier import Tier

log = logging.getLogger(__name__)
RATE_WINDOW_S = 5.0  # the completions that estimate a queue's service rate: the last few busy seconds' ...
RATE_BATCHES = 8  # ... and of those at most the last few batches, so that the rate follows a change of load


class ServiceRate:
    """Rows one tier's batches complete per second of busy time: time with a
    batch of the tier in flight or a request of its level waiting. Time with
    neither is not counted, as no demand is not slowness. (Counting it, a pause
    in traffic made the model look slow, admission then refused requests, the
    router shed more, traffic paused again: a loop.) Time with requests waiting
    but no batch in flight is counted, as that is how fast a backlog drains:
    where VIP batches share the instances, standard ones run only between
    them, and a rate per second of standard batch time alone overstated it by
    the VIP share, so that admission let requests wait past what their
    deadlines allowed.

    Each batch is recorded with how many batches the tier could run at once
    then (its slots), and the rate is scaled to the slots it has now: when a
    model server stops lending its VIP instance, standard traffic has half
    the instances, and a rate measured on two would let admission fill the
    queue twice too deep until batches on one had replaced it."""

    def __init__(self) -> None:
        self._busy_s = 0.0  # busy time accumulated before the current busy period
        self._busy_since = 0.0
        self._running = 0
        self._waiting = False
        # (busy clock, rows, slots) of recent batches; the oldest only marks where the span starts
        self._completed: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=RATE_BATCHES + 1)

    @property
    def _busy(self) -> bool:
        return self._running > 0 or self._waiting

    def busy_clock(self, now: float) -> float:
        return self._busy_s + (now - self._busy_since if self._busy else 0.0)

    def _change(self, now: float, running: int = 0, waiting: bool | None = None) -> None:
        was_busy = self._busy
        self._running += running
        if waiting is not None:
            self._waiting = waiting
        if self._busy and not was_busy:
            self._busy_since = now
        elif was_busy and not self._busy:
            self._busy_s += now - self._busy_since

    def waiting(self, now: float, any_waiting: bool) -> None:
        """Whether requests of the tier's level wait in the queue from `now` on."""
        self._change(now, waiting=any_waiting)

    def started(self, now: float) -> None:
        self._change(now, running=1)

    def finished(self, now: float, rows: int | None, slots: int = 1) -> None:
        """A batch ended; `rows` it completed, None when it failed, while the
        tier had `slots`."""
        if rows is not None:
            self._completed.append((self.busy_clock(now), rows, slots))
        self._change(now, running=-1)

    def rows_per_second(self, now: float, slots: int = 1) -> float | None:
        """Over the last few batches within the last RATE_WINDOW_S of busy time
        (a rate measured before a surge of load would overstate it), for a tier
        with `slots` now; None until enough batches have finished to tell."""
        clock = self.busy_clock(now)
        while self._completed and clock - self._completed[0][0] > RATE_WINDOW_S:
            self._completed.popleft()
        if len(self._completed) < 3:
            return None
        span = clock - self._completed[0][0]
        if span <= 0:
            return None
        counted = list(itertools.islice(self._completed, 1, None))
        measured_slots = sum(batch_slots for _, _, batch_slots in counted) / len(counted)
        return sum(rows for _, rows, _ in counted) / span * slots / measured_slots


class Admission:
    """The refusals and expiries of one model version's queue, and the
    estimates they rest on, per tier of batch (the model servers run VIP
    batches first, and a VIP pool may run them)."""

    def __init__(self, model: str, policy: QueuePolicy, levels: Levels, slots: SlotPool, batch_size: Callable[[], int]):
        self.model = model
        self._policy = policy
        self._levels = levels
        self._slots = slots
        self._batch_size = batch_size  # () -> rows a batch of the model holds now
        self.batch_seconds = 0.05  # running estimate of one batch's time, for retry hints
        # What each tier's batches take: how long before its deadline a waiting
        # request can no longer be run and answered (cautious_batch_s).
        self.batch_times = {Tier.VIP: MovingTime(), Tier.STANDARD: MovingTime()}
        self.tier_done_at = {Tier.VIP: -math.inf, Tier.STANDARD: -math.inf}  # when each tier's latest batch ended
        # Rows sent and not yet answered, and how fast each tier's batches complete.
        self.inflight_rows = {Tier.VIP: 0, Tier.STANDARD: 0}
        self.service_rates = {Tier.VIP: ServiceRate(), Tier.STANDARD: ServiceRate()}

    def waiting(self, tier: Tier, now: float, any_waiting: bool) -> None:
        """Whether requests of `tier` wait from `now` on (Levels tells): busy time for its service rate."""
        self.service_rates[tier].waiting(now, any_waiting)

    def check_room(self, item: Pending) -> None:
        """Refuses a request its full level has no place for (refuse_if_full)."""
        limit = self._policy.levels[item.tier].max_queue_size
        if self._levels.queued[item.tier] >= limit:
            self.refuse_if_full(item, limit)

    def sent(self, tier: Tier, rows: int, now: float) -> float | None:
        """A batch of `rows` went out at `tier`; returns what such batches take (cautiously)."""
        expected_s = self.cautious_batch_s(tier)
        self.inflight_rows[tier] += rows
        self.service_rates[tier].started(now)
        return expected_s

    def ran(self, tier: Tier, seconds: float) -> None:
        """A batch of `tier` came back with its outputs after `seconds`."""
        self.batch_seconds = 0.8 * self.batch_seconds + 0.2 * seconds
        self.batch_times[tier].observe(seconds)

    def ended(self, tier: Tier, rows: int, completed: int | None, now: float) -> None:
        """A batch of `rows` sent at `tier` ended, having completed `completed` rows (None: it failed)."""
        self.inflight_rows[tier] -= rows
        self.service_rates[tier].finished(now, completed, self.tier_slots(tier))
        self.tier_done_at[tier] = now

    def refuse_if_full(self, item: Pending, limit: int) -> None:
        """A full level refuses a request, unless its tenant holds less than its
        weight's share of the level's places: a tenant that filled the queue
        alone must not lock out the next one. Those go past the bound, up to
        twice it (what the level holds stays bounded)."""
        queued = self._levels.queued[item.tier]
        share, held = self._levels.tenant_share(item, limit)
        if held < share and queued < 2 * limit:
            return
        metrics.REJECTIONS.labels(self.model, item.tier.label, "queue_full").inc()
        # About how long until a place frees up: the batches ahead of it.
        retry_ms = self.drain_retry_ms()
        shared = share < limit  # other tenants wait at this level too
        whose = f"; tenant '{item.tenant}' holds {held} of them, its share is {share:.0f}" if shared else ""
        raise errors.ResourceExhausted(
            f"the {item.tier.label} queue of model '{self.model}' is full ({queued} requests waiting{whose}); "
            f"retry after about {retry_ms} ms",
            retry_after_ms=retry_ms,
        )

    def drain_retry_ms(self) -> int:
        """A retry hint for a refusal for lack of room: about how long until the
        batches waiting ahead have gone."""
        return max(10, int(1000 * self.batch_seconds * len(self._levels) / max(self._batch_size(), 1)))

    def cautious_batch_s(self, tier: Tier) -> float | None:
        """What the tier's batches take, cautiously (CAUTIOUS_DEVIATIONS); None
        until one has finished."""
        return self.batch_times[tier].estimate(CAUTIOUS_DEVIATIONS)

    def tier_slots(self, tier: Tier) -> int:
        """How many batches of the tier may be in flight now: standard batches the
        general slots, VIP batches the reserved ones and the general ones they reach."""
        general, reserved, vip_general = self._slots.sizes()
        return max(1, reserved + vip_general if tier == Tier.VIP else general)

    def admit(self, item: Pending) -> None:
        """Deadline-aware admission: a request that would wait in the queue past
        its deadline is refused now, in microseconds, instead of timing out
        later having held a place; "past" with a margin (admission_share), as
        the rate is an average and a loaded machine's batches vary severalfold,
        and never so late that the request would still be waiting when too
        little time is left for its batch (give_up would refuse it then, after
        the wait). Only with a real backlog and a measured rate."""
        if item.deadline is None:
            return
        ahead = self._levels.rows_above(item.tier)
        ahead += self._levels.rows_before(item)
        # A standard request also waits for the batches already at the model
        # servers (execution is not preemptive); a VIP one goes ahead of them there.
        ahead += item.rows + (self.inflight_rows[Tier.STANDARD] if item.tier < Tier.VIP else 0)
        if ahead <= self._batch_size():
            return
        rate = self.service_rates[item.tier].rows_per_second(item.enqueued, self.tier_slots(item.tier))
        if rate is None:
            return
        wait_s = ahead / rate
        left_s = item.deadline - item.enqueued
        allowed_s = self._policy.admission_share * left_s
        limit = f"{self._policy.admission_share:.0%} of the {1000 * left_s:.0f} ms left before this request's deadline"
        run_s = self.cautious_batch_s(item.tier)
        if run_s is not None and left_s - run_s - errors.REFUSAL_MARGIN_S < allowed_s:
            allowed_s = left_s - run_s - errors.REFUSAL_MARGIN_S
            limit = (
                f"the {1000 * max(allowed_s, 0.0):.0f} ms that its deadline, {1000 * left_s:.0f} ms away, "
                f"leaves after its own batch (about {1000 * run_s:.0f} ms)"
            )
        if wait_s > allowed_s:
            metrics.REJECTIONS.labels(self.model, item.tier.label, "would_miss_deadline").inc()
            retry_ms = max(10, int(1000 * (wait_s - allowed_s)))
            raise errors.ResourceExhausted(
                f"model '{self.model}' has {ahead} rows to finish up to this request at the {item.tier.label} tier or "
                f"above (queued, running, its own), about {1000 * wait_s:.0f} ms of work, more than {limit}; "
                f"retry after about {retry_ms} ms",
                retry_after_ms=retry_ms,
            )

    def give_up_at(self, item: Pending) -> float:
        """When a request still waiting is refused (give_up): its deadline less
        what its tier's batches take (cautiously) and the refusal's margin."""
        assert item.deadline is not None  # only a request with a deadline gives up
        run_s = self.cautious_batch_s(item.tier)
        return item.deadline - (run_s + errors.REFUSAL_MARGIN_S if run_s is not None else 0.0)

    def give_up(self, item: Pending) -> None:
        """A request still waiting when a batch could no longer run and answer it
        in time is refused, RESOURCE_EXHAUSTED like any refusal for lack of
        room, rather than left to time out; past its deadline, it expires.
        On an idle model a request with less time than the estimate is taken
        before this runs (its arrival wakes the batching task, whose step
        takes it, ahead of a timer already due), so a stale estimate after a
        surge cannot refuse tight deadlines for good."""
        if item.future.done():
            return
        assert item.deadline is not None  # only a request with a deadline gives up
        now = asyncio.get_running_loop().time()
        run_s = self.cautious_batch_s(item.tier)
        if run_s is None or now >= item.deadline:
            self.expire(item)
            return
        metrics.REJECTIONS.labels(self.model, item.tier.label, "no_time_left").inc()
        retry_ms = self.drain_retry_ms()
        item.future.set_exception(
            errors.ResourceExhausted(
                f"request for model '{self.model}' waited {1000 * (now - item.enqueued):.0f} ms in the {item.tier.label} queue and "
                f"has {1000 * (item.deadline - now):.0f} ms left, less than its batch would take (about "
                f"{1000 * run_s:.0f} ms); it was not run; retry after about {retry_ms} ms",
                retry_after_ms=retry_ms,
            )
        )

    def live(self, item: Pending, now: float) -> bool:
        """Whether a queued request may still run: one past its deadline is
        answered now (expire); one answered already, or whose caller went
        away, is not."""
        if item.deadline is not None and now >= item.deadline:
            self.expire(item)
        if item.future.done():
            self._levels.leave(item)  # at once, not when its done callback comes round
            if item.future.cancelled():
                metrics.REJECTIONS.labels(self.model, item.tier.label, "cancelled").inc()
            return False
        return True

    def sendable(self, item: Pending) -> bool:
        """Whether a request taken into a batch still goes to the model: still
        live (live: the batch's gathering may outlast a deadline tighter than
        it, or its caller may have gone) and not out of time (out_of_time)."""
        return self.live(item, asyncio.get_running_loop().time()) and not self.out_of_time(item)

    def out_of_time(self, item: Pending) -> bool:
        """Whether a request about to be sent is refused instead (give_up): it
        waited while its tier's batches ran, and has less time left than they
        take now. Its give_up timer was set by the estimate when it arrived,
        which a slow batch since may have raised; sent, it would time out. A
        request that arrived after its tier's latest batch ended goes however
        tight its deadline: the estimate may be stale then (see give_up)."""
        if item.deadline is None or item.enqueued >= self.tier_done_at[item.tier]:
            return False
        if asyncio.get_running_loop().time() < self.give_up_at(item):
            return False
        self.give_up(item)
        return True

    def expire(self, item: Pending) -> None:
        """Answers a request whose deadline passed while it waited; it stays in
        the queue until the batching task skips it, but never runs."""
        if item.future.done():
            return
        metrics.REJECTIONS.labels(self.model, item.tier.label, "deadline").inc()
        waited_ms = 1000 * (asyncio.get_running_loop().time() - item.enqueued)
        item.future.set_exception(
            errors.DeadlineExceeded(
                f"request for model '{self.model}' waited {waited_ms:.1f} ms in the queue, past its deadline; it was not run"
            )
        )

    def ran_out_of_time(
        self, batch: list[Pending], tier: Tier, sent_at: float, timeout_s: float, expected_s: float | None
    ) -> None:
        """A batch sent in time that timed out all the same: the estimates that
        let its requests wait (admission, give_up) were short of what this
        batch met. Rare by design, so each one is logged with the numbers."""
        metrics.BATCH_TIMEOUTS.labels(self.model, tier.label).inc()
        took_s = asyncio.get_running_loop().time() - sent_at
        waited_s = sent_at - min(item.enqueued for item in batch)
        log.warning(
            "batch of %d rows for model %s (%s) ran out of its %.0f ms after %.0f ms at the model server, "
            "its requests having waited up to %.0f ms here; the tier's batches take about %s",
            sum(item.rows for item in batch),
            self.model,
            tier.label,
            1000 * timeout_s,
            1000 * took_s,
            1000 * waited_s,
            "(no estimate yet)" if expected_s is None else f"{1000 * expected_s:.0f} ms",
        )
