"""The batcher's gRPC face: a bidi Submit stream multiplexed by request id."""

import asyncio
import logging

from infermesh.batcher.v1 import batcher_pb2, batcher_pb2_grpc

from services.batcher.config import BatcherConfig
from services.batcher.core import Batcher
from services.batcher.replicas import ReplicaSet
from services.common import errors, serving
from services.common.protoconv import error_to_proto, tensors_from_proto, tensors_to_proto

log = logging.getLogger(__name__)
SERVICE_NAME = batcher_pb2.DESCRIPTOR.services_by_name["Batcher"].full_name


class BatcherServicer(batcher_pb2_grpc.BatcherServicer):
    def __init__(self, batcher: Batcher, replicas: ReplicaSet):
        self._batcher = batcher
        self._replicas = replicas

    async def Submit(self, request_iterator, context):
        """Answers every request of the stream exactly once, in completion
        order; when the caller closes the stream, outstanding requests are
        still answered; when it goes away, they are dropped before they run."""
        outbox: asyncio.Queue = asyncio.Queue()
        tasks: dict[int, asyncio.Task] = {}

        async def answer(request) -> None:
            try:
                version, outputs = await self._batcher.submit(
                    request.model, request.version, tensors_from_proto(request.inputs), list(request.outputs),
                    priority=int(request.priority), timeout_s=request.timeout_ms / 1000 if request.timeout_ms else None)
                response = batcher_pb2.SubmitResponse(id=request.id, version=version, outputs=tensors_to_proto(outputs))
            except errors.InfermeshError as exc:
                response = batcher_pb2.SubmitResponse(id=request.id, error=error_to_proto(exc))
            except asyncio.CancelledError:
                response = batcher_pb2.SubmitResponse(
                    id=request.id, error=error_to_proto(errors.Cancelled(f"request {request.id} was cancelled")))
            except Exception:  # noqa: BLE001 - the request still gets its one answer
                log.exception("request %d failed unexpectedly", request.id)
                response = batcher_pb2.SubmitResponse(
                    id=request.id, error=error_to_proto(errors.Internal("internal error in the batcher; see its log")))
            outbox.put_nowait(response)

        async def read() -> None:
            async for request in request_iterator:
                if request.cancel:
                    task = tasks.get(request.id)
                    if task is not None:
                        task.cancel()
                    continue
                task = asyncio.create_task(answer(request))
                tasks[request.id] = task
                task.add_done_callback(lambda _t, rid=request.id: tasks.pop(rid, None))
            if tasks:
                await asyncio.gather(*list(tasks.values()), return_exceptions=True)
            outbox.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while True:
                response = await outbox.get()
                if response is None:
                    break
                yield response
            await reader
        finally:
            # The caller went away (or the stream failed): drop its requests.
            reader.cancel()
            for task in list(tasks.values()):
                task.cancel()

    async def ListModels(self, request, context):
        return batcher_pb2.ListModelsResponse(models=self._replicas.models())


async def build_server(config: BatcherConfig, batcher: Batcher, replicas: ReplicaSet, port: int | None = None):
    """Returns (server, bound_port, health servicer); the server is started."""
    server = serving.new_server("batcher", config.max_message_bytes)
    batcher_pb2_grpc.add_BatcherServicer_to_server(BatcherServicer(batcher, replicas), server)
    health = serving.add_health_and_reflection(server, [SERVICE_NAME])
    bound = server.add_insecure_port(f"{config.host}:{config.port if port is None else port}")
    await server.start()
    await serving.set_serving(health, [SERVICE_NAME], True)
    return server, bound, health
