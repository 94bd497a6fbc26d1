"""The batcher's gRPC face: a bidi Submit stream multiplexed by request id."""

import asyncio
import logging

from infermesh.batcher.v1 import batcher_pb2, batcher_pb2_grpc

from services.batcher.config import BatcherConfig
from services.batcher.core import Batcher
from services.batcher.replicas import ReplicaSet
from services.common import errors, serving, tls, tracing
from services.common.budget import ByteBudget
from services.common.protoconv import error_to_proto, tensors_from_proto, tensors_to_proto
from services.common.streams import Framing, answer_concurrently

log = logging.getLogger(__name__)
SERVICE_NAME = batcher_pb2.DESCRIPTOR.services_by_name["Batcher"].full_name
MAX_INFLIGHT_PER_STREAM = 8192
MAX_FIELDS = 1 << 17  # of one Submit or SubmitMany message, its requests' and tensors' included
DATA_METHODS = frozenset({"Submit", "SubmitMany"})
# The frames of SubmitMany, both ways (the router packs its own the same way).
FRAMING: Framing[batcher_pb2.SubmitResponse, batcher_pb2.SubmitManyRequest] = Framing(
    pack=lambda requests: batcher_pb2.SubmitManyResponse(responses=requests), unpack=lambda frame: frame.requests
)


class BatcherServicer(batcher_pb2_grpc.BatcherServicer):
    def __init__(
        self, batcher: Batcher, replicas: ReplicaSet, draining: asyncio.Event, budget: ByteBudget | None = None
    ):
        self._batcher = batcher
        self._replicas = replicas
        self._draining = draining
        self._budget = budget  # each request is held in it from when it is read until answered

    async def Submit(self, request_iterator, context):
        """Answers every request of the stream exactly once, in completion
        order. A cancel message drops its request before it runs; when the
        caller goes away, all of its requests are dropped. Once draining, the
        requests read are answered and the stream ends UNAVAILABLE: the
        caller sends what it has no answer for to another replica."""
        async for response in self._answer(request_iterator):
            yield response

    async def SubmitMany(self, request_iterator, context):
        """Submit with several requests to a message each way."""
        async for response in self._answer(request_iterator, FRAMING):
            yield response

    def _answer(self, request_iterator, framing: Framing | None = None):
        running: dict[int, asyncio.Task] = {}

        def error(request, exc: errors.InfermeshError):
            return batcher_pb2.SubmitResponse(id=request.id, error=error_to_proto(exc))

        async def handle(request):
            if request.cancel:
                task = running.get(request.id)
                if task is not None:
                    task.cancel()
                return None
            if request.id in running:
                return error(
                    request, errors.InvalidArgument(f"request id {request.id} is already in flight on this stream")
                )
            task = asyncio.current_task()
            assert task is not None  # each request is handled in a task of its own (answer_concurrently)
            running[request.id] = task
            span = (
                tracing.start_request("batcher.submit", request.traceparent, {"model": request.model})
                if request.traceparent and tracing.is_on()
                else None
            )
            token = tracing.activate(span)
            code = "INTERNAL"
            try:
                version, outputs = await self._batcher.submit(
                    request.model,
                    request.version,
                    tensors_from_proto(request.inputs),
                    list(request.outputs),
                    tier=request.tier,
                    timeout_s=request.timeout_ms / 1000 if request.timeout_ms else None,
                    tenant=request.tenant,
                    weight=request.tenant_weight,
                )
                code = "OK"
                return batcher_pb2.SubmitResponse(id=request.id, version=version, outputs=tensors_to_proto(outputs))
            except errors.InfermeshError as exc:
                code = exc.code_name
                return error(request, exc)
            finally:
                running.pop(request.id, None)
                tracing.finish(span, token, code)

        def on_error(request, exc):
            return error(request, errors.Internal("internal error in the batcher; see its log"))

        return answer_concurrently(
            request_iterator,
            handle,
            on_error,
            MAX_INFLIGHT_PER_STREAM,
            self._draining,
            framing,
            budget=self._budget,
            on_refused=error,
        )

    async def ListModels(self, request, context):
        return batcher_pb2.ListModelsResponse(models=self._replicas.models())


async def build_server(
    config: BatcherConfig, batcher: Batcher, replicas: ReplicaSet, draining: asyncio.Event, port: int | None = None
):
    """Returns (server, bound_port, health servicer); the server is started."""
    # A frame of the router's holds at most 256 requests of a few fields each
    # per input: a message of many more was built to be slow to parse.
    server = serving.new_server(
        "batcher",
        config.max_message_bytes,
        limits=config,
        data_methods=DATA_METHODS,
        decoders={
            "Submit": serving.BoundedDecoder(batcher_pb2.SubmitRequest, MAX_FIELDS, "Submit"),
            "SubmitMany": serving.BoundedDecoder(batcher_pb2.SubmitManyRequest, MAX_FIELDS, "SubmitMany"),
        },
    )
    budget = ByteBudget("batcher", config.budget_bytes)
    batcher_pb2_grpc.add_BatcherServicer_to_server(BatcherServicer(batcher, replicas, draining, budget), server)
    health = serving.add_health_and_reflection(server, [SERVICE_NAME])
    bound = tls.bind(server, f"{config.host}:{config.port if port is None else port}", tls.server_credentials(config))
    await server.start()
    await serving.set_serving(health, [SERVICE_NAME], True)
    return server, bound, health
