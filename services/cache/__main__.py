"""Runs the cache service: infermesh-cache (or python -m services.cache) --redis-url redis://127.0.0.1:6379/0 --l2-path var/cache."""

import asyncio
import sys

from services.cache.config import CacheConfig
from services.cache.core import ResultCache
from services.cache.disk import DiskStore
from services.cache.server import build_server
from services.common import serving
from services.common.metrics import start_metrics_server


async def serve(config: CacheConfig) -> None:
    disk = DiskStore(config.l2_path, config.l2_max_bytes) if config.l2_path else None
    cache = ResultCache(config.settings(), disk)
    follower = asyncio.create_task(cache.follow_generations(config.generation_poll_s))
    metrics_port = start_metrics_server(config.host, config.metrics_port)
    draining = asyncio.Event()
    server, port, health = await build_server(config, cache, draining)
    serving.announce("cache", grpc=f"{config.host}:{port}", metrics=f"{config.host}:{metrics_port}")

    async def close() -> None:
        follower.cancel()
        await cache.close()

    await serving.run_until_signal(server, health, config.drain_grace_s, close, draining)


def main() -> int:
    return serving.main(CacheConfig, "INFERMESH_CACHE_", serve, __doc__)


if __name__ == "__main__":
    sys.exit(main())
