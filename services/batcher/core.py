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
import functools
import itertools
import logging
from collections.abc import Callable
from typing import Protocol

from services.batcher import metrics
from services.batcher.admission import Admission
from services.batcher.config import BatchingConfig, LevelPolicy, QueuePolicy
from services.batcher.dispatch import Dispatch
from services.batcher.fair import FairLevel
from services.batcher.levels import Levels
from services.batcher.pending import ModelLimits, Pending, fail_all
from services.batcher.policy import FixedPolicy, Policy, QueueView, make_policy
from services.batcher.slots import SlotPool
from services.common import errors, tracing
from services.common.identity import MAX_WEIGHT, MIN_WEIGHT
from services.common.tensors import TensorData, check_tensor_size
from services.common.tier import TIERS, Tier

log = logging.getLogger(__name__)

__all__ = ["Backend", "Batcher", "BatchingConfig", "LevelPolicy", "ModelLimits", "ModelQueue", "QueuePolicy"]
LENGTH_WINDOW = 128  # how far into a level length-aware batching looks for a similar request
MAX_TENANT_CHARS = 256  # of a tenant's name: it is held while the tenant's requests wait


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
        self,
        model: str,
        version: str,
        inputs: list[TensorData],
        outputs: list[str],
        timeout_s: float,
        tier: Tier = Tier.STANDARD,
    ) -> tuple[str, list[TensorData]]: ...


