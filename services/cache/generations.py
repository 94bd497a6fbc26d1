"""Each model's generation as one cache replica knows it: a counter in every
key, bumped by a purge, so that older entries become unreachable. Redis holds
the shared value, L2 records what this replica has seen (it survives a Redis
restart); a value lower than seen is raised back, never followed; a damaged
one is replaced by a fresh generation."""

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import redis.asyncio as redis
from redis.exceptions import RedisError

from services.cache import metrics
from services.cache.disk import DAMAGED, MAX_GENERATION, DiskStore, fresh_generation

if TYPE_CHECKING:  # the core imports this module
    from services.cache.core import Breaker

log = logging.getLogger(__name__)
# Models whose generation this replica has read from Redis (callers name them):
# past this, the oldest is forgotten, and read again when next used.
MAX_CONFIRMED_MODELS = 4096
# Both raise the stored generation to at least ARGV[1] (a replica's floor);
# purge then adds one. Atomic, so two replicas never hand out the same one.
_RAISE_GENERATION = """
local stored = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local floor = tonumber(ARGV[1])
if stored < floor then redis.call('SET', KEYS[1], floor); return floor end
return stored
"""
_BUMP_GENERATION = """
local stored = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local next = math.max(stored, tonumber(ARGV[1])) + 1
redis.call('SET', KEYS[1], next)
return next
"""


class Generations:
    """The generations of the models this replica has seen."""

    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        breaker: "Breaker",
        disk: DiskStore | None,
        disk_thread: concurrent.futures.ThreadPoolExecutor,
        on_failure: Callable[[str, Exception], None],
    ):
        self._redis = client
        self._namespace = namespace
        self._breaker = breaker  # the cache's: open, Redis is not asked
        self._disk = disk
        self._disk_thread = disk_thread  # L2's one writer
        self._on_failure = on_failure  # (operation, exception): counted, and opens the breaker
        self._raise_generation = client.register_script(_RAISE_GENERATION)
        self._bump_generation = client.register_script(_BUMP_GENERATION)
        # Per model: the highest generation seen (never lowered), kept only where it
        # is above the floor (every model's least: 0 unless damaged records raised
        # it), so that only purged models have an entry; the highest L2 has
        # recorded; and which ones Redis has been asked about (bounded, oldest first).
        self._generations: dict[str, int] = {}
        self._floor = 0
        if disk is not None:
            self._read_disk(disk)
        self._recorded: dict[str, int] = dict(self._generations)
        self._confirmed: dict[str, None] = {}

    def _read_disk(self, disk: DiskStore) -> None:
        """Damaged generation records never stop start-up: the store drops them
        and raises its floor; one it cannot read at all gives a fresh floor here."""
        try:
            generations, floor = disk.generations(), disk.generation_floor()
        except DAMAGED as exc:
            generations, floor = {}, None
            log.error("L2 generation records cannot be read (%s: %s)", type(exc).__name__, exc)
        if floor is None:
            floor = fresh_generation()
            log.error("starting every model at fresh generation %d: entries older than a purge stay unreachable", floor)
        self._floor = floor
        self._generations = {m: g for m, g in generations.items() if g > floor}

    def current(self, model: str) -> int:
        """The model's generation as this replica knows it now."""
        return self._generations.get(model, self._floor)

    def set(self, model: str, generation: int) -> None:
        if generation > self._floor:
            self._generations[model] = generation

    def confirm(self, models: Iterable[str]) -> None:
        for model in models:
            self._confirmed.pop(model, None)
            self._confirmed[model] = None
        while len(self._confirmed) > MAX_CONFIRMED_MODELS:
            del self._confirmed[next(iter(self._confirmed))]

    def key(self, model: str) -> str:
        return f"{self._namespace}:v1:generation:{model}"

    async def of(self, model: str) -> int:
        if model not in self._confirmed:
            await self.refresh([model])
        return self.current(model)

    async def refresh(self, models: list[str] | None = None) -> None:
        """Re-reads the generations of `models` (default: every model seen);
        one Redis reads lower than seen here is raised back, never followed,
        and a damaged one is replaced by a fresh generation."""
        models = list({**self._confirmed, **dict.fromkeys(self._generations)}) if models is None else models
        if not models or not self._breaker.allows():
            return
        try:
            values = await self._redis.mget([self.key(m) for m in models])
            for model, value in zip(models, values, strict=True):
                known = self.current(model)
                stored = int(value) if value is not None and value.isdigit() and len(value) <= 19 else None
                if value is None:
                    stored = 0
                elif stored is None or stored >= MAX_GENERATION:
                    fresh = max(fresh_generation(), known)
                    log.error(
                        "redis holds a damaged generation %r of model %s; starting it at fresh generation %d",
                        value[:40],
                        model,
                        fresh,
                    )
                    await self._redis.set(self.key(model), fresh)
                    stored = fresh
                if stored < known:
                    log.warning(
                        "redis holds generation %d of model %s, older than %d seen before (did Redis restart?); "
                        "writing %d back",
                        stored,
                        model,
                        known,
                        known,
                    )
                    stored = int(await self._raise_generation([self.key(model)], [known]))
                self.set(model, max(stored, known))
        except (RedisError, OSError) as exc:
            self._on_failure("generation", exc)
            return
        self.confirm(models)
        await self.record()

    async def record(self) -> None:
        """Keeps in L2 every generation higher than it has recorded."""
        newer = {m: g for m, g in self._generations.items() if g > self._recorded.get(m, 0)}
        if self._disk is None or not newer:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._disk_thread, self._disk.record_generations, newer)
        except Exception:  # memory still holds them; the next refresh tries again
            metrics.ERRORS.labels("l2_generation").inc()
            log.exception("recording generations %s in L2 failed", newer)
            return
        self._recorded.update(newer)

    async def follow(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            await self.refresh()

    async def bump(self, model: str) -> int:
        """A purge: the model's next generation, in Redis (atomically), here and in L2.
        Raises RedisError when Redis is unreachable."""
        generation = int(await self._bump_generation([self.key(model)], [self.current(model)]))
        self.set(model, generation)
        self.confirm([model])
        await self.record()
        return generation
