"""The model server's gRPC faces: Execute one batch and list models (internal),
and the Open Inference Protocol's health and model-repository RPCs, which
tritonclient can call directly (is_model_ready, load_model, unload_model,
get_model_repository_index)."""

import asyncio
import logging

from grpc_health.v1 import health_pb2
from inference import grpc_predict_v2_pb2 as oip_pb2
from inference import grpc_predict_v2_pb2_grpc as oip_grpc
from infermesh.common.v1 import tensor_pb2
from infermesh.model_server.v1 import model_server_pb2, model_server_pb2_grpc

from services.common import errors, identity, serving, tls, tracing
from services.common.budget import ByteBudget
from services.common.protoconv import tensors_from_proto, tensors_to_proto
from services.model_server import metrics
from services.model_server.config import ModelServerConfig
from services.model_server.core import ControlMode, ModelManager, parse_overrides

log = logging.getLogger(__name__)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_NAME = model_server_pb2.DESCRIPTOR.services_by_name["ModelServer"].full_name
OIP_SERVICE_NAME = oip_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


class ModelServerServicer(model_server_pb2_grpc.ModelServerServicer):
    def __init__(self, manager: ModelManager, labels: dict[str, str] | None = None):
        self._manager = manager
        self._labels = labels or {}

    async def Execute(self, request, context):
        inputs = tensors_from_proto(request.inputs)
        rows = inputs[0].rows if inputs else 0
        # Only models of the repository become label values: callers cannot grow the series.
        label = request.model if self._manager.is_known(request.model) else "unknown"
        span = _traced(context, label, rows) if tracing.is_on() else None
        token = tracing.activate(span)
        code = "INTERNAL"
        try:
            with metrics.track(label, rows) as record:
                version, outputs = await self._manager.execute(
                    request.model,
                    request.version,
                    inputs,
                    list(request.outputs),
                    tier=request.tier,
                    timeout_s=context.time_remaining(),
                )
                record(version)
            with tracing.step("model_server.encode"):
                response = model_server_pb2.ExecuteResponse(
                    model=request.model, version=version, outputs=tensors_to_proto(outputs)
                )
            code = "OK"
            return response
        except errors.InfermeshError as exc:
            code = exc.code_name
            raise
        finally:
            tracing.finish(span, token, code)

    async def ListModels(self, request, context):
        return model_server_pb2.ListModelsResponse(
            models=[_model_info(*entry, self._manager.instances(entry[0].name)) for entry in self._manager.models()],
            labels=self._labels,
        )


def _traced(context, model: str, rows: int):
    """The batch's span here, when the batcher's span of it is sampled (its traceparent metadata)."""
    traceparent = next((v for k, v in context.invocation_metadata() or () if k == tracing.TRACEPARENT), "")
    if not isinstance(traceparent, str) or not traceparent:
        return None
    return tracing.start_request("model_server.execute", traceparent, {"model": model, "batch.rows": rows})


class RepositoryServicer(oip_grpc.GRPCInferenceServiceServicer):
    """Health and model control in the Open Inference Protocol (Triton's
    repository extension); inference itself goes through the router."""

    def __init__(self, manager: ModelManager, admin: identity.AdminGate):
        self._manager = manager
        self._admin = admin

    async def ServerLive(self, request, context):
        return oip_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return oip_pb2.ServerReadyResponse(ready=self._manager.all_ready())

    async def ModelReady(self, request, context):
        return oip_pb2.ModelReadyResponse(ready=self._manager.is_ready(request.name, request.version))

    async def ModelMetadata(self, request, context):
        config = self._manager.config_of(request.name)
        versions = [v for c, loaded, _, _ in self._manager.models() if c.name == request.name for v in loaded]

        def specs(items):
            return [
                oip_pb2.ModelMetadataResponse.TensorMetadata(name=s.name, datatype=s.datatype, shape=s.shape)
                for s in items
            ]

        return oip_pb2.ModelMetadataResponse(
            name=config.name,
            versions=versions,
            platform=config.platform,
            inputs=specs(config.inputs),
            outputs=specs(config.outputs),
        )

    async def RepositoryIndex(self, request, context):
        entries = self._manager.index(ready_only=request.ready)
        return oip_pb2.RepositoryIndexResponse(
            models=[
                oip_pb2.RepositoryIndexResponse.ModelIndex(
                    name=e.name, version=e.version, state=e.state, reason=e.reason
                )
                for e in entries
            ]
        )

    async def RepositoryModelLoad(self, request, context):
        self._admin.check(context, f"load model {errors.shown(request.model_name)}")
        self._check_control("load")
        overrides = None
        for key, value in request.parameters.items():
            if key != "config" or value.WhichOneof("parameter_choice") != "string_param":
                raise errors.InvalidArgument(
                    f"load parameter '{key}' is not supported; the only one is 'config', a JSON string of config fields"
                )
            overrides = parse_overrides(value.string_param)
        await self._manager.load(request.model_name, overrides)
        return oip_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        self._admin.check(context, f"unload model {errors.shown(request.model_name)}")
        self._check_control("unload")
        await self._manager.unload(request.model_name)
        return oip_pb2.RepositoryModelUnloadResponse()

    def _check_control(self, action: str) -> None:
        mode = self._manager.control_mode
        if mode is not ControlMode.EXPLICIT:
            raise errors.FailedPrecondition(
                f"cannot {action} models by request: model control mode is '{mode.value}' "
                f"({'the repository on disk decides' if mode is ControlMode.POLL else 'models are fixed at startup'}); "
                "start the model server with --model-control-mode explicit"
            )


