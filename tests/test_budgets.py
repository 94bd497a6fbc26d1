"""Byte budgets, message limits, idle connections and streams, and nothing
answered retained (services/common/budget.py and its use in every service)."""

import asyncio
import os
import signal

import grpc
import numpy as np
import prometheus_client
import pytest
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc
from infermesh.batcher.v1 import batcher_pb2, batcher_pb2_grpc
from infermesh.cache.v1 import cache_pb2, cache_pb2_grpc
from infermesh.common.v1.tensor_pb2 import Tensor

from services.batcher.config import BatcherConfig
from services.batcher.core import Batcher, BatchingConfig
from services.batcher.server import BatcherServicer
from services.cache.config import CacheConfig
from services.common import errors
from services.common.budget import GIB, MIB, ByteBudget
from services.common.protoconv import tensors_to_proto
from services.common.streams import StreamMux
from services.common.tensors import from_numpy
from services.launcher.mesh import Mesh, MeshConfig
from services.model_server.config import ModelServerConfig
from services.router.config import RouterConfig
from services.router.server import build_server
from tests.conftest import metric, until, wait_until
from tests.oip import tensor_request
from tests.test_batcher_core import GatedBackend, submit
from tests.test_router_core import make_router
from tests.test_streams import Echo

KIB = 1024
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # channels to one address otherwise share a connection


# ---------------------------------------------------------------- the budget and the configs


@pytest.mark.unit
def test_a_request_past_the_budget_is_refused_naming_service_budget_and_size_with_a_retry_hint():
    budget = ByteBudget("router", 1000)
    budget.acquire(600)
    with pytest.raises(errors.ResourceExhausted) as info:
        budget.acquire(500, "ModelInfer request")
    message = info.value.message
    assert "ModelInfer request of 500 bytes" in message and "router" in message and "1000 bytes" in message
    assert info.value.retry_after_ms > 0
    budget.release(600)
    with budget.hold(1000):
        assert budget.held_bytes == 1000
    with pytest.raises(ValueError), budget.hold(400):
        raise ValueError("the handler failed")
    assert budget.held_bytes == 0 and budget.held_requests == 0
    with pytest.raises(errors.ResourceExhausted, match="exceeds the router's byte budget of 1000 bytes on its own"):
        budget.acquire(1001)


@pytest.mark.unit
def test_every_service_derives_its_budget_from_its_memory_limit_and_refuses_one_that_does_not_fit():
    for config in (RouterConfig(), BatcherConfig(), CacheConfig(), ModelServerConfig()):
        assert config.budget_bytes > 0 and config.memory_needed_bytes <= config.memory_limit_bytes
    assert RouterConfig(memory_limit_bytes=2 * GIB).budget_bytes > RouterConfig().budget_bytes
    with pytest.raises(ValueError, match="more than memory_limit_bytes"):
        RouterConfig(request_budget_bytes=512 * MIB)
    with pytest.raises(ValueError, match="must hold one request of max_request_bytes"):
        RouterConfig(request_budget_bytes=1 * MIB)
    with pytest.raises(ValueError, match="must exceed the RouterConfig baseline"):
        RouterConfig(memory_limit_bytes=128 * MIB)


# ---------------------------------------------------------------- the router's edge


