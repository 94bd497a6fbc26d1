"""Fair share between tenants inside one queue level (one tier of a model).

A level's waiting requests are served by start-time fair queueing (Goyal,
Vin and Cheng, 1996) over tenants: each request gets a start tag, the later
of the level's virtual time and its tenant's previous finish tag, and a
finish tag its start plus rows / weight; requests go in start-tag order, and
the virtual time is the start tag of the request served last. A tenant that
sends five times its share waits behind its own backlog while another
tenant's request starts next to the queue's head. With one tenant the order is
FIFO, as before.

Only tenants with requests waiting have state here: a tenant whose last
request left starts afresh at the virtual time when it comes back (it loses
at most one request's credit), so names sent by callers cannot grow it.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class Waiting(Protocol):
    tenant: str
    weight: float
    tag: float  # its start tag, set by FairLevel.append
    seq: int  # its arrival: equal tags go in arrival order

    @property
    def rows(self) -> int: ...


W = TypeVar("W", bound=Waiting)


class FairLevel(Generic[W]):
    """A deque-like queue (append, [0], popleft, remove, iteration in service
    order) that serves tenants in proportion to their weights."""

    def __init__(self) -> None:
        self._flows: dict[str, collections.deque[W]] = {}  # tenant -> its requests in arrival order
        self._finish: dict[str, float] = {}  # tenant -> finish tag of its newest request
        # (start tag of a flow's head, its arrival, tenant); stale entries (the flow's
        # head changed or the flow is gone) are dropped when they come to the top.
        self._heads: list[tuple[float, int, str]] = []
        self._order = itertools.count()
        self._virtual = 0.0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def tenants(self) -> int:
        """Tenants with requests here (for tests and gauges)."""
        return len(self._flows)

    def append(self, item: W) -> None:
        start = max(self._virtual, self._finish.get(item.tenant, self._virtual))
        item.tag, item.seq = start, next(self._order)
        self._finish[item.tenant] = start + item.rows / item.weight
        flow = self._flows.get(item.tenant)
        if flow is None:
            flow = self._flows[item.tenant] = collections.deque()
            heapq.heappush(self._heads, (start, item.seq, item.tenant))
        flow.append(item)
        self._count += 1

    def _top(self) -> collections.deque[W]:
        while True:
            _, seq, tenant = self._heads[0]
            flow = self._flows.get(tenant)
            if flow is not None and flow[0].seq == seq:
                return flow
            heapq.heappop(self._heads)

    def __getitem__(self, index: int) -> W:
        if index != 0:
            raise IndexError("a FairLevel shows its head only")
        if not self._count:
            raise IndexError("the level is empty")
        return self._top()[0]

    def popleft(self) -> W:
        if not self._count:
            raise IndexError("the level is empty")
        flow = self._top()
        heapq.heappop(self._heads)
        item = flow.popleft()
        self._virtual = max(self._virtual, item.tag)
        self._count -= 1
        self._head_left(item.tenant, flow)
        return item

    def remove(self, item: W) -> None:
        """Takes out a request that need not be the head (length-aware batching
        picks one near it); the virtual time moves to the head's tag, where
        service stands."""
        self._virtual = max(self._virtual, self[0].tag)
        flow = self._flows[item.tenant]
        self._count -= 1
        if flow[0] is item:
            flow.popleft()  # its entry in _heads is stale now
            self._head_left(item.tenant, flow)
        else:
            flow.remove(item)

    def _head_left(self, tenant: str, flow: collections.deque[W]) -> None:
        if flow:
            heapq.heappush(self._heads, (flow[0].tag, flow[0].seq, tenant))
        else:
            del self._flows[tenant], self._finish[tenant]

    def __iter__(self) -> Iterator[W]:
        return heapq.merge(*self._flows.values(), key=lambda item: (item.tag, item.seq))

    def clear(self) -> None:
        self._flows.clear()
        self._finish.clear()
        self._heads.clear()
        self._count = 0