def _model_info(config, versions, ready_versions, revisions, instances: tuple[int, int, bool]) -> tensor_pb2.ModelInfo:
    def specs(items):
        return [tensor_pb2.TensorSpec(name=s.name, datatype=s.datatype, shape=s.shape) for s in items]

    return tensor_pb2.ModelInfo(
        name=config.name,
        versions=versions,
        ready_versions=ready_versions,
        platform=config.platform,
        inputs=specs(config.inputs),
        outputs=specs(config.outputs),
        max_batch_size=config.max_batch_size,
        revisions=revisions,
        fallback=config.fallback,
        instances=instances[0],
        reserved_instances=instances[1],
        lending=instances[2],
    )


class Readiness:
    """Per-model grpc.health.v1 status (the service name is the model's name)
    and the overall one, following the manager's state."""

    def __init__(self):
        self.health = None
        self._manager: ModelManager | None = None
        self._pending: set[asyncio.Task] = set()

    def attach(self, health, manager: ModelManager) -> None:
        self.health, self._manager = health, manager

    def __call__(self, model: str, ready: bool) -> None:
        if self.health is None:
            return  # startup: published once the server is up
        task = asyncio.get_running_loop().create_task(self.publish(model, ready))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def publish(self, model: str, ready: bool) -> None:
        health, manager = self.health, self._manager
        assert health is not None and manager is not None  # attached before anything is published (__call__)
        await health.set(model, SERVING if ready else NOT_SERVING)
        await health.set("", SERVING if manager.all_ready() else NOT_SERVING)


MAX_FIELDS = 1 << 17  # of one Execute message, all its tensors' included


async def build_server(
    config: ModelServerConfig, manager: ModelManager, port: int | None = None, readiness: Readiness | None = None
):
    """Returns (server, bound_port, health servicer); the server is started and
    health follows the models' readiness."""
    # A batch holds a few fields per input whatever its size: a message of
    # many more was built to be slow to parse, and is refused unparsed. Execute
    # holds its batch in the byte budget from before it is parsed until it is answered.
    execute = serving.BoundedDecoder(model_server_pb2.ExecuteRequest, MAX_FIELDS, "Execute")
    server = serving.new_server(
        "model_server",
        config.max_message_bytes,
        config.max_concurrent_rpcs,
        limits=config,
        data_methods=frozenset({"Execute"}),
        budget=ByteBudget("model_server", config.budget_bytes),
        decoders={"Execute": execute},
    )
    model_server_pb2_grpc.add_ModelServerServicer_to_server(ModelServerServicer(manager, config.label_map), server)
    admin = identity.AdminGate.from_file(config.tenants_file, "model server")
    oip_grpc.add_GRPCInferenceServiceServicer_to_server(RepositoryServicer(manager, admin), server)
    health = serving.add_health_and_reflection(server, [SERVICE_NAME, OIP_SERVICE_NAME])
    bound = tls.bind(server, f"{config.host}:{config.port if port is None else port}", tls.server_credentials(config))
    await server.start()
    await serving.set_serving(health, [SERVICE_NAME, OIP_SERVICE_NAME], True)
    if readiness is not None:
        readiness.attach(health, manager)
        for model_config, _, ready, _ in manager.models():
            await health.set(model_config.name, SERVING if ready else NOT_SERVING)
        await health.set("", SERVING if manager.all_ready() else NOT_SERVING)
    return server, bound, health
