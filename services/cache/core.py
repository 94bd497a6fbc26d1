"""The result cache: Redis as L1 with a TTL, behind a circuit breaker.

A request never fails because of the cache: any Redis error or timeout is a
miss (or a dropped write), counted, and opens the breaker so that the next
calls skip Redis until it has had time to come back.
"""

import logging
import time
from collections.abc import Callable

import redis.asyncio as redis
from redis.exceptions import RedisError

from services.cache import metrics

log = logging.getLogger(__name__)


class Breaker:
    """Open for `open_s` after a failure; then one call probes Redis again."""

    def __init__(self, open_s: float, clock: Callable[[], float] = time.monotonic):
        self._open_s = open_s
        self._clock = clock
        self._open_until = 0.0

    def allows(self) -> bool:
        return self._clock() >= self._open_until

    def failed(self) -> None:
        self._open_until = self._clock() + self._open_s
        metrics.BREAKER_OPEN.set(1)

    def succeeded(self) -> None:
        metrics.BREAKER_OPEN.set(0)


class ResultCache:
    """Get and put encoded results by (model, digest)."""

    def __init__(self, redis_url: str, namespace: str, ttl_s: int, timeout_ms: float, breaker_open_s: float):
        timeout = timeout_ms / 1000
        self._redis = redis.Redis.from_url(
            redis_url, socket_timeout=timeout, socket_connect_timeout=timeout, retry_on_timeout=False,
            health_check_interval=0)
        self._namespace = namespace
        self._ttl_s = ttl_s
        self._breaker = Breaker(breaker_open_s)

    def key(self, model: str, digest: bytes) -> str:
        return f"{self._namespace}:v1:{model}:{digest.hex()}"

    async def get(self, model: str, digest: bytes) -> bytes | None:
        if not self._breaker.allows():
            metrics.LOOKUPS.labels("l1", "skipped").inc()
            return None
        try:
            value = await self._redis.get(self.key(model, digest))
        except (RedisError, OSError) as exc:
            self._failed("get", exc)
            return None
        self._breaker.succeeded()
        metrics.LOOKUPS.labels("l1", "hit" if value is not None else "miss").inc()
        return value

    async def put(self, model: str, digest: bytes, value: bytes) -> bool:
        if not self._breaker.allows():
            return False
        try:
            await self._redis.set(self.key(model, digest), value, ex=self._ttl_s)
        except (RedisError, OSError) as exc:
            self._failed("set", exc)
            return False
        self._breaker.succeeded()
        metrics.STORED_BYTES.inc(len(value))
        return True

    def _failed(self, operation: str, exc: Exception) -> None:
        metrics.ERRORS.labels(operation).inc()
        if self._breaker.allows():
            log.warning("redis %s failed (%s: %s); serving uncached for a while", operation, type(exc).__name__, exc)
        self._breaker.failed()

    async def close(self) -> None:
        await self._redis.aclose()
