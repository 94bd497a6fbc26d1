"""The batching policy in plain asyncio: gates, no sleeps on the happy path."""

import asyncio

import numpy as np
import prometheus_client
import pytest

from services.batcher.admission import ServiceRate
from services.batcher.core import Batcher, BatchingConfig, LevelPolicy, ModelLimits, QueuePolicy
from services.common import errors
from services.common.latency import CAUTIOUS_DEVIATIONS, MovingTime
from services.common.tensors import TensorData, from_numpy, to_numpy
from services.common.tier import Tier
from tests.conftest import settle

pytestmark = pytest.mark.unit


class GatedBackend:
    """Records each batch and holds it until the test opens the gate. It runs
    no model: these tests are about which requests form which batch."""

    def __init__(self, max_batch: int = 4, capacity: int = 1, reserved: int = 1):
        self._max_batch = max_batch
        self._capacity = capacity
        self._reserved = reserved  # 0: one shared instance, VIP and standard batches take turns on it
        self.batches: list[list[float]] = []
        self.timeouts: list[float] = []  # the time each batch was given to finish
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        self.poison = None

    def limits(self, model):
        return ModelLimits(self._max_batch, ("X",)) if model == "m" else None

    def slots(self, model):
        return self._capacity, self._reserved, self._capacity  # one replica: VIP work reaches every slot

    def on_change(self, listener):
        pass

    async def execute(self, model, version, inputs, outputs, timeout_s, tier=Tier.STANDARD):
        values = to_numpy(inputs[0])[:, 0].tolist()
        self.batches.append(values)
        self.timeouts.append(timeout_s)
        self.started.set()
        await self.gate.wait()
        if self.poison is not None and self.poison in values:
            raise errors.InvalidArgument(f"value {self.poison} cannot be processed")
        return "1", [from_numpy("Y", to_numpy(inputs[0]) * 2)]


def row(value: float):
    return [from_numpy("X", np.array([[value]], dtype=np.float32))]


def submit(batcher, value, **kwargs):
    return asyncio.create_task(batcher.submit("m", "1", row(value), [], **kwargs))


async def test_full_batches_go_out_at_once_and_results_fan_back_in_order():
    backend = GatedBackend(max_batch=4)
    backend.gate.set()
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=60_000, max_queue_size=100))
    tasks = [submit(batcher, float(i)) for i in range(8)]
    results = await asyncio.gather(*tasks)
    assert backend.batches == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [float(to_numpy(out[0])[0, 0]) for _, out in results] == [2.0 * i for i in range(8)]


async def test_while_a_batch_runs_a_partial_batch_leaves_after_the_queue_delay():
    backend = GatedBackend(max_batch=8, capacity=2)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=8, max_queue_delay_ms=20, max_queue_size=100))
    running = submit(batcher, 0.0)
    await backend.started.wait()  # the model is busy, so the next batch waits for company
    backend.started.clear()
    waiting = [submit(batcher, 1.0), submit(batcher, 2.0)]
    await asyncio.wait_for(backend.started.wait(), timeout=5)  # ... but only max_queue_delay_ms
    assert backend.batches == [[0.0], [1.0, 2.0]]
    backend.gate.set()
    await asyncio.gather(running, *waiting)


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("fixed", [[0.0, 1.0, 2.0, 3.0]]),  # everything waiting, on one instance
        ("adaptive", [[0.0, 1.0], [2.0, 3.0]]),  # half each on two: done in half the time
    ],
)
async def test_the_adaptive_policy_spreads_a_short_queue_over_the_free_instances(policy, expected):
    backend = GatedBackend(max_batch=4, capacity=2)
    batcher = Batcher(
        backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=60_000, max_queue_size=100, batch_policy=policy)
    )
    learned = batcher._queue("m", "1").batch_policy
    learned.observe_batch(1, 0.012)  # what batches took before: 12 ms a row alone, 8 ms in fours
    learned.observe_batch(4, 0.032)
    tasks = [submit(batcher, float(i)) for i in range(4)]
    await settle()
    assert backend.batches == expected
    backend.gate.set()
    await asyncio.gather(*tasks)


async def test_vip_goes_first_and_fifo_holds_within_a_level():
    backend = GatedBackend(max_batch=2, reserved=0)  # no slot of VIP's own: the order decides
    batcher = Batcher(backend, BatchingConfig(max_batch_size=2, max_queue_delay_ms=0, max_queue_size=100))
    blocker = submit(batcher, 0.0)
    await backend.started.wait()  # the only slot is busy from now on
    waiting = [
        submit(batcher, 1.0),
        submit(batcher, 2.0, tier=Tier.VIP),
        submit(batcher, 3.0),
        submit(batcher, 4.0, tier=Tier.VIP),
    ]
    await settle()
    backend.gate.set()
    await asyncio.gather(blocker, *waiting)
    assert backend.batches == [[0.0], [2.0, 4.0], [1.0, 3.0]]


async def test_a_full_queue_rejects_at_once_with_resource_exhausted():
    backend = GatedBackend(max_batch=1)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=2))
    running = submit(batcher, 0.0)
    await backend.started.wait()
    queued = [submit(batcher, 1.0), submit(batcher, 2.0)]
    await settle()
    with pytest.raises(errors.ResourceExhausted, match="queue of model 'm' is full"):
        await batcher.submit("m", "1", row(3.0), [])
    backend.gate.set()
    await asyncio.gather(running, *queued)


async def test_expired_requests_are_answered_and_never_run():
    backend = GatedBackend(max_batch=4)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=0, max_queue_size=100))
    running = submit(batcher, 0.0)
    await backend.started.wait()
    late = submit(batcher, 1.0, timeout_s=0.001)
    on_time = submit(batcher, 2.0, timeout_s=60)
    await asyncio.sleep(0.01)  # let the first deadline pass while the slot is busy
    backend.gate.set()
    with pytest.raises(errors.DeadlineExceeded, match="past its deadline; it was not run"):
        await late
    await asyncio.gather(running, on_time)
    assert backend.batches == [[0.0], [2.0]]


async def test_cancelled_requests_are_dropped_before_the_model():
    backend = GatedBackend(max_batch=4)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=0, max_queue_size=100))
    running = submit(batcher, 0.0)
    await backend.started.wait()
    gone = submit(batcher, 1.0)
    stays = submit(batcher, 2.0)
    await settle()
    gone.cancel()
    await settle()
    backend.gate.set()
    await asyncio.gather(running, stays)
    assert backend.batches == [[0.0], [2.0]]


