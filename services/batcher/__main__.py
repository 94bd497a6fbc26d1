"""Runs the batcher: infermesh-batcher (or python -m services.batcher) --model-servers 127.0.0.1:8011."""

import asyncio
import logging
import pathlib
import sys

from services.batcher.config import BatcherConfig
from services.batcher.core import Batcher
from services.batcher.replicas import ReplicaSet
from services.batcher.server import build_server
from services.common import serving, tls, traffic
from services.common.metrics import start_metrics_server


async def serve(config: BatcherConfig) -> None:
    policy = None
    if config.traffic_policy_files:
        try:
            policy = traffic.PolicyFiles(
                [pathlib.Path(p) for p in config.traffic_policy_files],
                config.traffic_host,
                logging.getLogger("services.batcher.traffic"),
            )
        except traffic.PolicyError as exc:
            raise SystemExit(f"batcher: --traffic-policy: {exc}") from None
    replicas = ReplicaSet(config.replicas(), policy, credentials=tls.upstream_credentials(config))
    await replicas.start()
    batcher = Batcher(replicas, config.batching())
    metrics_port = start_metrics_server(config.host, config.metrics_port)
    draining = asyncio.Event()
    server, port, health = await build_server(config, batcher, replicas, draining)
    serving.announce("batcher", grpc=f"{config.host}:{port}", metrics=f"{config.host}:{metrics_port}")

    async def close():
        await batcher.close()
        await replicas.close()

    await serving.run_until_signal(server, health, config.drain_grace_s, close, draining)


def main() -> int:
    return serving.main(BatcherConfig, "INFERMESH_BATCHER_", serve, __doc__)


if __name__ == "__main__":
    sys.exit(main())
