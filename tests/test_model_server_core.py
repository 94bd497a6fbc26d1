"""The model server's priority gate in plain asyncio."""

import asyncio

import prometheus_client
import pytest

from services.model_server.execution import NoTurn, PriorityGate


async def test_waiting_batches_run_vip_first_then_in_order():
    gate = PriorityGate()
    ran: list[str] = []
    hold = asyncio.Event()

    async def batch(name: str, priority: int, wait: asyncio.Event | None = None):
        async with gate.turn(priority):
            ran.append(name)
            if wait is not None:
                await wait.wait()

    first = asyncio.create_task(batch("running", 0, hold))
    await asyncio.sleep(0)
    waiting = [asyncio.create_task(batch(name, priority)) for name, priority in
               (("std-1", 0), ("vip-1", 1), ("std-2", 0), ("vip-2", 1))]
    await asyncio.sleep(0)
    assert gate.waiting == 4  # the queue the autoscaler reads
    hold.set()
    await asyncio.gather(first, *waiting)
    assert ran == ["running", "vip-1", "vip-2", "std-1", "std-2"]
    assert gate.waiting == 0


async def test_a_cancelled_waiter_does_not_block_the_gate():
    gate = PriorityGate()
    hold = asyncio.Event()
    ran: list[str] = []

    async def batch(name: str, wait: asyncio.Event | None = None):
        async with gate.turn(0):
            ran.append(name)
            if wait is not None:
                await wait.wait()

    first = asyncio.create_task(batch("running", hold))
    await asyncio.sleep(0)
    gone = asyncio.create_task(batch("gone"))
    after = asyncio.create_task(batch("after"))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    assert gate.waiting == 1  # a caller that left is no longer counted
    hold.set()
    await asyncio.gather(first, after)
    assert ran == ["running", "after"]
    assert gate.waiting == 0


async def test_a_waiter_with_a_time_limit_gives_up_and_leaves_the_gate_working():
    gate = PriorityGate()
    hold = asyncio.Event()
    ran: list[str] = []

    async def batch(name: str, wait_s=None, until: asyncio.Event | None = None):
        async with gate.turn(0, wait_s):
            ran.append(name)
            if until is not None:
                await until.wait()

    first = asyncio.create_task(batch("running", until=hold))
    await asyncio.sleep(0)
    with pytest.raises(NoTurn):
        await batch("in a hurry", wait_s=0)
    after = asyncio.create_task(batch("after"))
    await asyncio.sleep(0)
    assert gate.waiting == 1
    hold.set()
    await asyncio.gather(first, after)
    assert ran == ["running", "after"] and gate.waiting == 0


async def test_two_loads_of_one_version_add_to_one_queue_gauge():
    """During a reload the old and the new load of a version share one gauge
    label: each adds its own waiters instead of overwriting the other's count."""
    queued = prometheus_client.Gauge("queued_batches", "test", registry=prometheus_client.CollectorRegistry())
    old, new = PriorityGate(queued=queued), PriorityGate(queued=queued)
    hold = asyncio.Event()

    async def batch(gate: PriorityGate):
        async with gate.turn(0):
            await hold.wait()

    tasks = [asyncio.create_task(batch(gate)) for gate in (old, old, old, new, new)]
    await asyncio.sleep(0)
    assert (old.waiting, new.waiting, queued._value.get()) == (2, 1, 3)  # noqa: SLF001
    hold.set()
    await asyncio.gather(*tasks)
    assert queued._value.get() == 0  # noqa: SLF001