async def test_one_bad_request_does_not_fail_its_batch_neighbours():
    backend = GatedBackend(max_batch=4)
    backend.poison = 13.0
    backend.gate.set()
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=60_000, max_queue_size=100))
    tasks = [submit(batcher, v) for v in (1.0, 13.0, 3.0, 4.0)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[1], errors.InvalidArgument)
    assert [float(to_numpy(r[1][0])[0, 0]) for i, r in enumerate(results) if i != 1] == [2.0, 6.0, 8.0]
    assert backend.batches[0] == [1.0, 13.0, 3.0, 4.0]


async def test_a_request_whose_data_cannot_fill_its_shape_is_refused_before_it_joins_a_batch():
    """A direct caller's request that the router would refuse never reaches a
    batch, where it would fail its neighbours' first try."""
    backend = GatedBackend(max_batch=4)
    backend.gate.set()
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=0, max_queue_size=100))
    short = [TensorData("X", "FP32", (1, 1), b"\0\0")]
    with pytest.raises(errors.InvalidArgument, match=r"input 'X' of model 'm' has 2 bytes of data but shape \[1, 1\]"):
        await batcher.submit("m", "1", short, [])
    assert backend.batches == []
    await asyncio.gather(submit(batcher, 1.0))
    assert backend.batches == [[1.0]]


class RefusingBackend(GatedBackend):
    """A model server with no room: it refuses every batch with a retry hint
    (hint_ms 0: gRPC's own RESOURCE_EXHAUSTED, e.g. a message over its size limit)."""

    def __init__(self, hint_ms: int, **kwargs):
        super().__init__(**kwargs)
        self.hint_ms = hint_ms

    async def execute(self, model, version, inputs, outputs, timeout_s, tier=Tier.STANDARD):
        self.batches.append(to_numpy(inputs[0])[:, 0].tolist())
        raise errors.ResourceExhausted("no time left for this batch", retry_after_ms=self.hint_ms)


async def test_a_refused_batch_is_answered_as_refused_not_split_into_more_calls():
    backend = RefusingBackend(40, max_batch=4)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=60_000, max_queue_size=100))
    results = await asyncio.gather(*(submit(batcher, float(v)) for v in range(4)), return_exceptions=True)
    assert backend.batches == [[0.0, 1.0, 2.0, 3.0]]  # one call: four more would only add to the load
    assert all(isinstance(r, errors.ResourceExhausted) and r.retry_after_ms == 40 for r in results)


async def test_resource_exhausted_without_a_hint_is_about_the_batch_itself_so_it_is_split():
    backend = RefusingBackend(0, max_batch=4)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=60_000, max_queue_size=100))
    results = await asyncio.gather(*(submit(batcher, float(v)) for v in range(4)), return_exceptions=True)
    assert backend.batches == [[0.0, 1.0, 2.0, 3.0], [0.0], [1.0], [2.0], [3.0]]  # finds the request at fault
    assert all(isinstance(r, errors.ResourceExhausted) for r in results)


class VanishingBackend(GatedBackend):
    """Its one replica can go away: then it has no slots, and a batch sent
    anyway is answered UNAVAILABLE, as ReplicaSet does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gone = False

    def slots(self, model):
        return (0, 0, 0) if self.gone else super().slots(model)

    async def execute(self, model, version, inputs, outputs, timeout_s, tier=Tier.STANDARD):
        if self.gone:
            raise errors.Unavailable(f"no ready model_server replica serves model '{model}'")
        return await super().execute(model, version, inputs, outputs, timeout_s, tier)


async def test_requests_waiting_for_a_slot_when_the_last_replica_goes_hear_unavailable_at_once():
    """Not a wait until their deadlines: the router falls back or fails fast on UNAVAILABLE."""
    backend = VanishingBackend(max_batch=1)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=10))
    running = submit(batcher, 0.0)
    await backend.started.wait()
    waiting = submit(batcher, 1.0)  # no slot: it waits in the queue
    await settle()
    backend.gone = True
    backend.gate.set()
    await running
    with pytest.raises(errors.Unavailable, match="no ready model_server replica serves model 'm'"):
        await asyncio.wait_for(waiting, 5)


class OutOfTimeBackend(GatedBackend):
    """Its batches run past their deadline at the model server, which the
    batcher's RPC reports as gRPC's own DEADLINE_EXCEEDED."""

    async def execute(self, model, version, inputs, outputs, timeout_s, tier=Tier.STANDARD):
        self.batches.append(to_numpy(inputs[0])[:, 0].tolist())
        raise errors.DeadlineExceeded("Deadline Exceeded")


async def test_a_batch_that_runs_out_of_time_after_it_was_sent_is_counted_and_logged(caplog):
    count = (
        prometheus_client.REGISTRY.get_sample_value(
            "infermesh_batcher_batch_timeouts_total", {"model": "m", "tier": "standard"}
        )
        or 0.0
    )
    backend = OutOfTimeBackend(max_batch=2)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=2, max_queue_delay_ms=60_000, max_queue_size=10))
    results = await asyncio.gather(submit(batcher, 1.0), submit(batcher, 2.0), return_exceptions=True)
    assert all(isinstance(r, errors.DeadlineExceeded) for r in results)
    assert backend.batches == [[1.0, 2.0]]  # no time is left to run them one by one
    assert (
        prometheus_client.REGISTRY.get_sample_value(
            "infermesh_batcher_batch_timeouts_total", {"model": "m", "tier": "standard"}
        )
        == count + 1
    )
    assert "batch of 2 rows for model m (standard) ran out of its" in caplog.text
    assert "the tier's batches take about (no estimate yet)" in caplog.text


class VipPoolOnlyBackend(GatedBackend):
    """Under a traffic policy whose standard route reaches no ready replica
    while the VIP pool is up: no general slots, one for VIP work; a standard
    batch sent anyway is answered as Envoy answers "no healthy upstream"."""

    def slots(self, model):
        return 0, 1, 0

    async def execute(self, model, version, inputs, outputs, timeout_s, tier=Tier.STANDARD):
        if tier < Tier.VIP:
            raise errors.Unavailable(f"no healthy upstream for model '{model}' in subset 'blue'")
        return await super().execute(model, version, inputs, outputs, timeout_s, tier)


async def test_with_no_replica_on_the_standard_route_standard_work_hears_unavailable_at_once_and_vip_work_runs():
    backend = VipPoolOnlyBackend(max_batch=1)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=10))
    first_vip = submit(batcher, 0.0, tier=Tier.VIP)
    await backend.started.wait()
    with pytest.raises(errors.Unavailable, match="no healthy upstream"):  # not held for a slot it can never get
        await asyncio.wait_for(submit(batcher, 1.0), 5)
    second_vip = submit(batcher, 2.0, tier=Tier.VIP)  # waits for the VIP slot, and takes no other
    await settle()
    assert backend.batches == [[0.0]]
    backend.gate.set()
    assert [to_numpy((await call)[1][0])[:, 0].tolist() for call in (first_vip, second_vip)] == [[0.0], [4.0]]


class PoolsBackend(GatedBackend):
    """Istio's VIP-pool route: a standard pool and a VIP pool of one slot each,
    and VIP batches reach only their own pool."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.priorities = []

    def slots(self, model):
        return 1, 1, 0

    async def execute(self, model, version, inputs, outputs, timeout_s, tier=Tier.STANDARD):
        self.priorities.append(tier)
        return await super().execute(model, version, inputs, outputs, timeout_s, tier)


