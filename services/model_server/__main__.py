"""Runs the model server: infermesh-model-server (or python -m services.model_server) --model-repository build/models."""

import asyncio
import contextlib
import sys

from services.common import serving
from services.common.metrics import start_metrics_server
from services.model_server import gpu
from services.model_server.config import ModelServerConfig
from services.model_server.core import ModelManager
from services.model_server.execution import has_nvidia_gpu
from services.model_server.server import Readiness, build_server


async def serve(config: ModelServerConfig) -> None:
    readiness = Readiness()
    manager = ModelManager(config.manager(), on_readiness=readiness)
    await manager.start()
    sampler = asyncio.create_task(gpu.sample_forever(config.gpu_sample_s)) if has_nvidia_gpu() else None
    metrics_port = start_metrics_server(config.host, config.metrics_port)
    server, port, health = await build_server(config, manager, readiness=readiness)
    serving.announce(
        "model_server",
        grpc=f"{config.host}:{port}",
        metrics=f"{config.host}:{metrics_port}",
        providers=manager.providers,
    )
    try:
        await serving.run_until_signal(server, health, config.drain_grace_s, manager.close)
    finally:
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler


def main() -> int:
    return serving.main(ModelServerConfig, "INFERMESH_MODEL_SERVER_", serve, __doc__)


if __name__ == "__main__":
    sys.exit(main())
