"""Batch-size policies: how many rows the next batch should hold, and how long
it may wait for them. The batcher asks once a batch has its first request.

- fixed: the configured size; wait up to max_queue_delay_ms while a batch of
  the model is running (for a VIP lead, a VIP batch), not at all while it is
  idle (Triton's rule, plus the idle exception).
- baseline: our source material's rule — start at 32, double up to 128 while
  more than 100 requests wait, halve down to 8 while fewer than 0.5 arrive per
  second — with the fixed policy's waiting.
- adaptive: learns what a row costs at each batch size online, and sends the
  smallest batch that keeps up with the tier's arrivals (with headroom) and
  takes what waits in one batch per free slot (a short queue is spread over
  idle instances instead of waiting on one); under overload the configured size,
  the least overhead per row; never a batch longer than the tier's latency
  target. A small batch is done sooner, so below saturation latency can fall;
  at saturation it batches as fixed does. Waits as the fixed policy does.
"""

import collections
import dataclasses
import math
from typing import Protocol

from services.common.latency import MovingTime, nearest_class, size_class
from services.common.tier import Tier


@dataclasses.dataclass(frozen=True)
class QueueView:
    """What a policy sees when a batch has its first request."""

    now: float
    oldest_enqueued: float  # of the request leading the batch
    tier: Tier  # of that request
    waiting_rows: int  # queued at the lead's tier or above, the lead included
    running: tuple[tuple[float, int], ...]  # (start, rows) of the model's batches in flight (a VIP lead: VIP ones)
    max_rows: int  # the model's and the configuration's cap
    slots: int = 1  # batches of the lead's tier that may run at once


class Policy(Protocol):
    name: str

    def plan(self, view: QueueView) -> tuple[int, float]:
        """(rows to aim for, loop time by which to send the batch even if not full)."""

    def observe_arrival(self, now: float, rows: int, tier: Tier) -> None: ...

    def observe_batch(self, rows: int, seconds: float) -> None: ...


class ArrivalRate:
    """Rows per second, exponentially decayed with a time constant of `tau_s`."""

    def __init__(self, tau_s: float = 5.0):
        self._tau_s = tau_s
        self._rate = 0.0
        self._last: float | None = None

    def observe(self, now: float, rows: int) -> None:
        self._decay(now)
        self._rate += rows / self._tau_s

    def rate(self, now: float) -> float:
        self._decay(now)
        return self._rate

    def _decay(self, now: float) -> None:
        if self._last is not None:
            self._rate *= math.exp(-max(now - self._last, 0.0) / self._tau_s)
        self._last = now


class FixedPolicy:
    name = "fixed"

    def __init__(self, max_rows: int, max_delay_s: float):
        self._max_rows = max_rows
        self._max_delay_s = max_delay_s

    def plan(self, view: QueueView) -> tuple[int, float]:
        if not view.running:  # an idle model gains nothing from waiting
            return min(self._max_rows, view.max_rows), view.now
        return min(self._max_rows, view.max_rows), view.oldest_enqueued + self._max_delay_s

    def observe_arrival(self, now: float, rows: int, tier: Tier) -> None:
        pass

    def observe_batch(self, rows: int, seconds: float) -> None:
        pass