async def test_a_vip_batch_does_not_take_a_slot_of_a_pool_its_route_cannot_reach():
    """While the VIP pool is busy a VIP request waits for it, not on the
    standard pool's slot (where it would wait for its own pool all the same,
    holding that slot); standard requests take that slot, in a batch of their
    own that the waiting VIP request does not join."""
    backend = PoolsBackend(max_batch=4)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=0, max_queue_size=10))
    first_vip = submit(batcher, 0.0, tier=Tier.VIP)
    await backend.started.wait()
    second_vip = submit(batcher, 1.0, tier=Tier.VIP)
    await settle()
    assert backend.batches == [[0.0]]
    standard = [submit(batcher, 2.0), submit(batcher, 3.0)]
    await settle()
    assert backend.batches == [[0.0], [2.0, 3.0]] and backend.priorities == [Tier.VIP, Tier.STANDARD]
    backend.gate.set()
    await asyncio.gather(first_vip, second_vip, *standard)
    assert backend.batches[2:] == [[1.0]] and backend.priorities[2:] == [Tier.VIP]


async def test_a_request_larger_than_the_batch_size_runs_alone_up_to_the_model_limit():
    backend = GatedBackend(max_batch=4)
    backend.gate.set()
    batcher = Batcher(backend, BatchingConfig(max_batch_size=2, max_queue_delay_ms=0, max_queue_size=10))
    inputs = [from_numpy("X", np.arange(3, dtype=np.float32).reshape(3, 1))]
    _version, (out,) = await batcher.submit("m", "1", inputs, [])
    assert to_numpy(out)[:, 0].tolist() == [0.0, 2.0, 4.0] and backend.batches == [[0.0, 1.0, 2.0]]
    too_big = [from_numpy("X", np.zeros((5, 1), dtype=np.float32))]
    with pytest.raises(errors.InvalidArgument, match="request of 5 rows exceeds max_batch_size 4 of model 'm'"):
        await batcher.submit("m", "1", too_big, [])


async def test_unknown_models_bad_priorities_and_wrong_inputs_never_reach_a_queue():
    batcher = Batcher(GatedBackend(), BatchingConfig(max_batch_size=2, max_queue_delay_ms=0, max_queue_size=10))
    with pytest.raises(errors.Unavailable, match="no ready model_server replica serves model 'nope'"):
        await batcher.submit("nope", "1", row(1.0), [])
    with pytest.raises(errors.InvalidArgument, match="tier 5 is not a Tier value"):
        await batcher.submit("m", "1", row(1.0), [], tier=5)
    with pytest.raises(errors.InvalidArgument, match=r"model 'm' takes inputs \['X'\], got \['Y'\]"):
        await batcher.submit("m", "1", [from_numpy("Y", np.zeros((1, 1), np.float32))], [])
    assert batcher.queue_length() == 0 and not batcher._queues


async def test_idle_queues_hold_no_execution_slot():
    backend = GatedBackend(max_batch=1, capacity=1)
    backend.gate.set()
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=10))
    await batcher.submit("m", "1", row(1.0), [])
    # Version 2 gets its own queue; version 1's idle queue must not keep the only slot.
    await asyncio.wait_for(batcher.submit("m", "2", row(2.0), []), timeout=5)
    await asyncio.wait_for(batcher.submit("m", "1", row(3.0), []), timeout=5)


async def test_a_deadline_passing_while_the_batch_runs_does_not_claim_it_never_ran():
    backend = GatedBackend(max_batch=1)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=10))
    task = submit(batcher, 1.0, timeout_s=0.01)
    await backend.started.wait()
    await asyncio.sleep(0.03)  # the queue deadline passes while the model runs it
    backend.gate.set()
    _version, (out,) = await task
    assert float(to_numpy(out)[0, 0]) == 2.0


async def test_a_batch_runs_by_its_latest_requests_deadline():
    """By its earliest, the model server would refuse a patient request (a VIP one in a batch
    an aged standard request leads, say) along with the impatient ones beside it."""
    backend = GatedBackend(max_batch=2)
    backend.gate.set()
    batcher = Batcher(
        backend, BatchingConfig(max_batch_size=2, max_queue_delay_ms=60_000, max_queue_size=10, default_timeout_s=30)
    )
    await asyncio.gather(submit(batcher, 1.0, timeout_s=5), submit(batcher, 2.0, timeout_s=20))
    await asyncio.gather(submit(batcher, 3.0), submit(batcher, 4.0, timeout_s=5))  # one with no deadline of its own
    assert backend.batches == [[1.0, 2.0], [3.0, 4.0]]
    assert [round(t) for t in backend.timeouts] == [20, 30]


async def test_close_answers_everything_still_queued():
    backend = GatedBackend(max_batch=1)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=10))
    running = submit(batcher, 0.0)
    await backend.started.wait()
    queued = submit(batcher, 1.0)
    await settle()
    backend.gate.set()
    await batcher.close()
    results = await asyncio.gather(running, queued, return_exceptions=True)
    assert float(to_numpy(results[0][1][0])[0, 0]) == 0.0
    assert isinstance(results[1], errors.Unavailable) and "shutting down" in results[1].message


