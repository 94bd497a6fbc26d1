"""The router's gRPC face: the Open Inference Protocol, unary and streaming."""

import asyncio
import logging

from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.common import errors, serving, tls
from services.common.budget import ByteBudget
from services.common.streams import answer_concurrently
from services.router.config import RouterConfig
from services.router.core import Router
from services.router.oip import RequestDecoder, metadata_to_proto, request_from_proto, response_to_proto
from services.router.tenants import Authenticator, Settings

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
SERVER_VERSION = "0.1.0"


def _metadata(context) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


DATA_METHODS = frozenset({"ModelInfer", "ModelStreamInfer"})


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        router: Router,
        max_stream_inflight: int,
        max_request_bytes: int,
        draining: asyncio.Event | None = None,
        authenticator: Authenticator | None = None,
        budget: ByteBudget | None = None,
        stream_idle_s: float | None = None,
    ):
        self._router = router
        self._auth = authenticator if authenticator is not None else Authenticator(_NO_REGISTRY)
        self._max_stream_inflight = max_stream_inflight
        self._max_request_bytes = max_request_bytes  # of a stream message
        self._draining = draining  # set when the router drains: idle streams end then
        self._budget = budget  # each stream message is held in it until answered
        self._stream_idle_s = stream_idle_s

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._router.catalog.is_ready())

    async def ModelReady(self, request, context):
        # A model or version this router does not serve is not ready, as Triton
        # answers: readiness probes written for it expect ready=false, not an error.
        return pb.ModelReadyResponse(ready=self._router.is_model_ready(request.name, request.version))

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="infermesh", version=SERVER_VERSION, extensions=["model_stream_infer"])

    async def ModelMetadata(self, request, context):
        sig, _ = self._router.signature(request.name, request.version)
        return metadata_to_proto(sig)

    async def RepositoryIndex(self, request, context):
        raise _model_control_elsewhere("RepositoryIndex")

    async def RepositoryModelLoad(self, request, context):
        raise _model_control_elsewhere("RepositoryModelLoad")

    async def RepositoryModelUnload(self, request, context):
        raise _model_control_elsewhere("RepositoryModelUnload")

    async def ModelInfer(self, request, context):
        metadata = _metadata(context)
        tenant = self._caller(context, metadata)
        infer_request = self._as(tenant, request_from_proto(request, metadata, context.time_remaining()))
        return response_to_proto(await self._router.infer(infer_request))

    def _caller(self, context, metadata: dict[str, str]):
        """The call's tenant: by its credentials, the verified client certificate,
        and (behind a trusted sidecar) the identity headers as sent."""
        return self._auth.caller(metadata, tls.peer_identities(context), tuple(context.invocation_metadata() or ()))

    def _as(self, tenant, infer_request):
        """The request as its tenant's: the tier it may use (PERMISSION_DENIED beyond)."""
        infer_request.tenant = tenant
        infer_request.tier = self._auth.tier(tenant, infer_request.claimed_tier)
        return infer_request

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests run concurrently; each gets one response, in completion
        order. A failed request is an error_message on the stream, which stays
        open; a request over the size limit fails alone. The stream's
        credentials are checked once, before it is read: unknown ones end it
        with UNAUTHENTICATED."""
        metadata = _metadata(context)
        tenant = self._caller(context, metadata)

        async def answer(request):
            if isinstance(request, serving.Malformed):
                raise request.error
            if isinstance(request, serving.Oversized):
                raise errors.ResourceExhausted(
                    f"request of {request.size} bytes exceeds the limit of {self._max_request_bytes} bytes"
                )
            result = await self._router.infer(
                self._as(tenant, request_from_proto(request, metadata, context.time_remaining()))
            )
            return pb.ModelStreamInferResponse(infer_response=response_to_proto(result))

        async def handle(request):
            try:
                return await answer(request)
            except errors.InfermeshError as exc:
                return _stream_error(request, exc)

        def on_error(request, exc):
            return _stream_error(request, errors.Internal("internal error in the router; see its log"))

        async for response in answer_concurrently(
            request_iterator,
            handle,
            on_error,
            self._max_stream_inflight,
            self._draining,
            budget=self._budget,
            on_refused=_stream_error,
            size=_message_size,
            idle_s=self._stream_idle_s,
        ):
            yield response


def _message_size(request) -> int:
    if isinstance(request, (serving.Oversized, serving.Malformed)):
        return request.size
    return request.ByteSize()


_NO_REGISTRY = Settings(registry=None)


def _model_control_elsewhere(method: str) -> errors.InfermeshError:
    return errors.Unimplemented(
        f"{method} is not served by the router: models are loaded and unloaded on the model servers "
        "(their GRPCInferenceService, or meshctl), and the router follows their catalog"
    )


def _stream_error(request, exc: errors.InfermeshError) -> pb.ModelStreamInferResponse:
    """The one answer of a stream request that failed: its error, with the
    request's model, version and id (none for a message that could not be
    read), the gRPC status name and a refusal's retry hint as parameters."""
    if isinstance(request, serving.Malformed):
        request = request.partial  # what the decoder could read of it, if anything
    elif isinstance(request, serving.Oversized):
        request = request.message
    if request is None:
        response = pb.ModelInferResponse()
    else:
        response = pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        )
    response.parameters["grpc_status"].string_param = exc.code_name
    if isinstance(exc, errors.ResourceExhausted) and exc.retry_after_ms:
        response.parameters[errors.RETRY_AFTER_METADATA.replace("-", "_")].int64_param = exc.retry_after_ms
    return pb.ModelStreamInferResponse(
        error_message=errors.clipped(f"{exc.code_name}: {exc.message}"), infer_response=response
    )


async def build_server(
    config: RouterConfig,
    router: Router,
    port: int | None = None,
    draining: asyncio.Event | None = None,
    authenticator: Authenticator | None = None,
):
    """Returns (server, bound_port, health servicer); the server is started.
    Once `draining` is set, each stream ends as soon as nothing is in flight on it."""
    # The transport takes up to 4x the limit so that on a stream one oversized
    # request fails alone instead of taking the whole stream down with it.
    decoder = RequestDecoder(router.limits)
    largest = max(config.max_request_bytes, config.stream_message_bytes)
    budget = ByteBudget("router", config.budget_bytes)
    server = serving.new_server(
        "router",
        min(4 * largest, 2**31 - 1),
        config.max_concurrent_rpcs,
        max_request_bytes=config.max_request_bytes,
        reuse_port=config.reuse_port,
        limits=config,
        data_methods=DATA_METHODS,
        budget=budget,
        max_stream_message_bytes=config.stream_message_bytes,
        decoders={"ModelInfer": decoder, "ModelStreamInfer": decoder},
    )
    servicer = InferenceServicer(
        router,
        config.max_stream_inflight,
        config.stream_message_bytes,
        draining,
        authenticator,
        budget,
        config.stream_idle_timeout_s or None,
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    health = serving.add_health_and_reflection(server, [SERVICE_NAME])
    bound = tls.bind(server, f"{config.host}:{config.port if port is None else port}", tls.server_credentials(config))
    await server.start()
    return server, bound, health
