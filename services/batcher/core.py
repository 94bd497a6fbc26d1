"""Dynamic batching: per-model queues, a level per tier, drained into batches.

Tiers are served in strict priority, non-preemptive, FIFO within a level, with an
aging bound for standard requests; each level has its own queue bound and
default timeout (Triton's queue policy).

Each (model, version) has one queue and one lazily started task. The task
waits for a request, then for a free execution slot (so an idle queue holds
none), then until the batch is full or the oldest request has waited
max_queue_delay_ms (no wait at all while none of its batches is running:
waiting would only leave the model idle), takes what fits and sends it to the
backend as one batch. A request larger than the batch size runs alone, up to
the model's own limit. A batch holds one shape: requests whose dimensions
past the batch one differ never share one (a request of another shape ends
the batch being formed, and leads the next). Length-aware batching fills a batch with requests of
similar text length, so that padding stays small. Every request's future is
always resolved: with its outputs or with a domain error.
"""

import asyncio
import collections
import dataclasses
import functools
import itertools
import logging
import math
from collections.abc import Callable
from typing import Protocol

from services.batcher import metrics
from services.batcher.fair import FairLevel
from services.batcher.policy import FixedPolicy, Policy, QueueView, make_policy
from services.common import errors
from services.common.identity import MAX_WEIGHT, MIN_WEIGHT
from services.common.latency import CAUTIOUS_DEVIATIONS, MovingTime
from services.common.tier import TIERS, Tier
from services.common.tensors import TensorData, check_tensor_size, concat_rows, split_rows

log = logging.getLogger(__name__)

LENGTH_WINDOW = 128  # how far into a level length-aware batching looks for a similar request
RATE_WINDOW_S = 5.0  # the completions that estimate a queue's service rate: the last few busy seconds' ...
RATE_BATCHES = 8  # ... and of those at most the last few batches, so that the rate follows a change of load

MAX_TENANT_CHARS = 256  # of a tenant's name: it is held while the tenant's requests wait



@dataclasses.dataclass(frozen=True)
class LevelPolicy:
    """Triton's queue policy, per queue level (one per tier): how many may wait, and the
    longest a request may wait when it brings no tighter deadline."""

    max_queue_size: int
    default_timeout_s: float


@dataclasses.dataclass(frozen=True)
class QueuePolicy:
    levels: dict[Tier, LevelPolicy]  # the queue level of each tier
    # Once a standard request has waited this long, VIP-led batches alternate
    # with standard-led ones: a steady VIP stream cannot starve standard traffic.
    aging_s: float = 1.0
    # Deadline-aware admission lets the work ahead of a request fill at most
    # this share of its time left; the rest absorbs the error of a rate
    # measured on a busy machine, so that what is admitted is served.
    admission_share: float = 0.5

    @classmethod
    def uniform(cls, max_queue_size: int, default_timeout_s: float, aging_s: float = 1.0,
                admission_share: float = 0.5) -> "QueuePolicy":
        return cls({tier: LevelPolicy(max_queue_size, default_timeout_s) for tier in TIERS}, aging_s,
                   admission_share)


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """What the batcher must know of a model to batch it."""

    max_batch_size: int
    inputs: tuple[str, ...]
    # The versions some ready replica holds; empty: the backend does not say, any may be asked for.
    versions: frozenset[str] = frozenset()


class SlotPool:
    """The right to send one model's batch: `general` slots for any batch, plus
    `reserved` ones that only VIP work may take, so that VIP work is never held
    back by standard batches merely for the right to be sent. How many there
    are is the backend's to say (Backend.slots), and changes: a model server
    lends its VIP-only instances to standard batches while no VIP work comes."""

    def __init__(self, sizes: Callable[[], tuple[int, int, int]]):
        self.sizes = sizes  # () -> (general, reserved, general ones VIP work reaches) now
        self.taken = {"general": 0, "reserved": 0}
        self._changed = asyncio.Event()

    async def acquire(self, has_vip: Callable[[], bool],
                      has_standard: Callable[[], bool]) -> tuple[str, tuple[Tier, ...]]:
        """A slot, and the tiers whose requests its batch may carry. A reserved
        slot while VIP requests wait and one is free (it carries a VIP-led
        batch), else a general one. A general slot carries VIP requests only
        where VIP batches can reach the replicas it counts (or VIP work has no
        slots of its own): under a VIP-pool route a VIP batch on the standard
        pool's slot would wait for its own pool while holding the slot, and the
        standard replica would idle. With no general slots at all (no ready
        replica, or none that standard work may reach) a general one at once,
        unless VIP work waits for a reserved one: the backend then answers
        UNAVAILABLE, on which the router falls back or fails fast, rather than
        the requests waiting out their deadlines here."""
        while True:
            general, reserved, vip_general = self.sizes()
            vip_waits = has_vip() and reserved > 0
            if vip_waits and self.taken["reserved"] < reserved:
                self.taken["reserved"] += 1
                return "reserved", (Tier.VIP,)
            tiers = TIERS if vip_general > 0 or reserved == 0 or general == 0 else (Tier.STANDARD,)
            if ((self.taken["general"] < general or (general == 0 and not vip_waits))
                    and (Tier.VIP in tiers or has_standard())):
                self.taken["general"] += 1
                return "general", tiers
            self._changed.clear()
            await self._changed.wait()

    def release(self, kind: str) -> None:
        self.taken[kind] -= 1
        self._changed.set()

    def poke(self) -> None:
        """Something waiters decide on changed (a VIP request arrived)."""
        self._changed.set()


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

    def __init__(self):
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