async def test_an_idle_model_gets_a_lone_request_at_once_without_waiting_for_company():
    backend = GatedBackend(max_batch=8)
    backend.gate.set()
    batcher = Batcher(backend, BatchingConfig(max_batch_size=8, max_queue_delay_ms=60_000, max_queue_size=100))
    await asyncio.wait_for(batcher.submit("m", "1", row(1.0), []), timeout=5)
    assert backend.batches == [[1.0]]


async def test_while_a_batch_runs_the_next_one_waits_for_company():
    backend = GatedBackend(max_batch=8, capacity=2)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=8, max_queue_delay_ms=60_000, max_queue_size=100))
    first = submit(batcher, 0.0)
    await backend.started.wait()
    rest = [submit(batcher, float(v)) for v in range(1, 9)]  # a free slot, but a batch is running
    backend.gate.set()
    await asyncio.gather(first, *rest)
    assert backend.batches == [[0.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]]


async def test_a_vip_batch_does_not_wait_for_company_behind_standard_batches():
    backend = GatedBackend(max_batch=8, capacity=2)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=8, max_queue_delay_ms=60_000, max_queue_size=100))
    standard = submit(batcher, 0.0)
    await backend.started.wait()
    backend.started.clear()
    vip = submit(batcher, 1.0, tier=Tier.VIP)  # its reserved instance is idle: nothing to wait for
    await asyncio.wait_for(backend.started.wait(), timeout=5)
    backend.started.clear()
    later = [submit(batcher, float(v), tier=Tier.VIP) for v in range(2, 5)]  # behind a VIP batch they wait ...
    await settle()
    assert backend.batches == [[0.0], [1.0]]
    later += [submit(batcher, float(v), tier=Tier.VIP) for v in range(5, 10)]  # ... until their batch is full
    backend.gate.set()
    await asyncio.gather(standard, vip, *later)
    assert backend.batches == [[0.0], [1.0], [float(v) for v in range(2, 10)]]


async def test_each_level_has_its_own_bound_and_a_full_one_says_when_to_retry():
    backend = GatedBackend(max_batch=1)
    policy = QueuePolicy({Tier.VIP: LevelPolicy(2, 30), Tier.STANDARD: LevelPolicy(1, 30)})
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, policy=policy))
    running = submit(batcher, 0.0)
    await backend.started.wait()
    vip_running = submit(batcher, 2.0, tier=Tier.VIP)
    await settle()
    assert backend.batches == [[0.0], [2.0]]  # sent at once, on the slot reserved for VIP work
    queued = [
        vip_running,
        submit(batcher, 1.0),
        submit(batcher, 3.0, tier=Tier.VIP),
        submit(batcher, 4.0, tier=Tier.VIP),
    ]
    await settle()
    with pytest.raises(errors.ResourceExhausted, match="the standard queue of model 'm' is full") as info:
        await batcher.submit("m", "1", row(4.0), [])
    assert info.value.retry_after_ms >= 10 and "retry after about" in info.value.message
    with pytest.raises(errors.ResourceExhausted, match="the vip queue"):
        await batcher.submit("m", "1", row(5.0), [], tier=Tier.VIP)
    backend.gate.set()
    await asyncio.gather(running, *queued)


async def test_a_request_that_could_no_longer_finish_in_time_is_refused_not_left_to_time_out():
    backend = GatedBackend(max_batch=1)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=10))
    backend.gate.set()
    await submit(batcher, 0.0)  # the tier's batches take about nothing: refused 25 ms before the deadline
    backend.gate.clear()
    running = submit(batcher, 1.0)
    await settle()
    loop = asyncio.get_running_loop()
    sent = loop.time()
    with pytest.raises(errors.ResourceExhausted, match=r"has \d+ ms left, less than its batch would take"):
        await submit(batcher, 2.0, timeout_s=0.2)
    assert loop.time() - sent < 0.2  # while its caller still waits for an answer
    backend.gate.set()
    await running
    assert backend.batches == [[0.0], [1.0]]


async def test_with_nothing_running_a_tight_deadline_is_not_refused_on_a_stale_estimate():
    """After slow batches, a request with less time than they took still runs
    when the model is idle: only what runs would bring the estimate down."""
    backend = GatedBackend(max_batch=1)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=10))
    slow = submit(batcher, 0.0)
    await backend.started.wait()
    await asyncio.sleep(0.1)  # the tier learns that a batch takes 100 ms
    backend.gate.set()
    await slow
    _, (out,) = await submit(batcher, 1.0, timeout_s=0.05)
    assert to_numpy(out)[0, 0] == 2.0


async def test_a_level_default_timeout_bounds_requests_without_a_tighter_deadline():
    backend = GatedBackend(max_batch=1)
    policy = QueuePolicy({Tier.VIP: LevelPolicy(10, 30), Tier.STANDARD: LevelPolicy(10, 0.01)})
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, policy=policy))
    running = submit(batcher, 0.0)  # holds the one slot a standard batch may take
    await backend.started.wait()
    patient = submit(batcher, 1.0, timeout_s=60)  # asks for a minute; its level allows 10 ms
    with pytest.raises(errors.DeadlineExceeded):
        await patient
    backend.gate.set()
    await running


async def test_aging_lets_standard_requests_alternate_with_a_steady_vip_stream():
    backend = GatedBackend(max_batch=1)
    policy = QueuePolicy.uniform(100, 30, aging_s=0.02)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, policy=policy))
    # VIP work fills the slot reserved for it and, by strict priority, the ordinary one.
    running = [submit(batcher, 0.0, tier=Tier.VIP), submit(batcher, 0.5, tier=Tier.VIP)]
    await settle()
    standard = [submit(batcher, 1.0), submit(batcher, 2.0)]
    await asyncio.sleep(0.03)  # the standard requests age past the bound
    vips = [submit(batcher, 10.0 + i, tier=Tier.VIP) for i in range(3)]
    await settle()
    backend.gate.set()
    await asyncio.gather(*running, *standard, *vips)
    # The reserved slot goes to VIP work only (an aged standard request must not take it:
    # it would leave the VIP request waiting behind a standard batch), while on the
    # ordinary slot aged standard requests now alternate with VIP ones.
    assert backend.batches == [[0.0], [0.5], [10.0], [1.0], [11.0], [2.0], [12.0]]


