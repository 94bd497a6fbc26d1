"""The router's single-flight policy in plain asyncio, with a gated batcher stand-in
(the real batcher is exercised end to end elsewhere; here only who waits on what)."""

import asyncio
import dataclasses

import numpy as np
import pytest

from services.common import errors
from services.common.tensors import from_numpy
from services.router.core import Catalog, InferRequest, Router
from tests.conftest import until
from tests.test_router_validation import MLP

pytestmark = pytest.mark.unit


class SlowBatcher:
    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.calls: list[tuple[int, float]] = []

    async def submit(self, model, version, inputs, outputs, tier, timeout_s, tenant="", weight=1.0):
        self.calls.append((tier, timeout_s))
        if timeout_s < self.delay_s:
            await asyncio.sleep(timeout_s)
            raise errors.DeadlineExceeded("waited past its deadline; it was not run")
        await asyncio.sleep(self.delay_s)
        return version, [from_numpy("OUTPUT0", np.ones((1, 64), np.float32))]


def make_router(batcher) -> Router:
    catalog = Catalog()
    catalog.replace([MLP])
    return Router(catalog, batcher, cache=None)


async def flying(batcher) -> None:
    """Until the first caller's computation has reached the batcher."""
    await until(lambda: batcher.calls, "the first request at the batcher", interval_s=0)


def request(timeout_s=None, tier=0) -> InferRequest:
    return InferRequest("mlp", "", "", [from_numpy("INPUT0", np.zeros((1, 64), np.float32))], [], tier, timeout_s)


async def test_identical_requests_share_one_computation():
    batcher = SlowBatcher(0.05)
    router = make_router(batcher)
    results = await asyncio.gather(*(router.infer(request(timeout_s=5)) for _ in range(10)))
    assert len(batcher.calls) == 1 and all(r.outputs == results[0].outputs for r in results)


async def test_a_caller_with_time_left_outlives_the_first_callers_short_deadline():
    batcher = SlowBatcher(0.2)
    router = make_router(batcher)
    short = asyncio.create_task(router.infer(request(timeout_s=0.05)))
    await flying(batcher)
    patient = asyncio.create_task(router.infer(request(timeout_s=5)))
    with pytest.raises(errors.DeadlineExceeded):
        await short
    result = await patient
    assert result.outputs[0].shape == (1, 64)
    assert len(batcher.calls) == 2 and batcher.calls[1][1] > 1


async def test_vip_requests_do_not_ride_on_a_standard_flight():
    batcher = SlowBatcher(0.05)
    router = make_router(batcher)
    await asyncio.gather(router.infer(request(timeout_s=5, tier=0)), router.infer(request(timeout_s=5, tier=1)))
    assert sorted(tier for tier, _ in batcher.calls) == [0, 1]


async def test_a_caller_that_joins_waits_no_longer_than_its_own_deadline():
    batcher = SlowBatcher(1.0)
    router = make_router(batcher)
    patient = asyncio.create_task(router.infer(request(timeout_s=5)))
    await flying(batcher)
    started = asyncio.get_running_loop().time()
    with pytest.raises(errors.DeadlineExceeded, match="while an identical request's computation"):
        await router.infer(request(timeout_s=0.2))
    assert asyncio.get_running_loop().time() - started < 0.5
    assert (await patient).outputs[0].shape == (1, 64)  # the shared computation went on
    assert len(batcher.calls) == 1


class AdmittingBatcher:
    """Refuses a request that cannot finish within its time (a run takes 0.2 s),
    as the batcher's and the model server's deadline-aware admission do."""

    def __init__(self):
        self.calls: list[float] = []

    async def submit(self, model, version, inputs, outputs, tier, timeout_s, tenant="", weight=1.0):
        self.calls.append(timeout_s)
        await asyncio.sleep(0.02)  # its turn came
        if timeout_s < 0.2 + 0.02:
            raise errors.ResourceExhausted("this batch would not finish before its deadline", retry_after_ms=150)
        await asyncio.sleep(0.2)
        return version, [from_numpy("OUTPUT0", np.ones((1, 64), np.float32))]


