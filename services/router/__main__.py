"""Runs the router: infermesh-router (or python -m services.router) --batcher 127.0.0.1:8021 --cache 127.0.0.1:8031."""

import asyncio
import logging
import sys

from grpc_health.v1 import health_pb2

from services.common import serving, tls
from services.common.identity import RegistryError
from services.common.metrics import start_metrics_server
from services.router.bypass import AdaptiveBypass
from services.router.clients import BatcherClient, CacheClient
from services.router.config import RouterConfig
from services.router.core import Catalog, Router
from services.router.nearcache import NearCache
from services.router.server import SERVICE_NAME, build_server
from services.router.tenants import Authenticator, RateLimiter, follow_registry, settings_from

log = logging.getLogger("services.router")


async def serve(config: RouterConfig) -> None:
    catalog = Catalog()
    upstream = tls.upstream_credentials(config)
    batcher = BatcherClient(
        config.batcher,
        config.batcher_streams,
        catalog,
        config.catalog_poll_s,
        config.stream_max_age_s,
        config.batcher_linger_ms / 1000,
        upstream,
    )
    cache = (
        CacheClient(
            config.cache,
            config.cache_lookup_timeout_ms / 1000,
            stream_max_age_s=config.stream_max_age_s,
            credentials=upstream,
        )
        if config.cache
        else None
    )
    bypass = AdaptiveBypass(config.cache_bypass_window, config.cache_min_hit_rate, config.cache_bypass_memory)
    near = NearCache(config.near_cache_ttl_s, config.near_cache_max_bytes)
    try:
        authenticator = Authenticator(settings_from(config))
    except RegistryError as exc:  # before anything listens: a registry that cannot be used stops the start
        sys.exit(f"router: {exc}")
    router = Router(
        catalog,
        batcher,
        cache,
        config.settings(),
        bypass=bypass,
        near=near,
        failure_samples=config.failure_samples(),
        limiter=RateLimiter(),
        tenant_label=authenticator.label,
    )
    await batcher.start()
    metrics_port = start_metrics_server(config.host, config.metrics_port)
    draining = asyncio.Event()
    server, port, health = await build_server(config, router, draining=draining, authenticator=authenticator)

    # Liveness asks the service's own name: SERVING while the process runs, so that a
    # router waiting for the models to load (or come back) is not restarted for it.
    # Readiness ("", which grpc_health starts SERVING) is NOT_SERVING until the catalog has a ready model.
    await serving.set_serving(health, [], False)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

    async def follow_readiness() -> None:
        announced = False
        while True:
            await catalog.updated.wait()
            catalog.updated.clear()
            await serving.set_serving(health, [], catalog.is_ready())  # readiness: "" follows the models
            if catalog.is_ready() and not announced:
                announced = True
                serving.announce(
                    "router",
                    grpc=f"{config.host}:{port}",
                    metrics=f"{config.host}:{metrics_port}",
                    models=catalog.names(),
                )

    follower = asyncio.create_task(follow_readiness())
    registry_follower = (
        asyncio.create_task(follow_registry(config.tenants_file, authenticator)) if config.tenants_file else None
    )

    async def close() -> None:
        follower.cancel()
        if registry_follower is not None:
            registry_follower.cancel()
        await batcher.close()
        if cache is not None:
            await cache.close()

    await serving.run_until_signal(server, health, config.drain_grace_s, close, draining)


def main() -> int:
    return serving.main(RouterConfig, "INFERMESH_ROUTER_", serve, __doc__)


if __name__ == "__main__":
    sys.exit(main())