async def test_a_standard_backlog_does_not_push_vip_back():
    backend = GatedBackend(max_batch=1, reserved=0)
    policy = QueuePolicy.uniform(100, 30, aging_s=0.0)  # every standard request is "aged"
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, policy=policy))
    running = submit(batcher, 0.0)
    await backend.started.wait()
    standard = [submit(batcher, float(i)) for i in range(1, 4)]
    vip = submit(batcher, 10.0, tier=Tier.VIP)
    await settle()
    backend.gate.set()
    await asyncio.gather(running, *standard, vip)
    assert backend.batches[1] == [10.0]  # the last batch was standard-led: VIP goes next


async def test_a_vip_led_batch_carries_vip_requests_only():
    backend = GatedBackend(max_batch=4, reserved=0)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=0, max_queue_size=100))
    running = submit(batcher, 0.0)
    await backend.started.wait()
    waiting = [submit(batcher, 1.0), submit(batcher, 2.0, tier=Tier.VIP), submit(batcher, 3.0)]
    await settle()
    backend.gate.set()
    await asyncio.gather(running, *waiting)
    # Not [2, 1, 3]: filled up with standard rows, the VIP batch would run as long as theirs.
    assert backend.batches == [[0.0], [2.0], [1.0, 3.0]]


async def test_a_vip_request_does_not_wait_in_a_standard_batch_gathering_company():
    """Its reserved slot is free: it goes at once, not into the standard batch
    that waits out --max-queue-delay-ms (and would then run a standard batch's time)."""
    backend = GatedBackend(max_batch=8, capacity=2)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=8, max_queue_delay_ms=60_000, max_queue_size=100))
    tasks = [submit(batcher, 0.0)]
    await backend.started.wait()  # a batch runs: the next one waits for company
    tasks += [submit(batcher, 1.0), submit(batcher, 2.0)]
    await settle()
    assert backend.batches == [[0.0]]
    tasks.append(submit(batcher, 10.0, tier=Tier.VIP))
    await settle()
    assert backend.batches == [[0.0], [1.0, 2.0], [10.0]]
    backend.gate.set()
    await asyncio.gather(*tasks)


async def test_without_a_slot_of_its_own_a_vip_request_joins_the_gathering_batch():
    """On one shared instance the batch gathering company is the VIP request's
    quickest way out: it rides along, after the standard requests already there."""
    backend = GatedBackend(max_batch=8, capacity=2, reserved=0)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=8, max_queue_delay_ms=20, max_queue_size=100))
    tasks = [submit(batcher, 0.0)]
    await backend.started.wait()
    backend.started.clear()
    tasks.append(submit(batcher, 1.0))
    await settle()  # taken as the next batch's lead, gathering company
    tasks.append(submit(batcher, 10.0, tier=Tier.VIP))
    await asyncio.wait_for(backend.started.wait(), timeout=5)
    assert backend.batches == [[0.0], [1.0, 10.0]]
    backend.gate.set()
    await asyncio.gather(*tasks)


async def test_an_aged_standard_turn_carries_standard_rows_first():
    """The aging bound's turn is standard traffic's: filled with VIP rows first
    it would carry one standard row a turn."""
    backend = GatedBackend(max_batch=4, reserved=0)
    policy = QueuePolicy.uniform(100, 30, aging_s=0.02)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=0, policy=policy))
    tasks = [submit(batcher, 100.0, tier=Tier.VIP)]
    await backend.started.wait()  # the last batch was VIP-led
    tasks += [submit(batcher, float(i)) for i in range(1, 5)]
    await asyncio.sleep(0.03)  # the standard requests age past the bound
    tasks += [submit(batcher, 200.0 + i, tier=Tier.VIP) for i in range(8)]
    await settle()
    backend.gate.set()
    await asyncio.gather(*tasks)
    assert backend.batches[:3] == [[100.0], [1.0, 2.0, 3.0, 4.0], [200.0, 201.0, 202.0, 203.0]]


async def test_requests_answered_while_they_wait_give_their_place_back_at_once():
    """An expired or cancelled request stops counting at once, not when the
    batching task next passes it: in the queue's bound, its length gauge and
    the aging bound, which reads the oldest request still waiting."""
    backend = GatedBackend(max_batch=1, reserved=0)
    policy = QueuePolicy(
        levels={level: LevelPolicy(max_queue_size=2, default_timeout_s=30) for level in (Tier.VIP, Tier.STANDARD)},
        aging_s=0.05,
    )
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, policy=policy))
    tasks = [submit(batcher, 100.0, tier=Tier.VIP)]
    await backend.started.wait()  # the only slot is busy; the last batch was VIP-led
    expiring, leaving = submit(batcher, 1.0, timeout_s=0.005), submit(batcher, 2.0)
    await settle()
    leaving.cancel()
    await asyncio.sleep(0.06)  # 1.0 expires; both would have aged past the bound
    with pytest.raises(errors.DeadlineExceeded):
        await expiring
    assert batcher.queue_length() == 0
    assert (
        prometheus_client.REGISTRY.get_sample_value(
            "infermesh_batcher_queue_length", {"model": "m", "tier": "standard"}
        )
        == 0
    )
    tasks += [submit(batcher, 3.0), submit(batcher, 4.0)]  # the full level's two places
    await settle()
    tasks.append(submit(batcher, 101.0, tier=Tier.VIP))
    await settle()
    backend.gate.set()
    await asyncio.gather(*tasks)
    # No standard request has aged: the VIP one goes first, then the standard ones in order.
    assert backend.batches == [[100.0], [101.0], [3.0], [4.0]]