async def test_a_joiner_with_time_left_retries_after_the_first_callers_deadline_refusal():
    batcher = AdmittingBatcher()
    router = make_router(batcher)
    impatient = asyncio.create_task(router.infer(request(timeout_s=0.1)))
    await flying(batcher)
    result = await router.infer(request(timeout_s=5))  # joined the impatient flight, then ran its own
    assert result.outputs[0].shape == (1, 64)
    with pytest.raises(errors.ResourceExhausted, match="would not finish"):
        await impatient
    assert len(batcher.calls) == 2 and batcher.calls[1] > 1


async def test_a_request_pinned_to_a_version_does_not_ride_on_one_that_named_none():
    """Mid-swap the model servers may answer a request that named no version
    with a newer version than the router's catalog knows of yet."""

    class SwappingBatcher(SlowBatcher):
        async def submit(self, model, version, inputs, outputs, tier, timeout_s, tenant="", weight=1.0):
            await super().submit(model, version, inputs, outputs, tier, timeout_s)
            return version or "3", [from_numpy("OUTPUT0", np.ones((1, 64), np.float32))]

    router = make_router(SwappingBatcher(0.05))
    unpinned = request(timeout_s=5)
    pinned = dataclasses.replace(unpinned, version=MLP.ready_versions[0])
    results = await asyncio.gather(router.infer(unpinned), router.infer(pinned))
    assert [r.version for r in results] == ["3", MLP.ready_versions[0]]


async def test_the_shared_computation_stops_only_when_every_caller_left():
    batcher = SlowBatcher(0.2)
    router = make_router(batcher)
    first = asyncio.create_task(router.infer(request(timeout_s=5)))
    second = asyncio.create_task(router.infer(request(timeout_s=5)))
    await flying(batcher)  # and the second caller has joined it, having run before the flight began
    first.cancel()
    assert (await second).outputs[0].shape == (1, 64)
    assert len(batcher.calls) == 1


class FullBatcher:
    """Answers standard requests RESOURCE_EXHAUSTED with a retry hint, as a full queue does."""

    def __init__(self):
        self.calls: list[int] = []

    async def submit(self, model, version, inputs, outputs, tier, timeout_s, tenant="", weight=1.0):
        self.calls.append(tier)
        if tier == 0:
            raise errors.ResourceExhausted("the standard queue of model 'mlp' is full", retry_after_ms=300)
        return version, [from_numpy("OUTPUT0", np.ones((1, 64), np.float32))]


def distinct_request(i: int, tier: int = 0) -> InferRequest:
    return InferRequest("mlp", "", "", [from_numpy("INPUT0", np.full((1, 64), i, np.float32))], [], tier, 5.0)


async def test_after_a_full_queue_the_router_refuses_that_tier_itself_for_the_hinted_time():
    batcher = FullBatcher()
    router = make_router(batcher)
    with pytest.raises(errors.ResourceExhausted, match="is full"):
        await router.infer(distinct_request(1))
    with pytest.raises(
        errors.ResourceExhausted,
        match=r"refusing standard requests of 1 row\(s\) or more that "
        r"cannot wait .*: the standard queue of model 'mlp' is full",
    ) as info:
        await router.infer(distinct_request(2))
    assert 10 <= info.value.retry_after_ms <= 300
    assert batcher.calls == [0]  # the second never reached the batcher
    assert (await router.infer(distinct_request(3, tier=1))).outputs  # VIP is not held back
    assert batcher.calls == [0, 1]


class DeadlineBatcher:
    """Refuses standard requests that cannot wait 500 ms, saying by how much
    they fall short, as the batcher's deadline-aware admission does."""

    def __init__(self):
        self.calls: list[float] = []

    async def submit(self, model, version, inputs, outputs, tier, timeout_s, tenant="", weight=1.0):
        self.calls.append(timeout_s)
        if timeout_s < 0.5:
            raise errors.ResourceExhausted("would miss its deadline", retry_after_ms=int(1000 * (0.5 - timeout_s)))
        return version, [from_numpy("OUTPUT0", np.ones((1, 64), np.float32))]


