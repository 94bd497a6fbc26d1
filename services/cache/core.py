"""The result cache: Redis as L1 with a TTL, LMDB on disk as L2, behind a breaker.

Lookups and stores that arrive in the same event-loop iteration go to Redis
as one MGET and one pipeline, and to disk as one transaction. A request never
fails because of the cache: any Redis error or timeout is a miss (or a
dropped write), counted, and opens the breaker so that the next calls skip
Redis until it has had time to come back; L2 keeps answering meanwhile.

Keys carry the model's generation: Purge bumps it, so every older entry
becomes unreachable at once, on every replica, without scanning Redis.
A generation never goes back: each replica keeps the highest it has seen
(in L2 too, across restarts) and writes it back when Redis, restarted
empty, reads lower, so an older L2 entry cannot answer again.
"""

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar, cast

import redis.asyncio as redis
from redis.exceptions import RedisError

from services.cache import codec, metrics
from services.cache.config import CacheSettings
from services.cache.disk import DiskStore
from services.cache.generations import Generations
from services.common import errors
from services.common.tensors import TensorData
from services.common.tier import Tier

log = logging.getLogger(__name__)
MAX_QUEUED_STORES = 10_000
STALE = "stale"  # a store's result when a purge came between its lookup and it

Item = TypeVar("Item")
Result = TypeVar("Result")
# A lookup: (model, digest, tier); its result: (the outputs or None, the generation read).
Lookup = tuple[str, bytes, Tier]
Found = tuple[list[TensorData] | None, int]
# A store: (where: "both" or "l1", model, generation or None for the current one,
# digest, outputs); its result: None (kept) or STALE.
Store = tuple[str, str, int | None, bytes, list[TensorData]]


class Breaker:
    """Open for `open_s` after a failure; then the next call probes Redis again."""

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