class Backend(Protocol):
    """Where batches run: the model_server replicas."""

    def limits(self, model: str) -> ModelLimits | None:
        """None when no ready replica serves the model."""

    def slots(self, model: str) -> tuple[int, int, int]:
        """How many batches of the model may be in flight at once across
        replicas now: (of any tier, more for VIP work only, of the first how
        many VIP batches can reach)."""

    def on_change(self, listener: Callable[[], None]) -> None:
        """Calls `listener` whenever `slots` may have grown."""

    async def execute(
        self, model: str, version: str, inputs: list[TensorData], outputs: list[str], timeout_s: float,
        tier: Tier = Tier.STANDARD,
    ) -> tuple[str, list[TensorData]]: ...


@dataclasses.dataclass(eq=False)
class Pending:
    """One request waiting in a queue."""

    inputs: list[TensorData]
    outputs: list[str]
    tier: Tier
    deadline: float | None  # loop time
    future: asyncio.Future
    enqueued: float
    timer: asyncio.TimerHandle | None = None
    length: float = 0.0  # bytes per row of its BYTES inputs: a cheap proxy for token count
    queued: bool = False  # holds a place in its level: counted in the queue's length and rows
    tenant: str = ""  # whose request (the router's verified tenant): tenants share a level by weight
    weight: float = 1.0
    tag: float = 0.0  # its start tag in its level's fair queueing (FairLevel)
    seq: int = 0  # its arrival there
    shape: tuple = ()  # (name, dimensions past the batch one) per input: only requests alike share a batch
    rows: int = dataclasses.field(init=False)

    def __post_init__(self):
        self.rows = self.inputs[0].rows

    def answered(self, _future=None) -> None:
        """Drops the request's tensors: answered while it waits (expired, refused,
        cancelled), it may stay in its level's deque until the batching task
        passes it, and must not hold its bytes there meanwhile."""
        self.inputs = []

    def taken(self) -> None:
        """From here on the batch's own timeout governs, not the queue's deadline timer."""
        if self.timer is not None:
            self.timer.cancel()