def timed_request(i: int, timeout_s: float) -> InferRequest:
    return InferRequest("mlp", "", "", [from_numpy("INPUT0", np.full((1, 64), i, np.float32))], [], 0, timeout_s)


async def test_one_impatient_callers_refusal_does_not_turn_away_callers_with_time_to_wait():
    batcher = DeadlineBatcher()
    router = make_router(batcher)
    with pytest.raises(errors.ResourceExhausted, match="would miss its deadline"):
        await router.infer(timed_request(1, 0.1))
    with pytest.raises(errors.ResourceExhausted, match="cannot wait about 500 ms"):
        await router.infer(timed_request(2, 0.2))  # no more patient: refused here, not sent
    assert (await router.infer(timed_request(3, 5.0))).outputs  # has the time: goes through
    assert len(batcher.calls) == 2


async def test_a_refusal_for_a_large_request_does_not_shed_smaller_ones():
    """A batch too large to finish in its time says how much time it lacked;
    a smaller request may fit where it did not, and still goes through."""

    class SizeBatcher:
        def __init__(self):
            self.calls: list[int] = []

        async def submit(self, model, version, inputs, outputs, tier, timeout_s, tenant="", weight=1.0):
            rows = inputs[0].rows
            self.calls.append(rows)
            if rows > 4:
                raise errors.ResourceExhausted(f"a batch of {rows} takes about 5000 ms", retry_after_ms=4800)
            return version, [from_numpy("OUTPUT0", np.ones((rows, 64), np.float32))]

    batcher = SizeBatcher()
    router = make_router(batcher)

    def sized(rows: int, value: float) -> InferRequest:
        return InferRequest("mlp", "", "", [from_numpy("INPUT0", np.full((rows, 64), value, np.float32))], [], 0, 1.0)

    with pytest.raises(errors.ResourceExhausted, match="takes about 5000 ms"):
        await router.infer(sized(8, 1))
    assert (await router.infer(sized(1, 2))).outputs[0].shape == (1, 64)
    with pytest.raises(errors.ResourceExhausted, match=r"requests of 8 row\(s\) or more"):
        await router.infer(sized(16, 3))  # as large and no more patient: refused here
    assert batcher.calls == [8, 1]


async def test_a_shed_level_is_refused_in_the_callers_own_step():
    """No task and no turn of the event loop: under overload every refusal that
    waits for the loop waits behind all the other work queued there."""
    router = make_router(FullBatcher())
    with pytest.raises(errors.ResourceExhausted, match="is full"):
        await router.infer(distinct_request(1))
    step = router.infer(distinct_request(2)).__await__()
    with pytest.raises(errors.ResourceExhausted, match="refusing standard requests"):
        step.send(None)  # the first step of the call already answers


class GatedBatcher:
    """Holds input 1 until the gate opens; refuses every other standard request as a full queue does."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.calls: list[float] = []

    async def submit(self, model, version, inputs, outputs, tier, timeout_s, tenant="", weight=1.0):
        value = float(np.frombuffer(inputs[0].data, np.float32)[0])
        self.calls.append(value)
        if value != 1:
            raise errors.ResourceExhausted("the standard queue of model 'mlp' is full", retry_after_ms=300)
        await self.gate.wait()
        return version, [from_numpy("OUTPUT0", np.ones((1, 64), np.float32))]


async def test_while_a_level_is_shed_a_caller_still_joins_an_identical_running_request():
    batcher = GatedBatcher()
    router = make_router(batcher)
    running = asyncio.create_task(router.infer(distinct_request(1)))
    while not batcher.calls:
        await asyncio.sleep(0)
    with pytest.raises(errors.ResourceExhausted, match="is full"):
        await router.infer(distinct_request(2))
    joined = asyncio.create_task(router.infer(distinct_request(1)))  # costs the batcher nothing more
    with pytest.raises(errors.ResourceExhausted, match="refusing standard requests"):
        await router.infer(distinct_request(3))
    batcher.gate.set()
    assert (await running).outputs == (await joined).outputs
    assert batcher.calls == [1, 2]