async def test_a_failed_batch_reruns_only_requests_that_can_still_be_answered():
    """Split after a failure, a batch reruns each request alone, except those
    whose caller left or whose deadline passed meanwhile; each request's queue
    wait is observed once, and the failed batch is off the books (rows in
    flight, the tier's running batches) before the reruns go."""
    backend = GatedBackend(max_batch=4, reserved=0)
    backend.poison = 13.0
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=60_000, max_queue_size=100))
    queue = batcher._queue("m", "1")

    def waits() -> float:
        return (
            prometheus_client.REGISTRY.get_sample_value(
                "infermesh_batcher_queue_wait_seconds_count", {"model": "m", "tier": "standard"}
            )
            or 0.0
        )

    before = waits()
    tasks = [submit(batcher, 1.0), submit(batcher, 13.0), submit(batcher, 3.0, timeout_s=0.02), submit(batcher, 4.0)]
    await backend.started.wait()
    tasks[3].cancel()
    await asyncio.sleep(0.03)  # 3.0's deadline passes while its batch runs
    in_flight = []
    original = backend.execute

    async def execute(*args, **kwargs):
        in_flight.append((dict(queue.admission.inflight_rows), queue.admission.service_rates[Tier.STANDARD]._running))
        return await original(*args, **kwargs)

    backend.execute = execute
    backend.gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert backend.batches == [[1.0, 13.0, 3.0, 4.0], [1.0], [13.0]]
    assert [type(r).__name__ for r in results] == ["tuple", "InvalidArgument", "DeadlineExceeded", "CancelledError"]
    assert waits() - before == 4
    assert in_flight == [({Tier.VIP: 0, Tier.STANDARD: 1}, 1)] * 2


async def test_a_request_whose_deadline_passes_while_its_batch_gathers_is_never_sent():
    backend = GatedBackend(max_batch=8, capacity=2)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=8, max_queue_delay_ms=30, max_queue_size=100))
    running = submit(batcher, 0.0)
    await backend.started.wait()  # a batch runs: the next one waits for company
    with pytest.raises(errors.DeadlineExceeded, match="past its deadline; it was not run"):
        await batcher.submit("m", "1", row(1.0), [], timeout_s=0.005)
    await asyncio.sleep(0.04)  # the gathering ends
    assert backend.batches == [[0.0]]
    backend.gate.set()
    await running


async def test_closing_answers_a_batch_still_gathering_company():
    backend = GatedBackend(max_batch=8, capacity=2)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=8, max_queue_delay_ms=60_000, max_queue_size=100))
    running = submit(batcher, 0.0)
    await backend.started.wait()
    gathering = submit(batcher, 1.0)  # taken as the next batch's lead, waiting for company
    await settle()
    backend.gate.set()
    await batcher.close()
    with pytest.raises(errors.Unavailable, match="shutting down"):
        await asyncio.wait_for(gathering, timeout=5)
    await running


class VersionedBackend(GatedBackend):
    """Says which versions its replicas hold, and tells the batcher when that changes."""

    def __init__(self, versions: set[str]):
        super().__init__(max_batch=4)
        self.versions = versions
        self.listeners = []
        self.down = False  # no ready replica: nothing described

    def limits(self, model):
        return None if self.down else ModelLimits(self._max_batch, ("X",), frozenset(self.versions))

    def change(self, **state):
        for name, value in state.items():
            setattr(self, name, value)
        for listener in self.listeners:
            listener()

    def on_change(self, listener):
        self.listeners.append(listener)


async def test_queues_exist_only_for_versions_the_replicas_hold():
    """A version no replica holds is refused before it gets a queue, and the
    queue of a version that left the catalog goes once nothing waits there:
    queues do not pile up per version string asked for, nor over rollouts."""
    backend = VersionedBackend({"1", "2"})
    backend.gate.set()
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=0, max_queue_size=100))
    with pytest.raises(errors.Unavailable, match=r"serves model 'm' version 7; they hold versions \['1', '2'\]"):
        await batcher.submit("m", "7", row(1.0), [])
    for version in ("", "1", "2"):
        await batcher.submit("m", version, row(1.0), [])
    assert set(batcher._queues) == {("m", ""), ("m", "1"), ("m", "2")}
    backend.change(versions={"2"})  # version 1 retired
    await settle()
    assert set(batcher._queues) == {("m", ""), ("m", "2")}  # the default queue keeps what it learned
    assert (await batcher.submit("m", "2", row(3.0), []))[0] == "1"
    await batcher.close()


async def test_an_outage_keeps_the_version_queues():
    """Every replica unready at once is an outage, not a rollout: the version
    queues (and what their batch policies learned) are still there after it."""
    backend = VersionedBackend({"1", "2"})
    backend.gate.set()
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=0, max_queue_size=100))
    for version in ("1", "2"):
        await batcher.submit("m", version, row(1.0), [])
    await settle()  # both queues idle
    queues = dict(batcher._queues)
    backend.change(down=True)
    await settle()
    with pytest.raises(errors.Unavailable, match="no ready model_server replica serves model 'm'"):
        await batcher.submit("m", "2", row(1.0), [])
    backend.change(down=False)
    await settle()
    assert batcher._queues == queues
    assert (await batcher.submit("m", "2", row(3.0), []))[0] == "1"
    await batcher.close()


class TextBackend(GatedBackend):
    """Records the texts of each batch (their lengths are what matters here)."""

    def limits(self, model):
        return ModelLimits(self._max_batch, ("TEXT",))

    async def execute(self, model, version, inputs, outputs, timeout_s, tier=Tier.STANDARD):
        self.batches.append([len(t) for t in to_numpy(inputs[0])])
        self.started.set()
        await self.gate.wait()
        return "1", [from_numpy("EMBEDDING", np.zeros((inputs[0].rows, 2), np.float32))]


def text(length: int):
    return [from_numpy("TEXT", np.array([b"x" * length], dtype=object))]


@pytest.mark.parametrize(
    "length_aware, expected",
    [
        (True, [[5], [10, 11, 12], [200, 205, 190]]),  # nearest to the oldest first
        (False, [[5], [10, 200, 12], [190, 11, 205]]),
    ],
)
async def test_length_aware_batching_groups_texts_of_similar_length(length_aware, expected):
    backend = TextBackend(max_batch=3)
    batcher = Batcher(
        backend, BatchingConfig(max_batch_size=3, max_queue_delay_ms=0, max_queue_size=100, length_aware=length_aware)
    )
    running = asyncio.create_task(batcher.submit("m", "1", text(5), []))
    await backend.started.wait()
    waiting = [asyncio.create_task(batcher.submit("m", "1", text(n), [])) for n in (10, 200, 12, 190, 11, 205)]
    await settle()
    backend.gate.set()
    await asyncio.gather(running, *waiting)
    assert backend.batches == expected


