"""The requests waiting for one model version: a queue level per tier.

Each level is a FairLevel (tenants share it by weight; one tenant's requests
go FIFO). A request answered while it waits (expired, refused, cancelled)
leaves its level's deque only when the batching task passes it, but stops
counting at once: admission, planning, the bound and the gauge read the
counts kept here, never the deques' lengths."""

import asyncio
import dataclasses
from collections.abc import Callable, ValuesView

from services.batcher import metrics
from services.batcher.fair import FairLevel
from services.batcher.pending import Pending
from services.common.tier import Tier


@dataclasses.dataclass(slots=True)
class _TenantLoad:
    """What one tenant has waiting at one level."""

    requests: int
    rows: int
    weight: float


class Levels:
    """The queue levels of one model version and what waits in them."""

    def __init__(self, model: str, on_waiting: Callable[[Tier, float, bool], None]):
        self.model = model
        self._on_waiting = on_waiting  # (tier, now, whether rows of that tier wait from now on)
        self.levels: dict[Tier, FairLevel[Pending]] = {Tier.VIP: FairLevel(), Tier.STANDARD: FairLevel()}
        self.queued = {Tier.VIP: 0, Tier.STANDARD: 0}  # requests waiting, per tier
        self.queued_rows = {Tier.VIP: 0, Tier.STANDARD: 0}
        # Per (tier, tenant) with requests waiting, its load; and per level the sum
        # of those tenants' weights. Only waiting requests have entries.
        self._tenant_load: dict[tuple[Tier, str], _TenantLoad] = {}
        self._level_weight = {Tier.VIP: 0.0, Tier.STANDARD: 0.0}

    def __len__(self) -> int:
        """Requests waiting to be run (not those answered while they waited)."""
        return sum(self.queued.values())

    def __getitem__(self, tier: Tier) -> FairLevel[Pending]:
        return self.levels[tier]

    def values(self) -> ValuesView[FairLevel[Pending]]:
        """The levels themselves, VIP's first."""
        return self.levels.values()

    def append(self, item: Pending) -> None:
        """Gives the request its place in its tier's level, counted from its arrival."""
        self.levels[item.tier].append(item)
        item.queued = True
        self._count(item, 1, item.enqueued)

    def leave(self, item: Pending) -> None:
        """The request no longer holds a place in its level: taken into a batch,
        or answered while it waited (its deque entry goes when passed over)."""
        if item.queued:
            item.queued = False
            self._count(item, -1, asyncio.get_running_loop().time())

    def _count(self, item: Pending, requests: int, now: float) -> None:
        tier, rows = item.tier, requests * item.rows
        self.queued[tier] += requests
        self.queued_rows[tier] += rows
        key = (tier, item.tenant)
        load = self._tenant_load.get(key)
        if load is None:
            load = self._tenant_load[key] = _TenantLoad(0, 0, item.weight)
            self._level_weight[tier] += item.weight
        load.requests += requests
        load.rows += rows
        if load.requests <= 0:
            del self._tenant_load[key]
            self._level_weight[tier] = max(0.0, self._level_weight[tier] - load.weight)
        self._on_waiting(tier, now, self.queued_rows[tier] > 0)
        metrics.QUEUE_LENGTH.labels(self.model, tier.label).set(self.queued[tier])

    def rows_above(self, tier: Tier) -> int:
        """Rows waiting at tiers above `tier`: all served before it."""
        return sum(rows for other, rows in self.queued_rows.items() if other > tier)

    def rows_from(self, tier: Tier) -> int:
        """Rows waiting at `tier` and above."""
        return sum(rows for other, rows in self.queued_rows.items() if other >= tier)

    def tenant_share(self, item: Pending, places: float) -> tuple[float, int]:
        """The tenant's share of `places` among the tenants waiting at its level
        (itself counted), and how many requests it has waiting there."""
        load = self._tenant_load.get((item.tier, item.tenant))
        weights = self._level_weight[item.tier] + (0.0 if load else item.weight)
        return places * item.weight / weights, (load.requests if load else 0)

    def rows_before(self, item: Pending) -> int:
        """About the rows of its own level served before a new request is: all
        that wait there, or, where other tenants wait too, as many as fair
        queueing serves of theirs while this tenant's backlog and the request
        go (its rows at the level's total weight over its own)."""
        waiting = self.queued_rows[item.tier]
        load = self._tenant_load.get((item.tier, item.tenant))
        mine = load.rows if load else 0
        if mine == waiting:
            return waiting
        weights = self._level_weight[item.tier] + (0.0 if load else item.weight)
        return min(waiting, int((mine + item.rows) * weights / item.weight) - item.rows)
