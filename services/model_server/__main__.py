"""Runs the model server: python -m services.model_server --model-repository build/models."""

import asyncio
import sys

from services.common import serving
from services.common.metrics import start_metrics_server
from services.model_server.config import ModelServerConfig
from services.model_server.core import ModelManager
from services.model_server.server import build_server


async def serve(config: ModelServerConfig) -> None:
    manager = ModelManager(config.model_repository, config.device, config.threads)
    await asyncio.get_running_loop().run_in_executor(None, manager.load_all)
    metrics_port = start_metrics_server(config.host, config.metrics_port)
    server, port, health = await build_server(config, manager)
    serving.announce("model_server", grpc=f"{config.host}:{port}", metrics=f"{config.host}:{metrics_port}",
                     providers=manager.providers)
    await serving.run_until_signal(server, health, config.drain_grace_s, manager.close)


if __name__ == "__main__":
    sys.exit(serving.main(ModelServerConfig, "INFERMESH_MODEL_SERVER_", serve, __doc__))