class TimedBackend(GatedBackend):
    """Each batch takes `seconds`: a model with a known service rate."""

    def __init__(self, seconds: float, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds
        self.gate.set()

    async def execute(self, model, version, inputs, outputs, timeout_s, tier=Tier.STANDARD):
        await asyncio.sleep(self.seconds)
        return await super().execute(model, version, inputs, outputs, timeout_s, tier)


class ScriptedBackend(TimedBackend):
    """Each batch takes the next of `durations` seconds, the last one for good."""

    def __init__(self, durations: list[float], **kwargs):
        super().__init__(durations[0], **kwargs)
        self.durations = durations

    async def execute(self, model, version, inputs, outputs, timeout_s, tier=Tier.STANDARD):
        self.seconds = self.durations.pop(0) if len(self.durations) > 1 else self.durations[0]
        return await super().execute(model, version, inputs, outputs, timeout_s, tier)


async def test_a_request_whose_tier_slowed_while_it_waited_is_refused_when_its_turn_comes_not_sent_to_time_out():
    backend = ScriptedBackend([0.01, 0.01, 0.01, 0.5, 0.01], max_batch=1)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=10))
    for value in range(3):  # the tier's batches take 10 ms
        await batcher.submit("m", "1", row(float(value)), [])
    slow = submit(batcher, 3.0)
    await settle()
    # Its refusal timer is set for 35 ms before its deadline; when its turn comes, after the slow
    # batch, it has about 300 ms left, and the tier's batches now take about 350 ms (cautiously).
    late = submit(batcher, 4.0, timeout_s=0.8)
    with pytest.raises(
        errors.ResourceExhausted,
        match=r"waited \d+ ms in the standard queue and has \d+ ms left, "
        r"less than its batch would take \(about 3\d\d ms\)",
    ):
        await late
    await slow
    assert backend.batches == [[0.0], [1.0], [2.0], [3.0]]  # it was not sent
    # A request that comes after the tier's latest batch still goes, however tight: the estimate may be stale.
    assert (await batcher.submit("m", "1", row(5.0), [], timeout_s=0.2))[0] == "1"


async def test_a_request_that_would_wait_past_its_deadline_is_refused_at_once():
    backend = TimedBackend(0.01, max_batch=1)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=1000))
    await asyncio.gather(*(batcher.submit("m", "1", row(float(i)), []) for i in range(5)))  # learn ~100 rows/s
    backlog = [submit(batcher, float(i), timeout_s=30) for i in range(40)]  # ~0.4 s of work
    await settle()
    with pytest.raises(
        errors.ResourceExhausted, match="that its deadline, 50 ms away, leaves after its own batch"
    ) as info:
        await batcher.submit("m", "1", row(99.0), [], timeout_s=0.05)
    assert info.value.retry_after_ms > 100
    vip = await batcher.submit("m", "1", row(7.0), [], tier=Tier.VIP, timeout_s=0.2)  # nothing ahead at VIP
    assert float(to_numpy(vip[1][0])[0, 0]) == 14.0
    await asyncio.gather(*backlog)


async def behind_a_backlog(batcher, backlog: int, timeout_s: float, admitted: bool, refusal: str) -> None:
    """`backlog` requests with time to spare, then one with `timeout_s` left:
    it is served (and doubled) when `admitted`, else refused at once with a
    message matching `refusal`; the backlog is served either way."""
    waiting = [submit(batcher, float(i), timeout_s=30) for i in range(backlog)]
    await settle()
    late = submit(batcher, 99.0, timeout_s=timeout_s)
    await settle()
    if admitted:
        assert float(to_numpy((await late)[1][0])[0, 0]) == 198.0
    else:
        with pytest.raises(errors.ResourceExhausted, match=refusal):
            await late
    await asyncio.gather(*waiting)


@pytest.mark.parametrize("share, admitted", [(1.0, True), (0.5, False)])
async def test_admission_keeps_a_share_of_the_deadline_as_margin(share, admitted):
    """About 0.4 s of work ahead and 0.6 s left: enough on average, but not with
    half the time kept back for a rate that is only an estimate."""
    backend = TimedBackend(0.01, max_batch=1)
    policy = QueuePolicy.uniform(1000, 30, admission_share=share)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, policy=policy))
    await asyncio.gather(*(batcher.submit("m", "1", row(float(i)), []) for i in range(5)))  # learn ~100 rows/s
    await behind_a_backlog(batcher, 40, 0.6, admitted, refusal="more than 50% of the 600 ms left")


async def test_admission_leaves_a_request_time_for_its_own_batch():
    """Batches of 0.1 s, about 0.5 s of work up to and with the request, 0.55 s
    left and no share kept back: it would be done in time on average, but still
    be waiting when less than a batch's time is left, and be refused then; so
    it is refused at once."""
    backend = TimedBackend(0.1, max_batch=1)
    policy = QueuePolicy.uniform(1000, 30, admission_share=1.0)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, policy=policy))
    await asyncio.gather(*(batcher.submit("m", "1", row(float(i)), []) for i in range(4)))  # learn ~10 rows/s
    backlog = [submit(batcher, float(i), timeout_s=30) for i in range(4)]
    await settle()
    with pytest.raises(errors.ResourceExhausted, match=r"that its deadline, 550 ms away, leaves after its own batch"):
        await batcher.submit("m", "1", row(99.0), [], timeout_s=0.55)
    await asyncio.gather(*backlog)


def test_a_tiers_batch_time_is_its_mean_plus_deviations_once_a_batch_has_finished():
    times = MovingTime()
    assert (
        times.estimate(CAUTIOUS_DEVIATIONS) is None
    )  # nothing to go by: a waiting request only expires at its deadline
    times.observe(0.2)
    assert times.estimate(CAUTIOUS_DEVIATIONS) == pytest.approx(0.2)
    times.observe(0.6)  # one batch three times as long: the margin widens at once
    assert times.mean == pytest.approx(0.28) and times.deviation == pytest.approx(0.1)
    assert times.estimate(CAUTIOUS_DEVIATIONS) == pytest.approx(0.28 + CAUTIOUS_DEVIATIONS * 0.1)


def test_the_service_rate_follows_the_slots_the_tier_has_now():
    """Measured while a lent VIP instance gave standard batches two slots, the
    rate halves once the loan ends and they have one."""
    rate = ServiceRate()
    clock = 0.0
    for _ in range(4):  # two batches of 10 rows at once, 0.1 s each, on two slots
        rate.started(clock)
        rate.started(clock)
        clock += 0.1
        rate.finished(clock, 10, slots=2)
        rate.finished(clock, 10, slots=2)
    # The first batch only marks where the span starts: 70 rows in the 0.3 s after it.
    assert rate.rows_per_second(clock, slots=2) == pytest.approx(70 / 0.3)
    assert rate.rows_per_second(clock, slots=1) == pytest.approx(35 / 0.3)


