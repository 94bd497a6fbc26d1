"""The model server's priority gate in plain asyncio."""

import asyncio

import prometheus_client
import pytest

from services.model_server.execution import NoTurn, TierGate
from tests.conftest import settle

pytestmark = pytest.mark.unit


async def test_waiting_batches_run_vip_first_then_in_order():
    gate = TierGate()
    ran: list[str] = []
    hold = asyncio.Event()

    async def batch(name: str, tier: int, wait: asyncio.Event | None = None):
        async with gate.turn(tier):
            ran.append(name)
            if wait is not None:
                await wait.wait()

    first = asyncio.create_task(batch("running", 0, hold))
    await asyncio.sleep(0)
    waiting = [
        asyncio.create_task(batch(name, tier))
        for name, tier in (("std-1", 0), ("vip-1", 1), ("std-2", 0), ("vip-2", 1))
    ]
    await asyncio.sleep(0)
    assert gate.waiting == 4  # the queue the autoscaler reads
    hold.set()
    await asyncio.gather(first, *waiting)
    assert ran == ["running", "vip-1", "vip-2", "std-1", "std-2"]
    assert gate.waiting == 0


async def test_a_cancelled_waiter_does_not_block_the_gate():
    gate = TierGate()
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
    gate = TierGate()
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
    old, new = TierGate(queued=queued), TierGate(queued=queued)
    hold = asyncio.Event()

    async def batch(gate: TierGate):
        async with gate.turn(0):
            await hold.wait()

    tasks = [asyncio.create_task(batch(gate)) for gate in (old, old, old, new, new)]
    await asyncio.sleep(0)
    assert (old.waiting, new.waiting, queued._value.get()) == (2, 1, 3)
    hold.set()
    await asyncio.gather(*tasks)
    assert queued._value.get() == 0


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Batches:
    """Batches through one gate, each recording (name, instance) when it gets its
    turn and holding the instance until the test lets it finish."""

    def __init__(self, gate: TierGate):
        self.gate = gate
        self.ran: list[tuple[str, int]] = []
        self._done: dict[str, asyncio.Event] = {}

    def start(self, name: str, tier: int = 0) -> asyncio.Task:
        self._done[name] = asyncio.Event()
        return asyncio.create_task(self._batch(name, tier))

    def finish(self, *names: str) -> None:
        for name in names:
            self._done[name].set()

    async def _batch(self, name: str, tier: int) -> None:
        async with self.gate.turn(tier) as instance:
            self.ran.append((name, instance))
            await self._done[name].wait()


async def test_a_reserved_instance_is_lent_after_a_lull_and_reserved_again_once_vip_comes():
    clock = Clock()
    gate = TierGate(2, reserved=1, lend_after_s=10, clock=clock)
    batches = Batches(gate)
    a, b = batches.start("a"), batches.start("b")
    await settle()
    assert batches.ran == [("a", 0)] and gate.waiting == 1  # instance 1 is kept for VIP
    assert not gate.lending() and gate.usable(0) == 1
    clock.now = 10.0  # no VIP batch since the gate was made
    assert gate.lending() and gate.usable(0) == 2
    c = batches.start("c")
    await settle()
    assert batches.ran == [("a", 0), ("b", 1)] and gate.waiting == 1  # the batch that waited goes first, on loan
    assert gate.lent(1, 0) and not gate.lent(0, 0)
    clock.now = 11.0
    vip = batches.start("vip", tier=1)
    await settle()
    assert not gate.lending() and gate.waiting == 2  # the reservation holds from the VIP batch's arrival on
    batches.finish("b")  # the lent instance comes back: to the VIP batch, not to c
    await b
    await settle()
    assert batches.ran[-1] == ("vip", 1) and gate.waiting == 1
    batches.finish("vip")
    await vip
    assert gate.waiting == 1  # c may not use the reserved instance within 10 s of a VIP batch
    batches.finish("a", "c")
    await asyncio.gather(a, c)
    assert batches.ran == [("a", 0), ("b", 1), ("vip", 1), ("c", 0)]


async def test_a_standard_batch_on_loan_takes_a_general_instance_first():
    gate = TierGate(2, reserved=1, lend_after_s=0, clock=Clock())
    async with gate.turn(0) as first, gate.turn(0) as second:
        assert (first, second) == (0, 1)
    async with gate.turn(1) as vip:
        assert vip == 1  # a VIP batch takes the reserved instance first, leaving the general one


async def test_without_lend_after_s_a_reserved_instance_is_never_lent():
    clock = Clock()
    gate = TierGate(2, reserved=1, clock=clock)
    clock.now = 1e9
    assert not gate.lending() and gate.usable(0) == 1
    async with gate.turn(0) as instance:
        assert instance == 0
        with pytest.raises(NoTurn):
            async with gate.turn(0, wait_s=0):
                pass


async def test_when_lending_begins_a_release_hands_on_the_reserved_instance_too():
    """Lending begins with time passing; the next release (no new batch needed)
    hands out the idle reserved instance as well as its own."""
    clock = Clock()
    gate = TierGate(2, reserved=1, lend_after_s=10, clock=clock)
    batches = Batches(gate)
    tasks = [batches.start(name) for name in ("a", "b", "c")]
    await settle()
    assert batches.ran == [("a", 0)] and gate.waiting == 2
    clock.now = 20.0
    batches.finish("a")
    await settle()
    assert batches.ran == [("a", 0), ("b", 0), ("c", 1)] and gate.waiting == 0
    batches.finish("b", "c")
    await asyncio.gather(*tasks)


async def test_a_caller_batch_arriving_when_lending_begins_goes_ahead_of_a_waiting_lower_one():
    """The golden probe runs below callers: when lending begins as a standard batch
    arrives, the free reserved instance goes to that batch, not to the waiting probe."""
    clock = Clock()
    gate = TierGate(2, reserved=1, lend_after_s=10, clock=clock)
    batches = Batches(gate)
    a, probe = batches.start("a", 0), batches.start("probe", -1)
    await settle()
    clock.now = 20.0
    caller = batches.start("caller", 0)
    await settle()
    assert batches.ran == [("a", 0), ("caller", 1)] and gate.waiting == 1
    batches.finish("a", "probe", "caller")
    await asyncio.gather(a, probe, caller)
    assert batches.ran[-1][0] == "probe"
