"""Fair share between tenants inside a priority level: the fair queue alone,
then through the batcher (which batches go out, who is refused when full)."""

import asyncio
import dataclasses
import random

import pytest

from services.batcher.core import Batcher, BatchingConfig
from services.batcher.fair import FairLevel
from services.common import errors
from tests.conftest import settle
from tests.test_batcher_core import GatedBackend, row, submit

pytestmark = pytest.mark.unit


@dataclasses.dataclass(eq=False)
class Item:
    tenant: str
    rows: int = 1
    weight: float = 1.0
    tag: float = 0.0
    seq: int = 0
    label: str = ""


def drain(level: FairLevel) -> list[Item]:
    taken = []
    while level:
        taken.append(level.popleft())
    return taken


def test_one_tenant_is_served_in_arrival_order():
    level = FairLevel()
    items = [Item("a", label=str(i)) for i in range(20)]
    for item in items:
        level.append(item)
    assert level[0] is items[0] and len(level) == 20
    assert drain(level) == items


def test_a_tenant_behind_a_flood_starts_next_not_after_it():
    level = FairLevel()
    for i in range(100):
        level.append(Item("flood", label=f"f{i}"))
    level.popleft()  # service is under way
    late = Item("light")
    level.append(late)
    order = drain(level)
    assert order.index(late) <= 1


@pytest.mark.parametrize("weights", [(1.0, 1.0), (2.0, 1.0), (5.0, 1.0)])
def test_backlogged_tenants_are_served_in_proportion_to_their_weights(weights):
    level = FairLevel()
    for tenant, weight in zip("ab", weights, strict=True):
        for _ in range(600):
            level.append(Item(tenant, rows=random.Random(len(tenant)).choice([1, 2]), weight=weight))
    served = {"a": 0, "b": 0}
    for _ in range(300):  # while both are backlogged
        item = level.popleft()
        served[item.tenant] += item.rows
    ratio = served["a"] / served["b"]
    expected = weights[0] / weights[1]
    assert abs(ratio - expected) <= 0.1 * expected, (served, weights)


def test_iteration_and_removal_keep_the_service_order():
    level = FairLevel()
    items = [Item("a" if i % 3 else "b", label=str(i)) for i in range(30)]
    for item in items:
        level.append(item)
    order = list(level)
    assert sorted(order, key=lambda item: (item.tag, item.seq)) == order and len(order) == 30
    chosen = order[5]  # as length-aware batching takes one near the head
    level.remove(chosen)
    head = level[0]
    level.remove(head)  # and the head itself
    rest = drain(level)
    assert chosen not in rest and head not in rest and len(rest) == 28
    assert rest == [item for item in order if item is not chosen and item is not head]


def test_only_tenants_with_requests_waiting_have_state():
    level = FairLevel()
    for i in range(10_000):  # names a caller could invent
        level.append(Item(f"tenant-{i}"))
        level.popleft()
    assert level.tenants() == 0 and not level._finish and len(level._heads) <= 1


async def test_the_batcher_serves_a_light_tenant_in_the_next_batch_past_a_flood():
    backend = GatedBackend(max_batch=4)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=0, max_queue_size=1000))
    flood = [submit(batcher, float(i), tenant="flood") for i in range(40)]
    await backend.started.wait()  # the first batch runs; 36 flood rows wait
    light = [submit(batcher, 100.0 + i, tenant="light") for i in range(2)]
    await settle()
    backend.gate.set()
    await asyncio.gather(*flood, *light)
    second = backend.batches[1]
    assert 100.0 in second and 101.0 in backend.batches[1] + backend.batches[2], backend.batches[:3]


async def test_a_flooder_that_filled_the_queue_cannot_lock_out_another_tenant():
    backend = GatedBackend(max_batch=1)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=4))
    running = submit(batcher, 0.0, tenant="flood")
    await backend.started.wait()
    queued = [submit(batcher, float(i), tenant="flood") for i in range(1, 5)]
    await settle()
    with pytest.raises(errors.ResourceExhausted, match="is full") as refused:
        await batcher.submit("m", "1", row(5.0), [], tenant="flood")
    assert refused.value.retry_after_ms > 0
    other = submit(batcher, 50.0, tenant="light")  # its share is half the places; it holds none
    await settle()
    assert not other.done()
    with pytest.raises(errors.ResourceExhausted, match="tenant 'flood' holds 4 of them, its share is 2"):
        await batcher.submit("m", "1", row(6.0), [], tenant="flood")
    backend.gate.set()
    await asyncio.gather(running, *queued, other)
    assert backend.batches.index([50.0]) <= 2


async def test_tenant_fields_from_a_caller_are_bounded():
    backend = GatedBackend()
    backend.gate.set()
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=0))
    with pytest.raises(errors.InvalidArgument, match="field 'tenant' is 257 characters long"):
        await batcher.submit("m", "1", row(1.0), [], tenant="x" * 257)
    for weight in (float("nan"), -1.0, 1e9):
        with pytest.raises(errors.InvalidArgument, match="field 'tenant_weight' must be in"):
            await batcher.submit("m", "1", row(1.0), [], tenant="t", weight=weight)
    await batcher.submit("m", "1", row(1.0), [], tenant="t", weight=0.0)  # 0 counts as 1