def test_the_service_rate_counts_busy_time_only_and_follows_the_last_few_batches():
    rate = ServiceRate()
    clock = 0.0
    for _ in range(4):  # batches of 10 rows, 0.1 s each, one after another: 100 rows/s
        rate.started(clock)
        clock += 0.1
        rate.finished(clock, 10)
    assert rate.rows_per_second(clock) == pytest.approx(100)
    clock += 30.0  # idle: no demand, which is not slowness
    assert rate.rows_per_second(clock) == pytest.approx(100)
    rate.started(clock)
    rate.started(clock)  # two in flight at once: busy time counts once
    clock += 0.1
    rate.finished(clock, 10)
    rate.finished(clock, None)  # a failed batch completes nothing
    assert rate.rows_per_second(clock) == pytest.approx(40 / 0.4)
    for _ in range(9):  # the machine slows down: 0.4 s per batch; the rate follows within 8 batches
        rate.started(clock)
        clock += 0.4
        rate.finished(clock, 10)
    assert rate.rows_per_second(clock) == pytest.approx(25)


def test_the_service_rate_counts_time_its_requests_wait_between_its_batches():
    """Standard batches of 0.1 s with a 0.1 s VIP batch between each two, on
    one shared instance: the standard backlog drains at 50 rows/s, not the
    100 rows/s its batches alone would say. Time with nothing waiting and
    nothing running still does not count."""
    rate = ServiceRate()
    clock = 0.0
    rate.waiting(clock, True)
    for _ in range(4):
        rate.waiting(clock, True)  # the VIP batch runs, standard requests wait
        clock += 0.1
        rate.waiting(clock, False)  # the next standard batch takes the waiting rows
        rate.started(clock)
        clock += 0.1
        rate.finished(clock, 10)
    assert rate.rows_per_second(clock) == pytest.approx(30 / 0.6)
    clock += 30.0  # nothing waits: no demand
    assert rate.rows_per_second(clock) == pytest.approx(30 / 0.6)


class SharedSlotBackend(TimedBackend):
    """One instance for both tiers: no slot reserved for VIP work."""

    def slots(self, model):
        return 1, 0, 1


@pytest.mark.parametrize("vip_between, admitted", [(True, False), (False, True)])
async def test_admission_counts_the_vip_batches_a_standard_backlog_waits_behind(vip_between, admitted):
    """Standard batches of 50 ms, on an instance VIP batches share: 20 rows/s
    on their own, about 9 rows/s with a VIP batch before each. 16 rows up to a
    request with 2.4 s left are 0.8 s of work at the first rate (within half
    its deadline) and 1.9 s at the second: where VIP batches come between, it
    is refused at once rather than left to wait past its deadline."""
    backend = SharedSlotBackend(0.05, max_batch=1)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=1000))
    first = submit(batcher, 0.0)
    await backend.started.wait()
    vip = [submit(batcher, 100.0 + i, tier=Tier.VIP) for i in range(4 if vip_between else 0)]
    await asyncio.gather(first, *vip, *(submit(batcher, float(i)) for i in range(1, 4)))
    await behind_a_backlog(batcher, 15, 2.4, admitted, refusal="more than 50% of the 2400 ms left")


async def test_queued_row_counts_follow_every_way_out_of_the_queue():
    backend = TextBackend(max_batch=4)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=0, max_queue_size=100))
    running = [asyncio.create_task(batcher.submit("m", "1", text(5), []))]
    await backend.started.wait()
    running.append(asyncio.create_task(batcher.submit("m", "1", text(6), [], tier=Tier.VIP)))
    await settle()
    assert backend.batches == [[5], [6]]  # both slots, general and reserved, are busy from here on
    waiting = [
        asyncio.create_task(batcher.submit("m", "1", text(n), [], tier=p, timeout_s=t))
        for n, p, t in (
            (10, Tier.STANDARD, None),
            (200, Tier.STANDARD, None),
            (12, Tier.VIP, None),
            (30, Tier.STANDARD, 0.001),
        )
    ]
    await settle()
    queue = batcher._queues[("m", "1")]
    assert queue.levels.queued_rows == {Tier.VIP: 1, Tier.STANDARD: 3}
    waiting[1].cancel()
    await asyncio.sleep(0.01)  # the short deadline passes
    backend.gate.set()
    results = await asyncio.gather(*running, *waiting, return_exceptions=True)
    assert isinstance(results[3], asyncio.CancelledError) and isinstance(results[5], errors.DeadlineExceeded)
    assert queue.levels.queued_rows == {Tier.VIP: 0, Tier.STANDARD: 0} and len(queue) == 0


async def test_close_stops_a_running_batch_and_answers_its_requests():
    """close() comes once the server's drain grace is over: nobody will read a
    running batch's answer, so it is cancelled (and its model-server call with
    it) rather than holding the process until the batch ends."""
    backend = GatedBackend()
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=0, max_queue_size=100))
    running = asyncio.create_task(batcher.submit("m", "", row(1.0), []))
    await backend.started.wait()  # the gate stays shut: the batch would run forever
    await batcher.close()
    with pytest.raises(errors.Unavailable, match="batcher is shutting down; model 'm' batch not finished"):
        await running


async def test_a_running_batch_whose_callers_all_left_is_cancelled_and_frees_its_slot():
    class CountingBackend(GatedBackend):
        cancelled = 0

        async def execute(self, *args, **kwargs):
            try:
                return await super().execute(*args, **kwargs)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

    backend = CountingBackend(capacity=1, reserved=0)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=4, max_queue_delay_ms=0, max_queue_size=100))
    gone = asyncio.create_task(batcher.submit("m", "", row(1.0), []))
    await backend.started.wait()
    waiting = asyncio.create_task(batcher.submit("m", "", row(2.0), []))  # behind it, for the one slot
    await settle()
    gone.cancel()
    await settle()
    assert backend.cancelled == 1 and backend.batches == [[1.0], [2.0]]  # the slot went to the next batch
    backend.gate.set()
    assert (await waiting)[0] == "1"
    await batcher.close()