class GatedBatcher:
    """Answers a request of up to 100 rows at once and holds larger ones until
    `gate` is set (a blocked model server, as the router sees it)."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.held = 0

    async def submit(self, model, version, inputs, outputs, tier, timeout_s, tenant="", weight=1.0):
        if inputs[0].rows > 100:
            self.held += 1
            try:
                await self.gate.wait()
            finally:
                self.held -= 1
        return version or "2", [from_numpy("OUTPUT0", np.ones((inputs[0].rows, 64), np.float32))]


def held_bytes(service: str = "router") -> float:
    return prometheus_client.REGISTRY.get_sample_value("infermesh_held_request_bytes", {"service": service})


def big(value: float, request_id: str = "") -> pb.ModelInferRequest:
    """51,200 bytes of tensor: four of them pass the test budget. Distinct
    values: identical requests would share one computation."""
    request = tensor_request(np.full((200, 64), value, np.float32))
    request.id = request_id
    return request


def small(request_id: str = "") -> pb.ModelInferRequest:
    request = tensor_request(np.zeros((1, 64), np.float32))
    request.id = request_id
    return request


BIG_BYTES = 200 * 64 * 4


async def serve_router(**fields):
    batcher = GatedBatcher()
    config = RouterConfig(**{"port": 0, "max_request_bytes": 64 * KIB, "request_budget_bytes": 200 * KIB, **fields})
    server, port, _ = await build_server(config, make_router(batcher))
    return server, f"127.0.0.1:{port}", batcher


@pytest.mark.service
async def test_the_router_refuses_requests_past_its_byte_budget_and_releases_on_every_path():
    server, address, batcher = await serve_router()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        blocked = [stub.ModelInfer(big(i), timeout=30) for i in range(3)]
        await until(lambda: batcher.held == 3, "three large requests held at the batcher")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ModelInfer(big(3), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "router past its byte budget of 204800 bytes" in info.value.details()
        assert errors.retry_after_ms(info.value.trailing_metadata()) > 0
        answer = await stub.ModelInfer(small(), timeout=30)
        assert answer.outputs[0].shape == [1, 64]  # a small request still fits

        # Cancelled and past its deadline: each releases what it held.
        blocked[0].cancel()  # the call itself: the router sees its caller leave
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ModelInfer(big(4), timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until(lambda: batcher.held == 2, "the cancelled and the expired request gone from the batcher")
        await until(lambda: held_bytes() < 2 * BIG_BYTES + 2 * KIB, "only two requests held")
        bad = tensor_request(np.zeros((200, 65), np.float32))  # refused by validation: an error path
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.ModelInfer(bad, timeout=30)
        batcher.gate.set()
        await asyncio.gather(*blocked[1:])
        await until(lambda: held_bytes() == 0, "nothing held once everything is answered")
    await server.stop(0)


@pytest.mark.service
async def test_stream_messages_are_held_alike_and_one_past_the_budget_fails_alone():
    server, address, batcher = await serve_router()
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=30)
        for i in range(4):
            await call.write(big(i, f"big-{i}"))
        refused = await call.read()  # the fourth: the others are held at the batcher
        assert refused.infer_response.id == "big-3"
        assert refused.error_message.startswith("RESOURCE_EXHAUSTED: stream message of")
        assert refused.infer_response.parameters["retry_after_ms"].int64_param > 0
        await call.write(small("small"))
        assert (await call.read()).infer_response.id == "small"
        batcher.gate.set()
        answered = {(await call.read()).infer_response.id for _ in range(3)}
        assert answered == {"big-0", "big-1", "big-2"}
        await call.done_writing()
        await until(lambda: held_bytes() == 0, "nothing held once the stream's requests are answered")
    await server.stop(0)


@pytest.mark.service
async def test_a_control_rpc_has_a_smaller_request_limit_than_inference():
    server, address, _ = await serve_router(max_control_request_bytes=4 * KIB)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ModelReady(pb.ModelReadyRequest(name="x" * 8 * KIB), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "ModelReady request of" in info.value.details() and "limit of 4096 bytes" in info.value.details()
        inference = await stub.ModelInfer(tensor_request(np.zeros((32, 64), np.float32)), timeout=10)  # 8 KiB
        assert inference.outputs[0].shape == [32, 64]
    await server.stop(0)


@pytest.mark.service
async def test_a_stream_message_has_its_own_limit():
    server, address, _ = await serve_router(max_stream_message_bytes=4 * KIB)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = tensor_request(np.zeros((32, 64), np.float32))  # 8 KiB: within the unary limit
        assert (await stub.ModelInfer(request, timeout=10)).outputs[0].shape == [32, 64]
        call = stub.ModelStreamInfer(timeout=10)
        await call.write(request)
        await call.write(small("after"))
        refused, answered = await call.read(), await call.read()
        assert refused.error_message.startswith("RESOURCE_EXHAUSTED") and "limit of 4096 bytes" in refused.error_message
        assert answered.infer_response.id == "after" and not answered.error_message  # the stream went on
        await call.done_writing()
    await server.stop(0)


# ---------------------------------------------------------------- idle connections and streams


async def open_idle_stream(stub, index: int):
    """A stream that asked one thing, got its answer, and now sits idle."""
    call = stub.ModelStreamInfer()
    await call.write(small(f"idle-{index}"))
    await call.read()
    return call


@pytest.mark.service
async def test_idle_streams_end_after_their_idle_time_and_free_the_calls_they_held():
    server, address, _ = await serve_router(max_concurrent_rpcs=4, stream_idle_timeout_s=0.3)
    channels = [grpc.aio.insecure_channel(address, options=OWN_CONNECTION) for _ in range(4)]
    calls = [await open_idle_stream(pb_grpc.GRPCInferenceServiceStub(c), i) for i, c in enumerate(channels)]
    for call in calls:  # each ends by itself, without a word from its caller, and not OK: more may be on the wire
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(call.read(), 10)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and "idle" in ended.value.details()
    async with grpc.aio.insecure_channel(address) as channel:
        live = await pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=10)
        assert live.live
    for channel in channels:
        await channel.close()
    await server.stop(0)


@pytest.mark.service
async def test_one_connections_idle_streams_cannot_take_every_call_from_unary_callers():
    server, address, _ = await serve_router(max_concurrent_rpcs=8, max_concurrent_streams=4, stream_idle_timeout_s=0)
    async with (
        grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as hoarder,
        grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as caller,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(hoarder)
        opening = [asyncio.create_task(open_idle_stream(stub, i)) for i in range(8)]
        await until(lambda: sum(task.done() for task in opening) >= 4, "four idle streams open")
        live = await pb_grpc.GRPCInferenceServiceStub(caller).ServerLive(pb.ServerLiveRequest(), timeout=10)
        assert live.live
        assert sum(task.done() for task in opening) == 4  # the other four wait on the caller's side
        for task in opening:
            task.cancel()
        for task in opening:
            if task.done() and not task.cancelled():
                task.result().cancel()
    await server.stop(0)


@pytest.mark.service
async def test_an_idle_connection_is_closed_after_its_idle_time():
    server, address, _ = await serve_router(max_connection_idle_s=0.3)
    async with grpc.aio.insecure_channel(address) as channel:
        await pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=10)
        assert channel.get_state() == grpc.ChannelConnectivity.READY
        await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), 10)
        assert channel.get_state() != grpc.ChannelConnectivity.READY  # the server sent GOAWAY: idle
    await server.stop(0)


# ---------------------------------------------------------------- nothing answered retained


@pytest.mark.service
async def test_the_stream_multiplexers_timeout_heap_holds_no_answered_response():
    server = grpc.aio.server()
    batcher_pb2_grpc.add_BatcherServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        mux = StreamMux(
            "echo", batcher_pb2_grpc.BatcherStub(channel).Submit, lambda i: batcher_pb2.SubmitRequest(id=i, cancel=True)
        )
        for _ in range(50):
            await mux.request(lambda i: batcher_pb2.SubmitRequest(id=i, model="fast"), timeout_s=60)
        assert len(mux._deadlines) == 50  # their deadlines are a minute away: the entries are still there ...
        assert all(entry[2] is None for entry in mux._deadlines)  # ... but hold no future, so no response
        await mux.close()
    await server.stop(0)


@pytest.mark.unit
async def test_a_request_answered_while_it_waits_in_the_batcher_leaves_its_tensors_behind():
    backend = GatedBackend(max_batch=1, capacity=1, reserved=0)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=100))
    running = submit(batcher, 0.0)
    await backend.started.wait()  # the one slot is taken: the rest wait in the queue
    waiting = [submit(batcher, float(i), timeout_s=0.05) for i in range(1, 11)]
    for task in waiting:
        with pytest.raises(errors.DeadlineExceeded):
            await task
    (queue,) = batcher._queues.values()
    queued = [item for level in queue._levels.values() for item in level]
    assert len(queued) == 10  # still in the deque: the batching task has not passed them yet ...
    assert all(item.inputs == [] for item in queued)  # ... without their bytes
    backend.gate.set()
    await running
    await batcher.close()


@pytest.mark.service
async def test_the_batcher_holds_each_submitted_request_in_its_budget_until_answered():
    backend = GatedBackend(max_batch=1, capacity=1, reserved=0)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=100))
    budget = ByteBudget("batcher", 3 * 41 * KIB)
    server = grpc.aio.server()
    batcher_pb2_grpc.add_BatcherServicer_to_server(BatcherServicer(batcher, None, asyncio.Event(), budget), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = batcher_pb2_grpc.BatcherStub(channel).Submit()
        row_bytes = np.full((1, 10 * KIB), 1.0, np.float32).tobytes()  # 40 KiB: three fit
        for i in range(1, 5):
            await call.write(
                batcher_pb2.SubmitRequest(
                    id=i,
                    model="m",
                    version="1",
                    timeout_ms=30_000,
                    inputs=[Tensor(name="X", datatype="FP32", shape=[1, 10 * KIB], data=row_bytes)],
                )
            )
        refused = await call.read()
        assert refused.id == 4 and refused.error.code == errors.ResourceExhausted.code
        assert "past its byte budget" in refused.error.message and refused.error.retry_after_ms > 0
        assert budget.held_requests == 3
        backend.gate.set()
        assert {(await call.read()).id for _ in range(3)} == {1, 2, 3}
        await call.done_writing()
        await until(lambda: budget.held_bytes == 0, "nothing held once all are answered")
    await server.stop(0)
    await batcher.close()


@pytest.mark.service
def test_the_cache_holds_stored_results_in_its_budget_until_written(tmp_path):
    """Redis stopped: writes wait, the stored results are held, and those past
    the budget are dropped (a failed store: nobody waits for one) before they
    reach Redis."""
    mesh = Mesh(
        MeshConfig(
            log_dir=tmp_path / "logs",
            cache_args=(
                "--max-message-bytes",
                str(1 * MIB),
                "--request-budget-bytes",
                str(2 * MIB),
                "--redis-timeout-ms",
                "20000",
            ),
        )
    )
    try:
        mesh.start_redis()
        mesh.start_cache().wait_ready(60)
        redis_pid = mesh.processes["redis"].popen.pid
        outputs = tensors_to_proto([from_numpy("Y", np.ones((1, 200 * KIB), np.float32))])  # 800 KiB
        requests = [cache_pb2.StoreRequest(model="m", digest=bytes([i]) * 16, outputs=outputs) for i in range(4)]
        os.kill(redis_pid, signal.SIGSTOP)
        try:
            with grpc.insecure_channel(mesh.address("cache")) as channel:
                future = cache_pb2_grpc.CacheStub(channel).Store.future(iter(requests), timeout=60)
                url = mesh.metrics_url("cache")
                wait_until(
                    lambda: metric(url, "infermesh_budget_refusals_total", service="cache") == 2,
                    "the two stores past the budget refused",
                )
                assert metric(url, "infermesh_held_request_bytes", service="cache") > 1.5 * MIB
                os.kill(redis_pid, signal.SIGCONT)
                summary = future.result()
                assert (summary.stored, summary.failed) == (2, 2)
                wait_until(
                    lambda: metric(url, "infermesh_held_request_bytes", service="cache") == 0,
                    "nothing held once written",
                )
        finally:
            os.kill(redis_pid, signal.SIGCONT)
    finally:
        mesh.stop()
