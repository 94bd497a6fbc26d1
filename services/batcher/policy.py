"""Batch-size policies: how many rows the next batch should hold, and how long
it may wait for them. The batcher asks once a batch has its first request.

- fixed: the configured size; wait up to max_queue_delay_ms while a batch of
  the model is running, not at all while it is idle (Triton's rule, plus the
  idle exception).
- baseline: our source material's rule — start at 32, double up to 128 while
  more than 100 requests wait, halve down to 8 while fewer than 0.5 arrive per
  second — with the fixed policy's waiting.
- adaptive: learns each batch size's latency online and sends the next batch
  just before the running one should finish, so that the batch holds
  everything that arrived meanwhile without the model ever waiting for it;
  never longer than the lead request's level allows for its latency target.
"""

import dataclasses
import math
from typing import Protocol

from services.common.latency import LatencyProfile


@dataclasses.dataclass(frozen=True)
class QueueView:
    """What a policy sees when a batch has its first request."""

    now: float
    oldest_enqueued: float  # of the request leading the batch
    level: int  # of that request
    waiting_rows: int  # queued, the lead request included
    running: tuple[tuple[float, int], ...]  # (start, rows) of this model's batches in flight
    max_rows: int  # the model's and the configuration's cap


class Policy(Protocol):
    name: str

    def plan(self, view: QueueView) -> tuple[int, float]:
        """(rows to aim for, loop time by which to send the batch even if not full)."""

    def observe_arrival(self, now: float, rows: int) -> None: ...

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

    def observe_arrival(self, now: float, rows: int) -> None:
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

    def observe_arrival(self, now: float, rows: int) -> None:
        self._arrivals.observe(now, rows)


class AdaptivePolicy:
    name = "adaptive"

    def __init__(self, max_delay_s: float, latency_targets_s: dict[int, float], margin_s: float = 0.002):
        self._fallback = FixedPolicy(1 << 30, max_delay_s)
        self._targets = latency_targets_s
        self._margin_s = margin_s
        self.profile = LatencyProfile()

    def plan(self, view: QueueView) -> tuple[int, float]:
        size = view.max_rows
        if not view.running:
            return size, view.now
        own = self.profile.estimate(size)
        running = [(start, self.profile.estimate(rows)) for start, rows in view.running]
        if own is None or any(seconds is None for _, seconds in running):
            return self._fallback.plan(view)
        # When the model should be free again, a little early for the trip there.
        free_at = min(start + seconds for start, seconds in running) - self._margin_s - 0.1 * own
        # The lead request must still make its level's latency target.
        latest = view.oldest_enqueued + self._targets.get(view.level, math.inf) - own
        return size, max(view.now, min(free_at, latest))

    def observe_arrival(self, now: float, rows: int) -> None:
        pass

    def observe_batch(self, rows: int, seconds: float) -> None:
        self.profile.observe(rows, seconds)


POLICIES = ("fixed", "baseline", "adaptive")


def make_policy(name: str, max_rows: int, max_delay_s: float, latency_targets_s: dict[int, float]) -> Policy:
    if name == "fixed":
        return FixedPolicy(max_rows, max_delay_s)
    if name == "baseline":
        return BaselinePolicy(max_delay_s)
    if name == "adaptive":
        return AdaptivePolicy(max_delay_s, latency_targets_s)
    raise ValueError(f"batch policy must be one of {POLICIES}, got {name!r}")