class ModelQueue:
    """The queue and batching task of one model version: takes requests into
    its levels (admission permitting), forms batches and hands them to dispatch."""

    def __init__(
        self,
        model: str,
        version: str,
        backend: Backend,
        config: BatchingConfig,
        slots: SlotPool,
        batch_policy: Policy | None = None,
    ):
        self.model = model
        self.version = version
        self._backend = backend
        self._config = config
        self._slots = slots
        self.batch_policy = (
            batch_policy if batch_policy is not None else FixedPolicy(config.max_batch_size, config.max_delay_s)
        )
        # Levels tell admission when requests of a tier start and stop waiting (its service rate's busy time).
        self._levels = Levels(model, lambda tier, now, any_waiting: self.admission.waiting(tier, now, any_waiting))
        assert config.policy is not None  # BatchingConfig fills it in
        self._policy = config.policy
        self.admission = Admission(model, self._policy, self._levels, slots, lambda: self.batch_size)
        self._dispatch = Dispatch(
            model, version, backend, slots, self.admission, self.batch_policy, config.default_timeout_s
        )
        self._last_led_tier = Tier.STANDARD  # of the request that led the last batch
        self._running: dict[asyncio.Task, tuple[float, int, Tier]] = {}  # batches in flight: (start, rows, tier)
        self._forming: list[Pending] = []  # the batch _collect is filling: taken from the levels, not yet sent
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._batches: set[asyncio.Task] = set()

    @property
    def levels(self) -> Levels:
        return self._levels

    @property
    def batch_size(self) -> int:
        limits = self._backend.limits(self.model)
        return min(self._config.max_batch_size, limits.max_batch_size) if limits else self._config.max_batch_size

    def __len__(self) -> int:
        """Requests waiting to be run (not those answered while they waited)."""
        return len(self._levels)

    def put(self, item: Pending) -> None:
        """Queues a request, or refuses it (RESOURCE_EXHAUSTED: its level is full,
        or it could not be answered in time)."""
        self.admission.check_room(item)
        self.admission.admit(item)
        self._levels.append(item)
        item.future.add_done_callback(lambda _: self._levels.leave(item))  # answered while it waits: a place frees
        self.batch_policy.observe_arrival(item.enqueued, item.rows, item.tier)
        if item.tier == Tier.VIP or self._levels.queued[item.tier] == 1:
            # A VIP request may take a reserved slot; the first standard one a slot VIP work cannot use.
            self._slots.poke()
        self._arrived.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"batcher-{self.model}-{self.version}")

    async def _run(self) -> None:
        while True:
            while not len(self):
                self._arrived.clear()
                await self._arrived.wait()
            slot, tiers = await self._slots.acquire(
                lambda: bool(self._levels.queued[Tier.VIP]), lambda: bool(self._levels.queued[Tier.STANDARD])
            )
            forming_since = asyncio.get_running_loop().time()
            try:
                # A slot reserved for VIP work carries a VIP-led batch, even when aged
                # standard requests are due a turn: theirs comes with a general slot.
                batch = await self._collect(tiers)
            except BaseException:
                self._slots.release(slot)
                # Taken from the queue and not yet sent: no one else would answer them.
                fail_all(
                    self._forming, errors.Unavailable(f"batcher is shutting down; model '{self.model}' request not run")
                )
                raise
            if not batch:  # everything waiting had expired or been cancelled
                self._slots.release(slot)
                continue
            task = asyncio.create_task(self._dispatch.execute(batch, slot, forming_since))
            self._batches.add(task)
            self._running[task] = (
                asyncio.get_running_loop().time(),
                sum(item.rows for item in batch),
                max(item.tier for item in batch),
            )
            task.add_done_callback(self._batch_done)
            abandoned = functools.partial(_stop_if_abandoned, task, [item.future for item in batch])
            for item in batch:
                item.future.add_done_callback(abandoned)

    def _batch_done(self, task: asyncio.Task) -> None:
        self._batches.discard(task)
        self._running.pop(task, None)

    def _take(
        self,
        room: int,
        alone: bool,
        near_length: float | None = None,
        tiers: tuple[Tier, ...] = TIERS,
        shape: tuple = (),
    ) -> Pending | None:
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
        while standard and not self.admission.live(standard[0], now):  # the aging bound reads the oldest still waiting
            standard.popleft()
        if (
            alone
            and self._last_led_tier == Tier.VIP
            and standard
            and now - standard[0].enqueued >= self._policy.aging_s
        ):
            # Starvation bound: while VIP batches follow each other, a standard
            # request that has aged gets every other batch. Standard traffic
            # that merely waits behind its own backlog is not promoted, so a
            # standard overload never pushes VIP requests back.
            order = (Tier.STANDARD, Tier.VIP)
        for tier in (tier for tier in order if tier in tiers):
            queue = self._levels[tier]
            while queue:
                item = queue[0]
                if not self.admission.live(item, now):
                    queue.popleft()
                    continue
                if not alone and (item.rows > room or item.shape != shape):
                    break
                if near_length is None or len(queue) == 1:
                    queue.popleft()
                else:
                    item = self._closest(queue, room, near_length, now, shape)
                    queue.remove(item)
                self._levels.leave(item)
                if alone:
                    self._last_led_tier = tier
                item.taken()
                return item
        return None

    def _closest(self, queue: FairLevel, room: int, length: float, now: float, shape: tuple) -> Pending:
        """Among the first LENGTH_WINDOW live requests that fit and have `shape`,
        the one nearest `length`; ties go to the older. The head fits, so there
        is always one."""
        best, best_gap = queue[0], abs(queue[0].length - length)
        for item in itertools.islice(queue, 1, LENGTH_WINDOW):
            if (
                item.rows > room
                or item.shape != shape
                or item.future.done()
                or (item.deadline is not None and now >= item.deadline)
            ):
                continue
            gap = abs(item.length - length)
            if gap < best_gap:
                best, best_gap = item, gap
        return best

    async def _collect(self, tiers: tuple[Tier, ...] = TIERS) -> list[Pending]:
        """A batch of requests from `tiers` (see SlotPool.acquire)."""
        loop = asyncio.get_running_loop()
        batch = self._forming = []
        rows = 0
        size, dispatch_by = self.batch_size, loop.time()
        while True:
            near = batch[0].length if batch and self._config.length_aware else None
            allowed = self._fill_tiers(batch[0].tier, tiers) if batch else tiers
            item = self._take(
                size - rows, alone=not batch, near_length=near, tiers=allowed, shape=batch[0].shape if batch else ()
            )
            if item is not None:
                if not batch:
                    size, dispatch_by = self._plan(item)
                batch.append(item)
                rows += item.rows
                if rows >= size:
                    break
                continue
            if not batch or any(self._levels.queued[tier] for tier in allowed):
                break  # nothing waiting, or the next request does not fit or is of another shape
            if self._levels.queued[Tier.VIP] and Tier.VIP not in allowed:
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
            now=asyncio.get_running_loop().time(),
            oldest_enqueued=lead.enqueued,
            tier=lead.tier,
            # What the lead's batch and those after it drain: its level and those above.
            waiting_rows=lead.rows + self._levels.rows_from(lead.tier),
            # A VIP batch waits for company only behind VIP batches: standard ones do not
            # hold its instance, and at VIP rates the wait would only add to its latency.
            running=tuple(
                (start, rows)
                for start, rows, tier in self._running.values()
                if lead.tier == Tier.STANDARD or tier == Tier.VIP
            ),
            max_rows=limits.max_batch_size if limits else self._config.max_batch_size,
            slots=self.admission.tier_slots(lead.tier),
        )
        size, dispatch_by = self.batch_policy.plan(view)
        metrics.TARGET_ROWS.labels(self.model).set(size)
        return max(size, 1), dispatch_by

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
        fail_all(self._forming, shutting_down)
        for queue in self._levels.values():
            fail_all(list(queue), shutting_down)  # each leaves its place as it is answered
            queue.clear()
        # By now the server has stopped (its drain grace is over): nobody reads what a running
        # batch would answer, so it is cancelled, and its call to the model server with it,
        # instead of holding the process up to its execute timeout.
        for task in self._batches:
            task.cancel()
        if self._batches:
            await asyncio.gather(*self._batches, return_exceptions=True)


