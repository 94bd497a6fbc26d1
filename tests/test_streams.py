"""The multiplexed stream client (services/common/streams.py) against a real
gRPC server whose streams are answered by the servers' own answer_concurrently."""

import asyncio

import grpc
import pytest
from infermesh.batcher.v1 import batcher_pb2, batcher_pb2_grpc
from infermesh.common.v1.tensor_pb2 import Tensor

from services.common.streams import StreamMux, answer_concurrently


class Echo(batcher_pb2_grpc.BatcherServicer):
    """Answers each request with its id and model once `gate` is open for
    that model; counts the streams it was opened and the ones that ended."""

    def __init__(self):
        self.gates = {"slow": asyncio.Event()}
        self.opened = 0
        self.ended = 0

    async def Submit(self, request_iterator, context):
        self.opened += 1

        async def handle(request):
            if request.cancel:
                return None
            if request.model in self.gates:
                await self.gates[request.model].wait()
            return batcher_pb2.SubmitResponse(id=request.id, version=request.model)

        async for response in answer_concurrently(request_iterator, handle, lambda r, e: None, 64):
            yield response
        self.ended += 1


async def test_a_stream_past_its_age_takes_no_new_requests_and_ends_once_it_has_answered():
    """Behind a mesh a stream stays on the pod it first reached: replacing it
    after an age lets replicas added since get their share, and the requests
    it carries are answered all the same."""
    servicer = Echo()
    server = grpc.aio.server()
    batcher_pb2_grpc.add_BatcherServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        mux = StreamMux("echo", batcher_pb2_grpc.BatcherStub(channel).Submit,
                        lambda i: batcher_pb2.SubmitRequest(id=i, cancel=True), max_age_s=0.2)

        def submit(model):
            return mux.request(lambda i: batcher_pb2.SubmitRequest(id=i, model=model), timeout_s=10)

        assert (await submit("fast")).version == "fast"
        slow = asyncio.create_task(submit("slow"))  # in flight on the first stream
        await asyncio.sleep(0.3)  # the first stream is now past its age
        assert (await submit("fast")).version == "fast"  # on a second stream
        assert mux.opened == 2 and servicer.opened == 2 and servicer.ended == 0
        servicer.gates["slow"].set()
        assert (await slow).version == "slow"  # answered on the retired stream, which then ends
        for _ in range(100):
            if servicer.ended == 1:
                break
            await asyncio.sleep(0.01)
        assert servicer.ended == 1
        await mux.close()
    await server.stop(0)


class Held(batcher_pb2_grpc.BatcherServicer):
    """Reads nothing until `hold` is set (a stalled batcher), then answers each
    request at once; records what reached it."""

    def __init__(self):
        self.hold = asyncio.Event()
        self.received: list[tuple[int, bool, int]] = []  # (id, cancel, timeout_ms)

    async def Submit(self, request_iterator, context):
        await self.hold.wait()
        async for request in request_iterator:
            self.received.append((request.id, request.cancel, request.timeout_ms))
            if not request.cancel:
                yield batcher_pb2.SubmitResponse(id=request.id)


async def test_a_request_waiting_to_be_sent_is_built_then_and_dropped_if_its_caller_left():
    """A request queued behind a stalled stream states the time it has left when
    it is sent, and one whose caller gave up meanwhile is never sent (it would
    run for nobody)."""
    servicer = Held()
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    batcher_pb2_grpc.add_BatcherServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        mux = StreamMux("held", batcher_pb2_grpc.BatcherStub(channel).Submit,
                        lambda i: batcher_pb2.SubmitRequest(id=i, cancel=True))
        big = Tensor(name="X", datatype="UINT8", shape=[32 << 20], data=bytes(32 << 20))  # beyond any window
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30

        def later(request_id):
            return batcher_pb2.SubmitRequest(id=request_id, timeout_ms=int(1000 * (deadline - loop.time())))

        first = asyncio.create_task(mux.request(lambda i: batcher_pb2.SubmitRequest(id=i, inputs=[big]), 30))
        await asyncio.sleep(0.2)  # the big one is on the wire, stalled
        with pytest.raises(TimeoutError):
            await mux.request(lambda i: batcher_pb2.SubmitRequest(id=i), 0.2)  # gives up before it is sent
        third = asyncio.create_task(mux.request(later, 30))
        await asyncio.sleep(1.0)
        servicer.hold.set()
        await first
        await third
        requests = [(i, timeout_ms) for i, cancel, timeout_ms in servicer.received if not cancel]
        assert [i for i, _ in requests] == [1, 3]  # 2 never went out
        assert requests[1][1] < 29_000  # stated when sent, a second or more after it was asked for
        await mux.close()
    await server.stop(0)