class ModelQueue:
    """The queue and batching task of one model version."""

    def __init__(self, model: str, version: str, backend: Backend, max_batch_size: int,
                 max_delay_s: float, policy: QueuePolicy, slots: SlotPool, default_timeout_s: float,
                 length_aware: bool = True, batch_policy: Policy | None = None):
        self.model = model
        self.version = version
        self._backend = backend
        self._configured_batch_size = max_batch_size
        self._policy = policy
        self._slots = slots
        self._default_timeout_s = default_timeout_s
        self._batch_seconds = 0.05  # running estimate of one batch's time, for retry hints
        # Per tier of batch, what its batches take: how long before its deadline a waiting
        # request can no longer be run and answered (_cautious_batch_s).
        self._batch_times = {Tier.VIP: MovingTime(), Tier.STANDARD: MovingTime()}
        self._tier_done_at = {Tier.VIP: -math.inf, Tier.STANDARD: -math.inf}  # when each tier's latest batch ended
        # Per tier of batch (the model servers run VIP batches first, and a VIP pool
        # may run them): rows sent and not yet answered, and how fast its batches complete.
        self._inflight_rows = {Tier.VIP: 0, Tier.STANDARD: 0}
        self._service_rates = {Tier.VIP: ServiceRate(), Tier.STANDARD: ServiceRate()}
        self._length_aware = length_aware
        self._last_led_tier = Tier.STANDARD  # of the request that led the last batch
        self.batch_policy = batch_policy if batch_policy is not None else FixedPolicy(max_batch_size, max_delay_s)
        self._running: dict[asyncio.Task, tuple[float, int, Tier]] = {}  # batches in flight: (start, rows, tier)
        # Within a level, tenants share by weight (FairLevel); one tenant's requests go FIFO.
        self._levels = {Tier.VIP: FairLevel(), Tier.STANDARD: FairLevel()}
        # Kept with the levels for the requests still waiting there (a request answered while
        # queued, expired or cancelled, leaves its deque only when the batching task passes it,
        # but stops counting at once): admission, planning, the bound and the gauge read them.
        self._queued_rows = {Tier.VIP: 0, Tier.STANDARD: 0}
        self._queued = {Tier.VIP: 0, Tier.STANDARD: 0}
        # Per (level, tenant) with requests waiting: [requests, rows, weight]; and per level
        # the sum of those tenants' weights. Only waiting requests have entries.
        self._tenant_load: dict[tuple[int, str], list] = {}
        self._level_weight = {Tier.VIP: 0.0, Tier.STANDARD: 0.0}
        self._forming: list[Pending] = []  # the batch _collect is filling: taken from the levels, not yet sent
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._batches: set[asyncio.Task] = set()

    @property
    def batch_size(self) -> int:
        limits = self._backend.limits(self.model)
        return min(self._configured_batch_size, limits.max_batch_size) if limits else self._configured_batch_size

    def __len__(self) -> int:
        """Requests waiting to be run (not those answered while they waited)."""
        return sum(self._queued.values())

    def put(self, item: Pending) -> None:
        level = self._levels[item.tier]
        limit = self._policy.levels[item.tier].max_queue_size
        if self._queued[item.tier] >= limit:
            self._refuse_if_full(item, limit)
        self._admit(item)
        level.append(item)
        item.queued = True
        item.future.add_done_callback(lambda _: self._leave(item))  # answered while it waits: a place frees
        self._count_queued(item, 1, item.enqueued)
        self.batch_policy.observe_arrival(item.enqueued, item.rows, item.tier)
        if item.tier == Tier.VIP or self._queued[item.tier] == 1:
            # A VIP request may take a reserved slot; the first standard one a slot VIP work cannot use.
            self._slots.poke()
        self._arrived.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"batcher-{self.model}-{self.version}")

    def _refuse_if_full(self, item: Pending, limit: int) -> None:
        """A full level refuses a request, unless its tenant holds less than its
        weight's share of the level's places: a tenant that filled the queue
        alone must not lock out the next one. Those go past the bound, up to
        twice it (what the level holds stays bounded)."""
        queued = self._queued[item.tier]
        share, held = self._tenant_share(item, limit)
        if held < share and queued < 2 * limit:
            return
        metrics.REJECTIONS.labels(self.model, item.tier.label, "queue_full").inc()
        # About how long until a place frees up: the batches ahead of it.
        retry_ms = self._drain_retry_ms()
        shared = share < limit  # other tenants wait at this level too
        whose = f"; tenant '{item.tenant}' holds {held} of them, its share is {share:.0f}" if shared else ""
        raise errors.ResourceExhausted(
            f"the {item.tier.label} queue of model '{self.model}' is full ({queued} requests waiting{whose}); "
            f"retry after about {retry_ms} ms", retry_after_ms=retry_ms)

    def _tenant_share(self, item: Pending, places: float) -> tuple[float, int]:
        """The tenant's share of `places` among the tenants waiting at its level
        (itself counted), and how many requests it has waiting there."""
        load = self._tenant_load.get((item.tier, item.tenant))
        weights = self._level_weight[item.tier] + (0.0 if load else item.weight)
        return places * item.weight / weights, (load[0] if load else 0)

    def _count_queued(self, item: Pending, requests: int, now: float) -> None:
        tier, rows = item.tier, requests * item.rows
        self._queued[tier] += requests
        self._queued_rows[tier] += rows
        key = (tier, item.tenant)
        load = self._tenant_load.get(key)
        if load is None:
            load = self._tenant_load[key] = [0, 0, item.weight]
            self._level_weight[tier] += item.weight
        load[0] += requests
        load[1] += rows
        if load[0] <= 0:
            del self._tenant_load[key]
            self._level_weight[tier] = max(0.0, self._level_weight[tier] - load[2])
        self._service_rates[tier].waiting(now, self._queued_rows[tier] > 0)
        metrics.QUEUE_LENGTH.labels(self.model, tier.label).set(self._queued[tier])

    def _leave(self, item: Pending) -> None:
        """The request no longer holds a place in its level: taken into a batch,
        or answered while it waited (its deque entry goes when passed over)."""
        if item.queued:
            item.queued = False
            self._count_queued(item, -1, asyncio.get_running_loop().time())

    def _drain_retry_ms(self) -> int:
        """A retry hint for a refusal for lack of room: about how long until the
        batches waiting ahead have gone."""
        return max(10, int(1000 * self._batch_seconds * len(self) / max(self.batch_size, 1)))

    def _cautious_batch_s(self, tier: Tier) -> float | None:
        """What the tier's batches take, cautiously (CAUTIOUS_DEVIATIONS); None
        until one has finished."""
        return self._batch_times[tier].estimate(CAUTIOUS_DEVIATIONS)

    def _tier_slots(self, tier: Tier) -> int:
        """How many batches of the tier may be in flight now: standard batches the
        general slots, VIP batches the reserved ones and the general ones they reach."""
        general, reserved, vip_general = self._slots.sizes()
        return max(1, reserved + vip_general if tier == Tier.VIP else general)

    def _admit(self, item: Pending) -> None:
        """Deadline-aware admission: a request that would wait in the queue past
        its deadline is refused now, in microseconds, instead of timing out
        later having held a place; "past" with a margin (admission_share), as
        the rate is an average and a loaded machine's batches vary severalfold,
        and never so late that the request would still be waiting when too
        little time is left for its batch (give_up would refuse it then, after
        the wait). Only with a real backlog and a measured rate."""
        if item.deadline is None:
            return
        ahead = sum(rows for tier, rows in self._queued_rows.items() if tier > item.tier)
        ahead += self._rows_before(item)
        # A standard request also waits for the batches already at the model
        # servers (execution is not preemptive); a VIP one goes ahead of them there.
        ahead += item.rows + (self._inflight_rows[Tier.STANDARD] if item.tier < Tier.VIP else 0)
        if ahead <= self.batch_size:
            return
        rate = self._service_rates[item.tier].rows_per_second(item.enqueued, self._tier_slots(item.tier))
        if rate is None:
            return
        wait_s = ahead / rate
        left_s = item.deadline - item.enqueued
        allowed_s = self._policy.admission_share * left_s
        limit = f"{self._policy.admission_share:.0%} of the {1000 * left_s:.0f} ms left before this request's deadline"
        run_s = self._cautious_batch_s(item.tier)
        if run_s is not None and left_s - run_s - errors.REFUSAL_MARGIN_S < allowed_s:
            allowed_s = left_s - run_s - errors.REFUSAL_MARGIN_S
            limit = (f"the {1000 * max(allowed_s, 0.0):.0f} ms that its deadline, {1000 * left_s:.0f} ms away, "
                     f"leaves after its own batch (about {1000 * run_s:.0f} ms)")
        if wait_s > allowed_s:
            metrics.REJECTIONS.labels(self.model, item.tier.label, "would_miss_deadline").inc()
            retry_ms = max(10, int(1000 * (wait_s - allowed_s)))
            raise errors.ResourceExhausted(
                f"model '{self.model}' has {ahead} rows to finish up to this request at the {item.tier.label} tier or "
                f"above (queued, running, its own), about {1000 * wait_s:.0f} ms of work, more than {limit}; "
                f"retry after about {retry_ms} ms", retry_after_ms=retry_ms)

    def _rows_before(self, item: Pending) -> int:
        """About the rows of its own level served before a new request is: all
        that wait there, or, where other tenants wait too, as many as fair
        queueing serves of theirs while this tenant's backlog and the request
        go (its rows at the level's total weight over its own)."""
        waiting = self._queued_rows[item.tier]
        load = self._tenant_load.get((item.tier, item.tenant))
        mine = load[1] if load else 0
        if mine == waiting:
            return waiting
        weights = self._level_weight[item.tier] + (0.0 if load else item.weight)
        return min(waiting, int((mine + item.rows) * weights / item.weight) - item.rows)

    async def _run(self) -> None:
        while True:
            while not len(self):
                self._arrived.clear()
                await self._arrived.wait()
            slot, tiers = await self._slots.acquire(lambda: bool(self._queued[Tier.VIP]),
                                                     lambda: bool(self._queued[Tier.STANDARD]))
            try:
                # A slot reserved for VIP work carries a VIP-led batch, even when aged
                # standard requests are due a turn: theirs comes with a general slot.
                batch = await self._collect(tiers)
            except BaseException:
                self._slots.release(slot)
                # Taken from the queue and not yet sent: no one else would answer them.
                _fail_all(self._forming, errors.Unavailable(
                    f"batcher is shutting down; model '{self.model}' request not run"))
                raise
            if not batch:  # everything waiting had expired or been cancelled
                self._slots.release(slot)
                continue
            task = asyncio.create_task(self._execute(batch, slot))
            self._batches.add(task)
            self._running[task] = (asyncio.get_running_loop().time(), sum(item.rows for item in batch),
                                   max(item.tier for item in batch))
            task.add_done_callback(self._batch_done)
            abandoned = functools.partial(_stop_if_abandoned, task, [item.future for item in batch])
            for item in batch:
                item.future.add_done_callback(abandoned)

    def _batch_done(self, task: asyncio.Task) -> None:
        self._batches.discard(task)
        self._running.pop(task, None)

    def _take(self, room: int, alone: bool, near_length: float | None = None,
              tiers: tuple[Tier, ...] = TIERS, shape: tuple = ()) -> Pending | None:
        """The next live request of `tiers` that fits in `room` rows and has
        the batch's `shape` (any size and shape when `alone`): a batch's lead by
        strict priority, the rest from `tiers` in the order given; FIFO within
        a level (a head that does not fit or is of another shape is not passed
        over: it leads the next batch); expired and cancelled requests are
        answered and dropped on the way. Given `near_length` (length-aware
        batching), it is the request of the most similar length among the
        first few that fit, so that short texts are not padded to long ones."""
        now = asyncio.get_running_loop().time()
        order = (Tier.VIP, Tier.STANDARD) if alone else tiers
        standard = self._levels[Tier.STANDARD]
        while standard and not self._live(standard[0], now):  # the aging bound reads the oldest still waiting
            standard.popleft()
        if (alone and self._last_led_tier == Tier.VIP and standard
                and now - standard[0].enqueued >= self._policy.aging_s):
            # Starvation bound: while VIP batches follow each other, a standard
            # request that has aged gets every other batch. Standard traffic
            # that merely waits behind its own backlog is not promoted, so a
            # standard overload never pushes VIP requests back.
            order = (Tier.STANDARD, Tier.VIP)
        for tier in (tier for tier in order if tier in tiers):
            queue = self._levels[tier]
            while queue:
                item = queue[0]
                if not self._live(item, now):
                    queue.popleft()
                    continue
                if not alone and (item.rows > room or item.shape != shape):
                    break
                if near_length is None or len(queue) == 1:
                    queue.popleft()
                else:
                    item = self._closest(queue, room, near_length, now, shape)
                    queue.remove(item)
                self._leave(item)
                if alone:
                    self._last_led_tier = tier
                item.taken()
                return item
        return None

    def _live(self, item: Pending, now: float) -> bool:
        """Whether a queued request may still run: one past its deadline is
        answered now (expire); one answered already, or whose caller went
        away, is not."""
        if item.deadline is not None and now >= item.deadline:
            self.expire(item)
        if item.future.done():
            self._leave(item)  # at once, not when its done callback comes round
            if item.future.cancelled():
                metrics.REJECTIONS.labels(self.model, item.tier.label, "cancelled").inc()
            return False
        return True

    def _closest(self, queue: FairLevel, room: int, length: float, now: float, shape: tuple) -> Pending:
        """Among the first LENGTH_WINDOW live requests that fit and have `shape`,
        the one nearest `length`; ties go to the older. The head fits, so there
        is always one."""
        best, best_gap = queue[0], abs(queue[0].length - length)
        for item in itertools.islice(queue, 1, LENGTH_WINDOW):
            if (item.rows > room or item.shape != shape or item.future.done()
                    or (item.deadline is not None and now >= item.deadline)):
                continue
            gap = abs(item.length - length)
            if gap < best_gap:
                best, best_gap = item, gap
        return best

    def give_up_at(self, item: Pending) -> float:
        """When a request still waiting is refused (give_up): its deadline less
        what its tier's batches take (cautiously) and the refusal's margin."""
        run_s = self._cautious_batch_s(item.tier)
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
        now = asyncio.get_running_loop().time()
        run_s = self._cautious_batch_s(item.tier)
        if run_s is None or now >= item.deadline:
            self.expire(item)
            return
        metrics.REJECTIONS.labels(self.model, item.tier.label, "no_time_left").inc()
        retry_ms = self._drain_retry_ms()
        item.future.set_exception(errors.ResourceExhausted(
            f"request for model '{self.model}' waited {1000 * (now - item.enqueued):.0f} ms in the {item.tier.label} queue and "
            f"has {1000 * (item.deadline - now):.0f} ms left, less than its batch would take (about "
            f"{1000 * run_s:.0f} ms); it was not run; retry after about {retry_ms} ms", retry_after_ms=retry_ms))

    def _sendable(self, item: Pending) -> bool:
        """Whether a request taken into a batch still goes to the model: still
        live (_live: the batch's gathering may outlast a deadline tighter than
        it, or its caller may have gone) and not out of time (_out_of_time)."""
        return self._live(item, asyncio.get_running_loop().time()) and not self._out_of_time(item)

    def _out_of_time(self, item: Pending) -> bool:
        """Whether a request about to be sent is refused instead (give_up): it
        waited while its tier's batches ran, and has less time left than they
        take now. Its give_up timer was set by the estimate when it arrived,
        which a slow batch since may have raised; sent, it would time out. A
        request that arrived after its tier's latest batch ended goes however
        tight its deadline: the estimate may be stale then (see give_up)."""
        if item.deadline is None or item.enqueued >= self._tier_done_at[item.tier]:
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
        item.future.set_exception(errors.DeadlineExceeded(
            f"request for model '{self.model}' waited {waited_ms:.1f} ms in the queue, past its deadline; it was not run"))

    async def _collect(self, tiers: tuple[Tier, ...] = TIERS) -> list[Pending]:
        """A batch of requests from `tiers` (see SlotPool.acquire)."""
        loop = asyncio.get_running_loop()
        batch = self._forming = []
        rows = 0
        size, dispatch_by = self.batch_size, loop.time()
        while True:
            near = batch[0].length if batch and self._length_aware else None
            allowed = self._fill_tiers(batch[0].tier, tiers) if batch else tiers
            item = self._take(size - rows, alone=not batch, near_length=near, tiers=allowed,
                              shape=batch[0].shape if batch else ())
            if item is not None:
                if not batch:
                    size, dispatch_by = self._plan(item)
                batch.append(item)
                rows += item.rows
                if rows >= size:
                    break
                continue
            if not batch or any(self._queued[tier] for tier in allowed):
                break  # nothing waiting, or the next request does not fit or is of another shape
            if self._queued[Tier.VIP] and Tier.VIP not in allowed:
                break  # a VIP request this batch will not carry: the batching task is its way out
            remaining = dispatch_by - loop.time()
            if remaining <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                break
        self._forming = []
        return batch

    def _fill_tiers(self, tier: Tier, tiers: tuple[Tier, ...]) -> tuple[Tier, ...]:
        """Which tiers fill a batch after its lead, in order.
        - A VIP-led batch carries VIP requests only: filled up with standard
          ones it would run as long as any standard batch, and VIP latency
          under a standard overload would be a full batch's time.
        - A standard-led batch takes standard requests first: when its lead
          was promoted by the aging bound, VIP rows first would leave the turn
          that bound gives standard traffic one row.
        - It takes VIP requests only where VIP work has no slots of its own:
          one that arrives while the batch gathers company would wait out the
          gathering and then a standard batch's run, its reserved instance
          idle. The batch leaves then instead (_collect), and the VIP request
          takes its slot."""
        if tier == Tier.VIP:
            return (Tier.VIP,)
        _, reserved, _ = self._slots.sizes()
        return (Tier.STANDARD, Tier.VIP) if Tier.VIP in tiers and reserved == 0 else (Tier.STANDARD,)

    def _plan(self, lead: Pending) -> tuple[int, float]:
        limits = self._backend.limits(self.model)
        view = QueueView(
            now=asyncio.get_running_loop().time(), oldest_enqueued=lead.enqueued, tier=lead.tier,
            # What the lead's batch and those after it drain: its level and those above.
            waiting_rows=lead.rows + sum(rows for tier, rows in self._queued_rows.items() if tier >= lead.tier),
            # A VIP batch waits for company only behind VIP batches: standard ones do not
            # hold its instance, and at VIP rates the wait would only add to its latency.
            running=tuple((start, rows) for start, rows, tier in self._running.values()
                          if lead.tier == Tier.STANDARD or tier == Tier.VIP),
            max_rows=limits.max_batch_size if limits else self._configured_batch_size,
            slots=self._tier_slots(lead.tier))
        size, dispatch_by = self.batch_policy.plan(view)
        metrics.TARGET_ROWS.labels(self.model).set(size)
        return max(size, 1), dispatch_by

    async def _execute(self, batch: list[Pending], slot: str) -> None:
        try:
            live = [item for item in batch if self._sendable(item)]
            if live:
                await self._run_batch(live)
        except Exception as exc:  # noqa: BLE001 - resolved below, never lost
            log.exception("batch of model %s failed unexpectedly", self.model)
            _fail_all(batch, errors.Internal(f"batch of model '{self.model}' failed: {type(exc).__name__}"))
        except asyncio.CancelledError:  # close(): the batcher is shutting down
            _fail_all(batch, errors.Unavailable(f"batcher is shutting down; model '{self.model}' batch not finished"))
            raise
        finally:
            self._slots.release(slot)
            _fail_all(batch, errors.Internal("request was not answered"))

    async def _run_batch(self, batch: list[Pending], rerun: bool = False) -> None:
        """Sends one batch and answers its requests. A `rerun` is one request of
        a failed batch run alone: its queue wait was observed with the batch,
        and it is not split again."""
        if rerun and batch[0].future.done():  # answered (its caller gone) before its turn: its tensors are dropped
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        # A batch runs by its latest request's deadline: by its earliest, a VIP request with time to
        # spare would be refused with the tight standard ones an aged standard batch may lead.
        deadlines = [item.deadline for item in batch if item.deadline is not None]
        timeout_s = max(deadlines) - now if len(deadlines) == len(batch) else self._default_timeout_s
        names = [t.name for t in batch[0].inputs]  # submit() checked that every request has exactly these
        inputs = [concat_rows([next(t for t in item.inputs if t.name == name) for item in batch]) for name in names]
        counts = [item.rows for item in batch]
        # One execution serves every request: ask for the union of what they want ([] means all).
        wanted = [] if any(not item.outputs for item in batch) else sorted({o for item in batch for o in item.outputs})
        metrics.BATCH_ROWS.labels(self.model).observe(sum(counts))
        for item in () if rerun else batch:
            metrics.QUEUE_WAIT.labels(self.model, item.tier.label).observe(now - item.enqueued)
        tier = max(item.tier for item in batch)  # the batch's tier: the model server runs VIP batches first
        expected_s = self._cautious_batch_s(tier)
        self._inflight_rows[tier] += sum(counts)
        self._service_rates[tier].started(now)
        completed, split = None, False
        try:
            version, outputs = await self._backend.execute(self.model, self.version, inputs, wanted, max(timeout_s, 0.001),
                                                           tier=tier)
            self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * (loop.time() - now)
            self._batch_times[tier].observe(loop.time() - now)
            self.batch_policy.observe_batch(sum(counts), loop.time() - now)
            completed = sum(counts)
        except errors.InfermeshError as exc:
            if not rerun and len(batch) > 1 and not exc.retryable and not _no_time_or_room(exc):
                # One bad request must not fail its neighbours: run each alone (below, once
                # this batch is off the books). Not when the model server is out of time or
                # room: one RPC per request would only add load.
                log.warning("batch of %d for model %s failed (%s); retrying one by one", len(batch), self.model, exc.message)
                split = True
            else:
                if isinstance(exc, errors.DeadlineExceeded):
                    self._ran_out_of_time(batch, tier, now, timeout_s, expected_s)
                _fail_all(batch, exc)
                return
        finally:
            self._inflight_rows[tier] -= sum(counts)
            self._service_rates[tier].finished(loop.time(), completed, self._tier_slots(tier))
            self._tier_done_at[tier] = loop.time()
        if split:
            # Each request that can still be answered: its caller has not gone, its deadline has not passed.
            alone = [item for item in batch if self._sendable(item)]
            await asyncio.gather(*(self._run_batch([item], rerun=True) for item in alone))
            return
        parts = {out.name: split_rows(out, counts) for out in outputs}
        for i, item in enumerate(batch):
            if not item.future.done():
                names = item.outputs or list(parts)
                item.future.set_result((version, [parts[name][i] for name in names]))

    def _ran_out_of_time(self, batch: list[Pending], tier: Tier, sent_at: float, timeout_s: float,
                         expected_s: float | None) -> None:
        """A batch sent in time that timed out all the same: the estimates that
        let its requests wait (admission, give_up) were short of what this
        batch met. Rare by design, so each one is logged with the numbers."""
        metrics.BATCH_TIMEOUTS.labels(self.model, tier.label).inc()
        took_s = asyncio.get_running_loop().time() - sent_at
        waited_s = sent_at - min(item.enqueued for item in batch)
        log.warning("batch of %d rows for model %s (%s) ran out of its %.0f ms after %.0f ms at the model server, "
                    "its requests having waited up to %.0f ms here; the tier's batches take about %s",
                    sum(item.rows for item in batch), self.model, tier.label, 1000 * timeout_s, 1000 * took_s,
                    1000 * waited_s, "(no estimate yet)" if expected_s is None else f"{1000 * expected_s:.0f} ms")

    def idle(self) -> bool:
        """Nothing waits, gathers or runs here."""
        return not len(self) and not self._forming and not self._batches

    def stop(self) -> None:
        """Ends the batching task of an idle queue (see Batcher._prune)."""
        if self._task is not None:
            self._task.cancel()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        shutting_down = errors.Unavailable(f"batcher is shutting down; model '{self.model}' request not run")
        _fail_all(self._forming, shutting_down)
        for queue in self._levels.values():
            _fail_all(list(queue), shutting_down)  # each leaves its place as it is answered
            queue.clear()
        # By now the server has stopped (its drain grace is over): nobody reads what a running
        # batch would answer, so it is cancelled, and its call to the model server with it,
        # instead of holding the process up to its execute timeout.
        for task in self._batches:
            task.cancel()
        if self._batches:
            await asyncio.gather(*self._batches, return_exceptions=True)


