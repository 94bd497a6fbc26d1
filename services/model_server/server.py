"""The model server's gRPC face: Execute one batch, list models."""

import logging

from infermesh.common.v1 import tensor_pb2
from infermesh.model_server.v1 import model_server_pb2, model_server_pb2_grpc

from services.common import serving
from services.common.protoconv import tensors_from_proto, tensors_to_proto
from services.model_server import metrics
from services.model_server.config import ModelServerConfig
from services.model_server.core import ModelManager

log = logging.getLogger(__name__)
SERVICE_NAME = model_server_pb2.DESCRIPTOR.services_by_name["ModelServer"].full_name


class ModelServerServicer(model_server_pb2_grpc.ModelServerServicer):
    def __init__(self, manager: ModelManager):
        self._manager = manager

    async def Execute(self, request, context):
        inputs = tensors_from_proto(request.inputs)
        rows = inputs[0].rows if inputs else 0
        with metrics.track(request.model, rows) as record:
            version, outputs = await self._manager.execute(request.model, request.version, inputs, list(request.outputs),
                                                           priority=request.priority)
            record(version)
        return model_server_pb2.ExecuteResponse(model=request.model, version=version, outputs=tensors_to_proto(outputs))

    async def ListModels(self, request, context):
        return model_server_pb2.ListModelsResponse(models=[_model_info(c, v) for c, v in self._manager.models()])


def _model_info(config, versions) -> tensor_pb2.ModelInfo:
    def specs(items):
        return [tensor_pb2.TensorSpec(name=s.name, datatype=s.datatype, shape=s.shape) for s in items]

    return tensor_pb2.ModelInfo(
        name=config.name,
        versions=versions,
        ready_versions=versions,
        platform=config.platform,
        inputs=specs(config.inputs),
        outputs=specs(config.outputs),
        max_batch_size=config.max_batch_size,
    )


async def build_server(config: ModelServerConfig, manager: ModelManager, port: int | None = None):
    """Returns (server, bound_port, health servicer); the server is started."""
    server = serving.new_server("model_server", config.max_message_bytes, config.max_concurrent_rpcs)
    model_server_pb2_grpc.add_ModelServerServicer_to_server(ModelServerServicer(manager), server)
    health = serving.add_health_and_reflection(server, [SERVICE_NAME])
    bound = server.add_insecure_port(f"{config.host}:{config.port if port is None else port}")
    await server.start()
    await serving.set_serving(health, [SERVICE_NAME], True)
    return server, bound, health
