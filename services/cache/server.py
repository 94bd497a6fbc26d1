"""The cache service's gRPC face: streamed lookups, streamed stores."""

import asyncio
import logging

from google.protobuf.message import DecodeError
from infermesh.cache.v1 import cache_pb2, cache_pb2_grpc

from services.cache import metrics
from services.cache.config import CacheConfig
from services.cache.core import ResultCache
from services.common import serving

log = logging.getLogger(__name__)
SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name


class CacheServicer(cache_pb2_grpc.CacheServicer):
    def __init__(self, cache: ResultCache):
        self._cache = cache

    async def Lookup(self, request_iterator, context):
        """One answer per lookup, in completion order; a bad or foreign value is a miss."""
        outbox: asyncio.Queue = asyncio.Queue()
        pending: set[asyncio.Task] = set()

        async def answer(request) -> None:
            value = await self._cache.get(request.model, request.digest)
            response = cache_pb2.LookupResponse(id=request.id, hit=False)
            if value is not None:
                try:
                    cached = cache_pb2.CachedResult.FromString(value)
                    response = cache_pb2.LookupResponse(id=request.id, hit=bool(cached.outputs), outputs=cached.outputs)
                except DecodeError:
                    metrics.LOOKUPS.labels("l1", "invalid").inc()
            outbox.put_nowait(response)

        async def read() -> None:
            async for request in request_iterator:
                task = asyncio.create_task(answer(request))
                pending.add(task)
                task.add_done_callback(pending.discard)
            if pending:
                await asyncio.gather(*list(pending), return_exceptions=True)
            outbox.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (response := await outbox.get()) is not None:
                yield response
        finally:
            reader.cancel()
            for task in list(pending):
                task.cancel()

    async def Store(self, request_iterator, context):
        stored = failed = 0
        async for request in request_iterator:
            value = cache_pb2.CachedResult(outputs=request.outputs).SerializeToString()
            if await self._cache.put(request.model, request.digest, value):
                stored += 1
            else:
                failed += 1
        return cache_pb2.StoreSummary(stored=stored, failed=failed)


async def build_server(config: CacheConfig, cache: ResultCache, port: int | None = None):
    """Returns (server, bound_port, health servicer); the server is started."""
    server = serving.new_server("cache", config.max_message_bytes)
    cache_pb2_grpc.add_CacheServicer_to_server(CacheServicer(cache), server)
    health = serving.add_health_and_reflection(server, [SERVICE_NAME])
    bound = server.add_insecure_port(f"{config.host}:{config.port if port is None else port}")
    await server.start()
    await serving.set_serving(health, [SERVICE_NAME], True)
    return server, bound, health