class Coalescer(Generic[Item, Result]):
    """Gathers the calls made during one event-loop iteration and hands them to
    `run_batch` together; each caller gets its own result back (an exception
    in a result's place is raised to that caller alone)."""

    def __init__(self, run_batch: Callable[[list[Item]], Awaitable[Sequence[Result | Exception]]]) -> None:
        self._run_batch = run_batch
        self._pending: list[tuple[Item, asyncio.Future[Result]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, item: Item) -> asyncio.Future[Result]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((item, future))
        return future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        try:
            results = await self._run_batch([item for item, _ in batch])
        except Exception as exc:  # noqa: BLE001 - every caller hears about it
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if future.done():
                continue
            if isinstance(result, Exception):  # this item's own failure
                future.set_exception(result)
            else:
                future.set_result(result)

    async def drain(self) -> None:
        while self._tasks or self._pending:
            if self._pending:
                self._flush()
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


class ResultCache:
    """get / put / purge of results by (model, digest), L1 then L2."""

    def __init__(self, config: CacheSettings, disk: DiskStore | None = None):
        timeout = config.redis_timeout_ms / 1000
        self._redis = redis.Redis.from_url(
            config.redis_url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self._namespace = config.namespace
        self._ttl_s = config.ttl_s
        self._model_ttl_s = dict(config.model_ttl_s or {})
        self._breaker = Breaker(config.breaker_open_s)
        self._disk = disk
        self._l2_fp16 = config.l2_fp16
        # One writer thread (LMDB allows one writer) and one reader: LMDB's readers never wait
        # for its writer, so a write that evicts does not hold up lookups.
        self._disk_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cache-l2")
        self._disk_reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cache-l2-read")
        self.generations = Generations(
            self._redis, config.namespace, self._breaker, disk, self._disk_thread, self._failed
        )
        if disk is not None:
            metrics.L2_BYTES.set(disk.stored_bytes)  # what a restart found, before any write
        self._lookups: Coalescer[Lookup, Found] = Coalescer(self._lookup_batch)
        self._stores: Coalescer[Store, str | None] = Coalescer(self._store_batch)
        self._queued_stores = 0

    # -- generations (generations.py) ------------------------------------------------
    def current_generation(self, model: str) -> int:
        """The model's generation as this replica knows it now."""
        return self.generations.current(model)

    async def refresh_generations(self, models: list[str] | None = None) -> None:
        await self.generations.refresh(models)

    async def follow_generations(self, every_s: float) -> None:
        await self.generations.follow(every_s)

    def _l1_key(self, model: str, generation: int, digest: bytes) -> str:
        return f"{self._namespace}:v1:{model}:g{generation}:{digest.hex()}"

    def _l2_key(self, model: str, generation: int, digest: bytes) -> bytes:
        return _l2_prefix(model) + generation.to_bytes(8, "big") + digest

    # -- lookups ----------------------------------------------------------------------
    async def get(self, model: str, digest: bytes, tier: Tier = Tier.STANDARD) -> list[TensorData] | None:
        return (await self.lookup(model, digest, tier))[0]

    async def lookup(self, model: str, digest: bytes, tier: Tier = Tier.STANDARD) -> Found:
        """The cached result, or None; and the model's generation the lookup
        read, to store the result of a miss with (put)."""
        return await self._lookups.submit((model, digest, tier))

    async def _lookup_batch(self, items: list[Lookup]) -> list[Found]:
        for model in {m for m, _, _ in items}:
            await self.generations.of(model)
        keyed = [(model, self.current_generation(model), digest, tier) for model, digest, tier in items]
        results: list[list[TensorData] | None] = [None] * len(items)
        levels = ["all"] * len(items)
        raw = await self._l1_get([self._l1_key(m, g, d) for m, g, d, _ in keyed])
        for i, value in enumerate(raw):
            results[i] = self._decode(value, "l1")
            if results[i] is not None:
                levels[i] = "l1"
        missing = [i for i, r in enumerate(results) if r is None]
        if self._disk is not None and missing:
            loop = asyncio.get_running_loop()
            l2_keys = [self._l2_key(keyed[i][0], keyed[i][1], keyed[i][2]) for i in missing]
            try:
                values = await loop.run_in_executor(self._disk_reader, self._disk.get_many, l2_keys)
            except Exception:  # L2 failing is a miss, and never costs the L1 hits beside it
                metrics.ERRORS.labels("l2_get").inc()
                log.exception("L2 read of %d keys failed", len(l2_keys))
                values = [None] * len(l2_keys)
            for i, value in zip(missing, values, strict=True):
                found = self._decode(value, "l2")
                if found is not None:
                    results[i], levels[i] = found, "l2"
                    model, generation, digest, _ = keyed[i]
                    self._stores.submit(("l1", model, generation, digest, found))  # promote
        for (_, _, _, tier), result, level in zip(keyed, results, levels, strict=True):
            metrics.LOOKUPS.labels(level, tier.label, "hit" if result is not None else "miss").inc()
        return [(result, generation) for result, (_, generation, _, _) in zip(results, keyed, strict=True)]

    async def _l1_get(self, keys: list[str]) -> list[bytes | None]:
        if not self._breaker.allows():
            metrics.SKIPPED.inc(len(keys))
            return [None] * len(keys)
        try:
            values = await self._redis.mget(keys)
        except (RedisError, OSError) as exc:
            self._failed("get", exc)
            return [None] * len(keys)
        self._breaker.succeeded()
        return cast(list[bytes | None], values)  # bytes, not str: the client does not decode responses

    @staticmethod
    def _decode(value: bytes | None, level: str) -> list[TensorData] | None:
        if value is None:
            return None
        try:
            return codec.decode(value)
        except codec.CorruptValue as exc:
            metrics.INVALID.labels(level).inc()
            log.debug("ignoring an invalid %s value: %s", level, exc)
            return None

    # -- stores -----------------------------------------------------------------------
    def put(
        self, model: str, digest: bytes, outputs: list[TensorData], generation: int | None = None
    ) -> asyncio.Future[str | None] | None:
        """Queues a result for the next write batch without waiting for it;
        returns None (a dropped write, counted) when too many are queued. With
        the `generation` its lookup read (else the current one): not written
        at all (the future's result is STALE) when this replica already knows
        of a purge since, and refused (InvalidArgument) when it names a
        generation newer than the current one, as Redis says: kept under it,
        it would answer again after the purge meant to remove it."""
        if self._queued_stores >= MAX_QUEUED_STORES:
            metrics.DROPPED_STORES.inc()
            return None
        self._queued_stores += 1
        future = self._stores.submit(("both", model, generation, digest, outputs))
        future.add_done_callback(self._stored)
        return future

    def _stored(self, _future: object) -> None:
        self._queued_stores -= 1

    async def _store_batch(self, items: list[Store]) -> list[Exception | str | None]:
        """Encodes each item alone: one that cannot be stored fails by itself
        (InvalidArgument), never the batch it came with. A result that neither
        level kept (Redis unreachable, and no L2 or its write failed) fails
        too, so that Store's summary counts only what was kept. A promotion to
        L1 never fails: nobody waits for it, and L2 still holds the value."""
        for model in {item[1] for item in items if item[2] is None}:
            await self.generations.of(model)
        ahead = {m for _, m, g, _, _ in items if g is not None and g > self.current_generation(m)}
        if ahead:  # perhaps a purge through another replica that this one has not read yet
            await self.generations.refresh(sorted(ahead))
        results: list[Exception | str | None] = [None] * len(items)  # None: kept; STALE; or why not
        l1, l2, raw = [], [], 0
        on_disk: set[int] = set()
        for i, (where, model, generation, digest, outputs) in enumerate(items):
            current = self.current_generation(model)
            if where == "both" and generation is not None and generation < current:
                metrics.STALE_STORES.inc()
                results[i] = STALE  # computed before a purge: no longer this model's answer
                continue
            if where == "both" and generation is not None and generation > current:
                metrics.ERRORS.labels("generation_ahead").inc()
                results[i] = errors.InvalidArgument(
                    f"field 'generation' is {generation} for model {errors.shown(model)}, but its current generation "
                    f"is {current}: store a result under the generation its lookup read"
                )
                continue
            generation = current if generation is None else generation
            disk = self._disk if where == "both" else None  # L2 too, where there is one (a promotion is L1's only)
            try:
                l1_value = codec.encode(outputs)
                l2_key = self._l2_key(model, generation, digest)
                if disk is not None and len(l2_key) > disk.max_key_bytes:
                    raise codec.UnstorableValue(f"a digest of {len(digest)} bytes makes too long an L2 key")
                l2_value = codec.encode(outputs, compress=True, fp16=self._l2_fp16) if disk is not None else b""
            except codec.UnstorableValue as exc:
                metrics.ERRORS.labels("encode").inc()
                results[i] = errors.InvalidArgument(f"result of model '{model}' cannot be cached: {exc}")
                continue
            l1.append((self._l1_key(model, generation, digest), l1_value, self._model_ttl_s.get(model, self._ttl_s)))
            if disk is not None:
                l2.append((l2_key, l2_value))
                on_disk.add(i)
                raw += sum(len(t.data) for t in outputs)
        kept_l1 = await self._l1_set(l1)
        kept_l2 = True
        if l2 and self._disk is not None:  # only items with a disk are in l2
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._disk_thread, self._disk.put_many, l2)
            except Exception:  # the results it held may still be in L1
                metrics.ERRORS.labels("l2_put").inc()
                log.exception("L2 write of %d values failed", len(l2))
                kept_l2 = False
            else:
                metrics.STORED_BYTES.labels("l2").inc(sum(len(v) for _, v in l2))
                metrics.L2_BYTES.set(self._disk.stored_bytes)
                metrics.L2_RATIO.set(sum(len(v) for _, v in l2) / max(raw, 1))
        for i, (where, model, *_) in enumerate(items):
            if where == "both" and results[i] is None and not kept_l1 and not (kept_l2 and i in on_disk):
                results[i] = errors.Unavailable(
                    f"result of model '{model}' was kept by no level: Redis is "
                    f"unreachable and {'L2 failed' if i in on_disk else 'there is no L2'}"
                )
        return results

    async def _l1_set(self, items: list[tuple[str, bytes, int]]) -> bool:
        """Whether Redis took `items` (none to write counts as taken)."""
        if not items:
            return True
        if not self._breaker.allows():
            return False
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for key, value, ttl in items:
                    pipe.set(key, value, ex=ttl)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed("set", exc)
            return False
        self._breaker.succeeded()
        metrics.STORED_BYTES.labels("l1").inc(sum(len(v) for _, v, _ in items))
        return True

    # -- purge ------------------------------------------------------------------------
    async def purge(self, model: str) -> tuple[int, int]:
        """Bumps the model's generation in Redis and drops its L2 entries here.
        Raises RedisError when Redis is unreachable: a purge must not half-happen silently."""
        generation = await self.generations.bump(model)
        deleted = 0
        if self._disk is not None:
            loop = asyncio.get_running_loop()
            deleted = await loop.run_in_executor(self._disk_thread, self._disk.delete_prefix, _l2_prefix(model))
            metrics.L2_BYTES.set(self._disk.stored_bytes)
        log.info("purged model %s: generation %d, %d L2 entries dropped", model, generation, deleted)
        return generation, deleted

    def _failed(self, operation: str, exc: Exception) -> None:
        metrics.ERRORS.labels(operation).inc()
        if self._breaker.allows():
            log.warning("redis %s failed (%s: %s); serving uncached for a while", operation, type(exc).__name__, exc)
        self._breaker.failed()

    async def close(self) -> None:
        await self._stores.drain()
        await self._redis.aclose()
        self._disk_thread.shutdown(wait=True)
        self._disk_reader.shutdown(wait=True)
        if self._disk is not None:
            self._disk.close()


def _l2_prefix(model: str) -> bytes:
    return model.encode() + b"\x00"
