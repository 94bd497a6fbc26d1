"""The multiplexed stream client (services/common/streams.py) against a real
gRPC server whose streams are answered by the servers' own answer_concurrently."""

import asyncio
import contextlib

import grpc
import pytest
from infermesh.batcher.v1 import batcher_pb2, batcher_pb2_grpc
from infermesh.common.v1.tensor_pb2 import Tensor

from services.batcher.server import FRAMING
from services.common.streams import Framing, StreamMux, answer_concurrently, framed
from services.router.clients import submit_framing
from tests.conftest import settle, until


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


@pytest.mark.service
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
        mux = StreamMux(
            "echo",
            batcher_pb2_grpc.BatcherStub(channel).Submit,
            lambda i: batcher_pb2.SubmitRequest(id=i, cancel=True),
            max_age_s=0.2,
        )

        def submit(model):
            return mux.request(lambda i: batcher_pb2.SubmitRequest(id=i, model=model), timeout_s=10)

        assert (await submit("fast")).version == "fast"
        slow = asyncio.create_task(submit("slow"))  # in flight on the first stream
        await asyncio.sleep(0.3)  # the first stream is now past its age (0.2 s): the time is the point
        assert (await submit("fast")).version == "fast"  # on a second stream
        assert mux.opened == 2 and servicer.opened == 2 and servicer.ended == 0
        servicer.gates["slow"].set()
        assert (await slow).version == "slow"  # answered on the retired stream, which then ends
        await until(lambda: servicer.ended == 1, "the retired stream ended")
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


@pytest.mark.service
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
        mux = StreamMux(
            "held", batcher_pb2_grpc.BatcherStub(channel).Submit, lambda i: batcher_pb2.SubmitRequest(id=i, cancel=True)
        )
        big = Tensor(name="X", datatype="UINT8", shape=[32 << 20], data=bytes(32 << 20))  # beyond any window
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30

        def later(request_id):
            return batcher_pb2.SubmitRequest(id=request_id, timeout_ms=int(1000 * (deadline - loop.time())))

        first = asyncio.create_task(mux.request(lambda i: batcher_pb2.SubmitRequest(id=i, inputs=[big]), 30))
        await settle()  # the big one goes first, and stalls: the server reads nothing yet
        with pytest.raises(TimeoutError):
            await mux.request(lambda i: batcher_pb2.SubmitRequest(id=i), 0.2)  # gives up before it is sent
        third = asyncio.create_task(mux.request(later, 30))
        await asyncio.sleep(1.0)  # the time waited is the point: the third must say what is left when sent
        servicer.hold.set()
        await first
        await third
        requests = [(i, timeout_ms) for i, cancel, timeout_ms in servicer.received if not cancel]
        assert [i for i, _ in requests] == [1, 3]  # 2 never went out
        assert requests[1][1] < 29_000  # stated when sent, a second or more after it was asked for
        await mux.close()
    await server.stop(0)


class Frames(batcher_pb2_grpc.BatcherServicer):
    """SubmitMany as the batcher answers it (answer_concurrently with its
    framing); counts the frames and requests it read. Requests for model
    "slow" wait for `gate`."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.frames = 0
        self.requests = 0

    async def SubmitMany(self, request_iterator, context):
        async def counted():
            async for frame in request_iterator:
                self.frames += 1
                self.requests += len(frame.requests)
                yield frame

        async def handle(request):
            if request.cancel:
                return None
            if request.model == "slow":
                await self.gate.wait()
            return batcher_pb2.SubmitResponse(id=request.id, version=request.model)

        async for response in answer_concurrently(counted(), handle, lambda r, e: None, 1024, framing=FRAMING):
            yield response


@contextlib.asynccontextmanager
async def frames_server():
    """(servicer, port); on the way out, held requests are let go, so that a
    failed assertion cannot leave the channel waiting on them."""
    servicer = Frames()
    server = grpc.aio.server()
    batcher_pb2_grpc.add_BatcherServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, port
    finally:
        servicer.gate.set()
        await server.stop(0)


@pytest.mark.service
async def test_requests_queued_together_share_a_frame_and_each_gets_its_own_answer():
    """While requests are in flight, those that come within the linger go out
    as one message; answers ready together come back as one."""
    async with frames_server() as (servicer, port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        mux = StreamMux(
            "frames",
            batcher_pb2_grpc.BatcherStub(channel).SubmitMany,
            lambda i: batcher_pb2.SubmitRequest(id=i, cancel=True),
            framing=submit_framing(0.5),
        )

        def submit(model, at_once=False):
            return mux.request(lambda i: batcher_pb2.SubmitRequest(id=i, model=model), 10, at_once=at_once)

        held = asyncio.create_task(submit("slow"))  # in flight: the next ones may linger
        await until(lambda: servicer.requests == 1, "the slow request at the server")
        submits = []
        for k in range(20):  # a few milliseconds apart: each alone would be a message of its own
            submits.append(asyncio.create_task(submit(f"m{k}")))
            await asyncio.sleep(0.005)
        answers = await asyncio.gather(*submits)
        assert [a.version for a in answers] == [f"m{k}" for k in range(20)]
        assert servicer.requests == 21 and servicer.frames <= 3, (servicer.frames, servicer.requests)
        servicer.gate.set()
        assert (await held).version == "slow"
        await mux.close()


@pytest.mark.service
async def test_an_urgent_request_does_not_wait_out_the_linger():
    async with frames_server() as (servicer, port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        mux = StreamMux(
            "frames",
            batcher_pb2_grpc.BatcherStub(channel).SubmitMany,
            lambda i: batcher_pb2.SubmitRequest(id=i, cancel=True),
            framing=submit_framing(30.0),
        )
        held = asyncio.create_task(mux.request(lambda i: batcher_pb2.SubmitRequest(id=i, model="slow"), 60))
        await until(lambda: servicer.requests == 1, "the slow request at the server")
        # A standard one lingers (30 s here) for company; an urgent one sends the frame at once.
        lingering = asyncio.create_task(mux.request(lambda i: batcher_pb2.SubmitRequest(id=i, model="std"), 60))
        await asyncio.sleep(0.2)  # time in which it would have gone out, were it not lingering
        assert not lingering.done()
        at_once = await asyncio.wait_for(
            mux.request(lambda i: batcher_pb2.SubmitRequest(id=i, model="vip"), 60, at_once=True), 5
        )
        assert at_once.version == "vip" and (await asyncio.wait_for(lingering, 5)).version == "std"
        servicer.gate.set()
        await held
        await mux.close()


@pytest.mark.unit
async def test_a_frame_stops_growing_at_its_byte_bound_and_keeps_the_order():
    """What does not fit starts the next frame; nothing is lost or reordered,
    and the end marker still ends the stream after the last frame."""
    queue: asyncio.Queue = asyncio.Queue()
    sizes = [300, 300, 300, 5000, 10, 10]
    for k, size in enumerate(sizes):
        queue.put_nowait(batcher_pb2.SubmitRequest(id=k, model="x" * size))
    queue.put_nowait(None)
    framing = Framing(
        pack=lambda requests: batcher_pb2.SubmitManyRequest(requests=requests),
        unpack=lambda frame: frame.requests,
        max_bytes=1000,
    )
    sent = []
    frames = [[r.id for r in frame.requests] async for frame in framed(queue, framing, lambda m: m, sent.append)]
    assert frames == [[0, 1, 2], [3], [4, 5]]
    assert sent == [3, 1, 2]