class BaselinePolicy(FixedPolicy):
    name = "baseline"

    def __init__(self, max_delay_s: float):
        super().__init__(32, max_delay_s)
        self._arrivals = ArrivalRate()

    def plan(self, view: QueueView) -> tuple[int, float]:
        if view.waiting_rows > 100:
            self._max_rows = min(self._max_rows * 2, 128)
        elif self._arrivals.rate(view.now) < 0.5:
            self._max_rows = max(self._max_rows // 2, 8)
        return super().plan(view)

    def observe_arrival(self, now: float, rows: int, tier: Tier) -> None:
        self._arrivals.observe(now, rows)


class RowCost:
    """What a batch costs per row, learned online per size class (a power of
    two): the mean rows and the mean seconds of its batches. Per row, not per
    batch, as a class holds batches of different sizes (5 to 8 rows)."""

    def __init__(self) -> None:
        self._classes: dict[int, tuple[MovingTime, MovingTime]] = {}

    def observe(self, rows: int, seconds: float) -> None:
        rows_seen, seconds_seen = self._classes.setdefault(size_class(rows), (MovingTime(), MovingTime()))
        rows_seen.observe(rows)
        seconds_seen.observe(seconds)

    def seconds(self, rows: int) -> float | None:
        """A batch of `rows` at its class's cost per row, or the nearest known
        class's; None before any batch ran."""
        if not self._classes:
            return None
        rows_seen, seconds_seen = self._classes[nearest_class(self._classes, rows)]
        assert rows_seen.mean is not None and seconds_seen.mean is not None  # a class is made as it observes a batch
        return seconds_seen.mean * rows / rows_seen.mean


class AdaptivePolicy:
    name = "adaptive"

    def __init__(
        self,
        max_rows: int,
        max_delay_s: float,
        latency_targets_s: dict[Tier, float],
        headroom: float = 1.5,
        tau_s: float = 2.0,
    ):
        self._max_rows = max_rows
        self._waiting = FixedPolicy(max_rows, max_delay_s)
        self._targets = latency_targets_s
        # Capacity kept above the arrival rate: the cost per row learned is that
        # of the call to the model server, and a batch also costs the rest of
        # the mesh's work (caps of 4 and 8 rows served 10% less than 32 at
        # saturation here).
        self._headroom = headroom
        self._arrivals: dict[Tier, ArrivalRate] = collections.defaultdict(lambda: ArrivalRate(tau_s))
        self.cost = RowCost()

    def plan(self, view: QueueView) -> tuple[int, float]:
        size = self.size(view)
        _, dispatch_by = self._waiting.plan(view)
        return size, dispatch_by

    def size(self, view: QueueView) -> int:
        """The smallest batch, of 1, 2, 4, ... up to the configured size, that
        serves the tier's arrivals with headroom on its slots and takes what
        waits in one batch per free slot; the largest when none does (overload,
        a backlog), as it has the least overhead per row. Never one that would
        run longer than the tier's latency target, unless a single row would."""
        largest = min(self._max_rows, view.max_rows)
        needed = self._headroom * self._arrivals[view.tier].rate(view.now)
        target = self._targets.get(view.tier, math.inf)
        if self.cost.seconds(largest) is None:  # no batch seen yet
            return largest

        def cost_s(rows: int) -> float:
            seconds = self.cost.seconds(rows)
            assert seconds is not None  # a batch has been seen (above)
            return seconds

        free = max(view.slots - len(view.running), 1)  # this batch's slot among them
        chosen = largest
        for rows in _sizes(largest):
            if view.slots * rows >= needed * cost_s(rows) and view.waiting_rows <= free * rows:
                chosen = rows
                break
        while chosen > 1 and cost_s(chosen) > target:
            chosen = size_class(chosen) // 2
        return chosen

    def observe_arrival(self, now: float, rows: int, tier: Tier) -> None:
        self._arrivals[tier].observe(now, rows)

    def observe_batch(self, rows: int, seconds: float) -> None:
        self.cost.observe(rows, seconds)


def _sizes(max_rows: int) -> list[int]:
    """Candidate batch sizes: the powers of two below max_rows, then max_rows."""
    return [1 << k for k in range(max(max_rows - 1, 0).bit_length()) if 1 << k < max_rows] + [max_rows]


POLICIES = ("fixed", "baseline", "adaptive")


def make_policy(name: str, max_rows: int, max_delay_s: float, latency_targets_s: dict[Tier, float]) -> Policy:
    if name == "fixed":
        return FixedPolicy(max_rows, max_delay_s)
    if name == "baseline":
        return BaselinePolicy(max_delay_s)
    if name == "adaptive":
        return AdaptivePolicy(max_rows, max_delay_s, latency_targets_s)
    raise ValueError(f"batch policy must be one of {POLICIES}, got {name!r}")
