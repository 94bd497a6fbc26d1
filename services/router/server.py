"""The router's gRPC face: the Open Inference Protocol, unary and streaming."""

import asyncio
import logging

from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.common import errors, serving
from services.router.config import RouterConfig
from services.router.core import Router
from services.router.oip import metadata_to_proto, request_from_proto, response_to_proto

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
SERVER_VERSION = "0.1.0"


def _metadata(context) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, router: Router, max_stream_inflight: int):
        self._router = router
        self._max_stream_inflight = max_stream_inflight

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._router.catalog.is_ready())

    async def ModelReady(self, request, context):
        self._router.signature(request.name, request.version)  # NOT_FOUND for unknown names
        return pb.ModelReadyResponse(ready=self._router.is_model_ready(request.name, request.version))

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="infermesh", version=SERVER_VERSION, extensions=["model_stream_infer"])

    async def ModelMetadata(self, request, context):
        sig, _ = self._router.signature(request.name, request.version)
        return metadata_to_proto(sig)

    async def ModelInfer(self, request, context):
        infer_request = request_from_proto(request, _metadata(context), context.time_remaining())
        return response_to_proto(await self._router.infer(infer_request))

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests run concurrently (at most max_stream_inflight at once, then
        reading pauses); each gets one response, in completion order. A failed
        request is an error_message on the stream, which stays open."""
        metadata = _metadata(context)
        outbox: asyncio.Queue = asyncio.Queue()
        slots = asyncio.Semaphore(self._max_stream_inflight)
        tasks: set[asyncio.Task] = set()

        async def answer(request) -> None:
            try:
                result = await self._router.infer(request_from_proto(request, metadata, context.time_remaining()))
                outbox.put_nowait(pb.ModelStreamInferResponse(infer_response=response_to_proto(result)))
            except errors.InfermeshError as exc:
                outbox.put_nowait(_stream_error(request, exc))
            except Exception:  # noqa: BLE001 - one request's bug must not end the stream
                log.exception("stream request %r failed unexpectedly", request.id)
                outbox.put_nowait(_stream_error(request, errors.Internal("internal error in the router; see its log")))
            finally:
                slots.release()

        async def read() -> None:
            async for request in request_iterator:
                await slots.acquire()
                task = asyncio.create_task(answer(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
            outbox.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (response := await outbox.get()) is not None:
                yield response
            await reader
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()


def _stream_error(request, exc: errors.InfermeshError) -> pb.ModelStreamInferResponse:
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version, id=request.id)
    response.parameters["grpc_status"].string_param = exc.code_name
    return pb.ModelStreamInferResponse(error_message=f"{exc.code_name}: {exc.message}", infer_response=response)


async def build_server(config: RouterConfig, router: Router, port: int | None = None):
    """Returns (server, bound_port, health servicer); the server is started."""
    server = serving.new_server("router", config.max_request_bytes, config.max_concurrent_rpcs)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(router, config.max_stream_inflight), server)
    health = serving.add_health_and_reflection(server, [SERVICE_NAME])
    bound = server.add_insecure_port(f"{config.host}:{config.port if port is None else port}")
    await server.start()
    return server, bound, health
