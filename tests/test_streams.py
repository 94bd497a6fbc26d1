"""The multiplexed stream client (services/common/streams.py) against a real
gRPC server whose streams are answered by the servers' own answer_concurrently."""

import asyncio

import grpc
from infermesh.batcher.v1 import batcher_pb2, batcher_pb2_grpc

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