def _no_time_or_room(exc: errors.InfermeshError) -> bool:
    """Out of time, or refused by a busy model server (its refusals carry a retry
    hint; gRPC's own RESOURCE_EXHAUSTED, e.g. an oversized message, does not, and
    splitting the batch is what isolates the request that caused it)."""
    return isinstance(exc, errors.DeadlineExceeded) or (
        isinstance(exc, errors.ResourceExhausted) and exc.retry_after_ms > 0)


def _stop_if_abandoned(task: asyncio.Task, futures: list[asyncio.Future], _done: asyncio.Future) -> None:
    """Once every caller of a running batch has gone, the batch is cancelled, and
    its call to the model server with it: the instance it holds is free for
    work someone waits for (a batch still queued there is dropped, a sliced
    one stops at its next slice)."""
    if not task.done() and all(future.cancelled() for future in futures):
        metrics.ABANDONED.inc()
        task.cancel()


def _fail_all(items: list[Pending], error: errors.InfermeshError) -> None:
    for item in items:
        if not item.future.done():
            item.future.set_exception(error)


class Batcher:
    """Routes requests to per-model queues and answers each exactly once."""

    def __init__(self, backend: Backend, max_batch_size: int, max_queue_delay_ms: float, max_queue_size: int = 2048,
                 default_timeout_s: float = 30.0, policy: QueuePolicy | None = None, length_aware: bool = True,
                 batch_policy: str = "fixed", latency_targets_s: dict[Tier, float] | None = None):
        self._length_aware = length_aware
        self._batch_policy = batch_policy
        self._latency_targets_s = latency_targets_s or {Tier.VIP: 0.2, Tier.STANDARD: 1.0}
        self._backend = backend
        self._max_batch_size = max_batch_size
        self._max_delay_s = max_queue_delay_ms / 1000
        self._policy = policy if policy is not None else QueuePolicy.uniform(max_queue_size, default_timeout_s)
        self._default_timeout_s = default_timeout_s
        self._queues: dict[tuple[str, str], ModelQueue] = {}
        # Per model, shared by its versions' queues and sized by the newest ready version's
        # instances, where requests naming no version go.
        self._slots: dict[str, SlotPool] = {}
        backend.on_change(self._poke_slots)

    def _poke_slots(self) -> None:
        for slots in self._slots.values():
            slots.poke()
        self._prune()

    def _prune(self) -> None:
        """Drops the queue of a version no replica holds any more once nothing
        waits or runs there, so queues do not pile up over rollouts. The
        default version's queue (no version named) stays: it holds what the
        batch policy learned of the model. So does every queue of a model no
        ready replica describes now: that is an outage (replicas restarting,
        a network partition), not a rollout, and the version is likely back
        with them; what its policy learned would be lost for nothing."""
        for (model, version), queue in list(self._queues.items()):
            limits = self._backend.limits(model)
            retired = limits is not None and limits.versions and version not in limits.versions
            if version and retired and queue.idle():
                del self._queues[(model, version)]
                queue.stop()

    def _queue(self, model: str, version: str) -> ModelQueue:
        key = (model, version)
        queue = self._queues.get(key)
        if queue is None:
            if model not in self._slots:
                self._slots[model] = SlotPool(functools.partial(self._backend.slots, model))
            queue = ModelQueue(model, version, self._backend, self._max_batch_size, self._max_delay_s,
                               self._policy, self._slots[model], self._default_timeout_s, self._length_aware,
                               make_policy(self._batch_policy, self._max_batch_size, self._max_delay_s,
                                           self._latency_targets_s))
            self._queues[key] = queue
        return queue

    async def submit(self, model: str, version: str, inputs: list[TensorData], outputs: list[str],
                     tier: Tier = Tier.STANDARD, timeout_s: float | None = None, tenant: str = "",
                     weight: float = 1.0) -> tuple[str, list[TensorData]]:
        """Queues one request and waits for its answer; cancelling the caller
        drops the request before it runs. Within its level, `tenant` shares
        with the other tenants there by `weight` (0 counts as 1)."""
        loop = asyncio.get_running_loop()
        limits = self._backend.limits(model)
        if limits is None:
            raise errors.Unavailable(f"no ready model_server replica serves model '{model}'")
        if tier not in TIERS:
            raise errors.InvalidArgument(f"tier {tier} is not a Tier value; expected one of {[int(t) for t in TIERS]}")
        tier = Tier(tier)
        if len(tenant) > MAX_TENANT_CHARS:
            raise errors.InvalidArgument(f"field 'tenant' is {len(tenant)} characters long; at most {MAX_TENANT_CHARS}")
        weight = weight or 1.0
        if not MIN_WEIGHT <= weight <= MAX_WEIGHT:  # NaN too
            raise errors.InvalidArgument(f"field 'tenant_weight' must be in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}] (or 0 "
                                         f"for 1), got {weight!r}")
        names = [t.name for t in inputs]
        if sorted(names) != sorted(limits.inputs) or len(set(names)) != len(names):
            raise errors.InvalidArgument(f"model '{model}' takes inputs {sorted(limits.inputs)}, got {names}")
        rows = inputs[0].rows
        if any(t.rows != rows for t in inputs) or rows < 1:
            raise errors.InvalidArgument(f"inputs of the request disagree on the batch dimension: {[t.shape for t in inputs]}")
        if rows > limits.max_batch_size:
            raise errors.InvalidArgument(
                f"request of {rows} rows exceeds max_batch_size {limits.max_batch_size} of model '{model}'")
        for tensor in inputs:  # a request whose data cannot fill its shape never joins, and fails, a batch
            check_tensor_size(tensor, f"input '{tensor.name}' of model '{model}'")
        if version and limits.versions and version not in limits.versions:
            # Refused before it has a queue (a queue per version string asked for would grow without
            # bound), as the replicas would refuse it: UNAVAILABLE, since the router, whose catalog may
            # be a poll ahead of this batcher's, has already answered NOT_FOUND for versions it knows
            # nothing of.
            raise errors.Unavailable(f"no ready model_server replica serves model '{model}' version {version}; "
                                     f"they hold versions {sorted(limits.versions)}")
        queue = self._queue(model, version)
        now = loop.time()
        # A request's own deadline may only shorten its level's default wait.
        level_timeout = self._policy.levels[tier].default_timeout_s
        if level_timeout > 0:
            timeout_s = min(timeout_s, level_timeout) if timeout_s else level_timeout
        length = sum(len(t.data) for t in inputs if t.datatype == "BYTES") / rows
        item = Pending(inputs, outputs, tier, now + timeout_s if timeout_s else None, loop.create_future(), now,
                       length=length, shape=tuple((t.name, t.shape[1:]) for t in inputs), tenant=tenant,
                       weight=weight)
        queue.put(item)
        item.future.add_done_callback(item.answered)
        if item.deadline is not None:
            item.timer = loop.call_at(queue.give_up_at(item), queue.give_up, item)
        try:
            return await item.future
        finally:
            item.taken()

    def queue_length(self) -> int:
        return sum(len(q) for q in self._queues.values())

    async def close(self) -> None:
        await asyncio.gather(*(q.close() for q in self._queues.values()))