def _stop_if_abandoned(task: asyncio.Task, futures: list[asyncio.Future], _done: asyncio.Future) -> None:
    """Once every caller of a running batch has gone, the batch is cancelled, and
    its call to the model server with it: the instance it holds is free for
    work someone waits for (a batch still queued there is dropped, a sliced
    one stops at its next slice)."""
    if not task.done() and all(future.cancelled() for future in futures):
        metrics.ABANDONED.inc()
        task.cancel()


class Batcher:
    """Routes requests to per-model queues and answers each exactly once."""

    def __init__(self, backend: Backend, config: BatchingConfig):
        self._backend = backend
        self._config = config
        assert config.policy is not None  # BatchingConfig fills it in
        self._policy = config.policy
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
            config = self._config
            queue = ModelQueue(
                model,
                version,
                self._backend,
                config,
                self._slots[model],
                make_policy(config.batch_policy, config.max_batch_size, config.max_delay_s, config.latency_targets_s),
            )
            self._queues[key] = queue
        return queue

    async def submit(
        self,
        model: str,
        version: str,
        inputs: list[TensorData],
        outputs: list[str],
        tier: Tier = Tier.STANDARD,
        timeout_s: float | None = None,
        tenant: str = "",
        weight: float = 1.0,
    ) -> tuple[str, list[TensorData]]:
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
            raise errors.InvalidArgument(
                f"field 'tenant_weight' must be in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}] (or 0 for 1), got {weight!r}"
            )
        names = [t.name for t in inputs]
        if sorted(names) != sorted(limits.inputs) or len(set(names)) != len(names):
            raise errors.InvalidArgument(f"model '{model}' takes inputs {sorted(limits.inputs)}, got {names}")
        rows = inputs[0].rows
        if any(t.rows != rows for t in inputs) or rows < 1:
            raise errors.InvalidArgument(
                f"inputs of the request disagree on the batch dimension: {[t.shape for t in inputs]}"
            )
        if rows > limits.max_batch_size:
            raise errors.InvalidArgument(
                f"request of {rows} rows exceeds max_batch_size {limits.max_batch_size} of model '{model}'"
            )
        for tensor in inputs:  # a request whose data cannot fill its shape never joins, and fails, a batch
            check_tensor_size(tensor, f"input '{tensor.name}' of model '{model}'")
        if version and limits.versions and version not in limits.versions:
            # Refused before it has a queue (a queue per version string asked for would grow without
            # bound), as the replicas would refuse it: UNAVAILABLE, since the router, whose catalog may
            # be a poll ahead of this batcher's, has already answered NOT_FOUND for versions it knows
            # nothing of.
            raise errors.Unavailable(
                f"no ready model_server replica serves model '{model}' version {version}; "
                f"they hold versions {sorted(limits.versions)}"
            )
        queue = self._queue(model, version)
        now = loop.time()
        # A request's own deadline may only shorten its level's default wait.
        level_timeout = self._policy.levels[tier].default_timeout_s
        if level_timeout > 0:
            timeout_s = min(timeout_s, level_timeout) if timeout_s else level_timeout
        length = sum(len(t.data) for t in inputs if t.datatype == "BYTES") / rows
        item = Pending(
            inputs,
            outputs,
            tier,
            now + timeout_s if timeout_s else None,
            loop.create_future(),
            now,
            length=length,
            shape=tuple((t.name, t.shape[1:]) for t in inputs),
            tenant=tenant,
            weight=weight,
            trace=tracing.CURRENT.get(),
        )
        queue.put(item)
        item.future.add_done_callback(item.answered)
        if item.deadline is not None:
            item.timer = loop.call_at(queue.admission.give_up_at(item), queue.admission.give_up, item)
        try:
            return await item.future
        finally:
            item.taken()

    def queue_length(self) -> int:
        return sum(len(q) for q in self._queues.values())

    async def close(self) -> None:
        await asyncio.gather(*(q.close() for q in self._queues.values()))
