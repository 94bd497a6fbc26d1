"""The result cache's core in this process, against a real redis-server and a
real LMDB store: generations across Redis restarts, batches with a bad item,
damaged L2 files."""

import asyncio
import threading

import numpy as np
import pytest
import redis
from prometheus_client import REGISTRY

from services.cache import codec
from services.cache.config import CacheSettings
from services.cache.core import ResultCache
from services.cache.disk import DiskStore
from services.common import errors
from services.common.tensors import TensorData, from_numpy
from services.launcher.mesh import Mesh, MeshConfig

pytestmark = pytest.mark.service

EMBEDDING = [from_numpy("EMBEDDING", np.linspace(-1, 1, 384, dtype=np.float32).reshape(1, 384))]
NAMESPACE = "core-test"


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server of our own (no persistence, as `make run` starts it), restartable."""
    mesh = Mesh(MeshConfig(log_dir=tmp_path / "logs"))
    mesh.start_redis()
    yield mesh
    mesh.stop()


def replica(redis_server, path, **kwargs) -> ResultCache:
    disk = DiskStore(path, 64 << 20) if path is not None else None
    return ResultCache(CacheSettings(redis_server.redis_url, NAMESPACE, 300, 50, 0.0, **kwargs), disk=disk)


def restart_redis(redis_server) -> redis.Redis:
    redis_server.stop_redis()
    redis_server.start_redis()
    return redis.Redis.from_url(redis_server.redis_url)


async def refresh_until_redis_holds(cache: ResultCache, client: redis.Redis, model: str) -> int:
    """Refreshes as a replica's follower does; the first call after a restart
    may fail on a connection the restart cut (the breaker is set to 0 s)."""
    key = f"{NAMESPACE}:v1:generation:{model}"
    for _ in range(10):
        await cache.refresh_generations()
        if client.get(key) is not None:
            return int(client.get(key))
    raise AssertionError(f"no replica wrote {key} back to Redis")


async def test_a_purged_result_stays_purged_when_redis_restarts_empty(redis_server, tmp_path):
    a, b = replica(redis_server, tmp_path / "a"), replica(redis_server, tmp_path / "b")
    digest = b"\x42" * 16
    await b.put("minilm", digest, EMBEDDING)
    generation, _ = await a.purge("minilm")
    await b.refresh_generations()
    assert generation == 1 and await b.get("minilm", digest) is None
    client = restart_redis(redis_server)
    assert await refresh_until_redis_holds(b, client, "minilm") == 1
    assert await b.get("minilm", digest) is None, "the purged result answered again"
    await a.close()
    await b.close()


async def test_generations_survive_a_replica_restart_and_purges_keep_counting_up(redis_server, tmp_path):
    digest = b"\x43" * 16
    a = replica(redis_server, tmp_path / "a")
    await a.put("minilm", digest, EMBEDDING)
    assert await a.purge("minilm") == (1, 1)
    await a.put("minilm", digest, EMBEDDING)  # the new generation's result
    await a.close()
    client = restart_redis(redis_server)
    a = replica(redis_server, tmp_path / "a")  # restarted too: only its L2 remembers generation 1
    assert (await a.get("minilm", digest)) == EMBEDDING
    assert int(client.get(f"{NAMESPACE}:v1:generation:minilm")) == 1
    assert (await a.purge("minilm"))[0] == 2, "a purge after the restart reused a generation"
    assert await a.get("minilm", digest) is None
    await a.close()


@pytest.mark.parametrize(
    "digest, outputs, fp16",
    [
        (b"\x01" * 16, EMBEDDING * 256, False),  # more tensors than the format holds
        (b"\x01" * 600, EMBEDDING, False),  # longer than an LMDB key
        (b"\x01" * 16, [TensorData("EMBEDDING", "FP32", (1, 2), b"\0" * 6)], True),  # bytes contradict the shape
        (b"\x01" * 16, [], False),  # nothing to keep
    ],
    ids=["256-tensors", "600-byte-digest", "short-fp32", "no-outputs"],
)
async def test_a_result_that_cannot_be_stored_fails_alone_not_its_batch(redis_server, tmp_path, digest, outputs, fp16):
    cache = replica(redis_server, tmp_path / "l2", l2_fp16=fp16)
    good = [bytes([0x10 + i]) * 16 for i in range(5)]
    futures = [cache.put("minilm", d, EMBEDDING) for d in good] + [cache.put("minilm", digest, outputs)]
    results = await asyncio.gather(*futures, return_exceptions=True)
    assert results[:5] == [None] * 5
    assert isinstance(results[5], errors.InvalidArgument) and "cannot be cached" in results[5].message
    for d in good:
        assert await cache.get("minilm", d) is not None
    await cache.close()


def damage_page_holding(path, value: bytes) -> None:
    """Overwrites the header of the LMDB page that holds `value`, as a torn write might."""
    data = path / "data.mdb"
    raw = bytearray(data.read_bytes())
    page = raw.index(value) // 4096
    assert page >= 2, "the value sits on a meta page"
    raw[page * 4096 : page * 4096 + 16] = b"\xff" * 16
    data.write_bytes(bytes(raw))


async def test_a_damaged_l2_page_is_a_counted_miss_and_costs_no_other_hit(redis_server, tmp_path):
    def outputs(i):
        return [from_numpy("OUT", np.full((1, 16), i, np.float32))]

    digests = [i.to_bytes(2, "big") * 8 for i in range(400)]
    cache = replica(redis_server, tmp_path / "l2")
    await asyncio.gather(*(cache.put("m", d, outputs(i)) for i, d in enumerate(digests)))
    await cache.close()
    damage_page_holding(tmp_path / "l2", codec.encode(outputs(7), compress=True))
    redis.Redis.from_url(redis_server.redis_url).flushall()  # L2 alone holds them now
    cache = replica(redis_server, tmp_path / "l2")
    l1_only = [bytes([0xA0 + i]) * 16 for i in range(5)]
    await asyncio.gather(*(cache.put("m", d, EMBEDDING) for d in l1_only))
    errors_before = REGISTRY.get_sample_value("infermesh_cache_errors_total", {"operation": "l2_get"}) or 0
    found = await asyncio.gather(*(cache.get("m", d) for d in [*l1_only, digests[7], digests[300]]))
    assert found[:5] == [EMBEDDING] * 5, "L1 hits were lost with the L2 read beside them"
    assert found[5] is None and found[6] == outputs(300)
    assert REGISTRY.get_sample_value("infermesh_cache_errors_total", {"operation": "l2_get"}) > errors_before
    await cache.close()


async def test_l2_lookups_do_not_wait_for_an_l2_write(redis_server, tmp_path):
    cache = replica(redis_server, tmp_path / "l2")
    await cache.put("m", b"\x50" * 16, EMBEDDING)
    redis.Redis.from_url(redis_server.redis_url).flushall()  # so the lookup needs L2
    gate = threading.Event()  # the L2 writer busy, as with a long eviction
    busy = asyncio.get_running_loop().run_in_executor(cache._disk_thread, gate.wait, 30)
    try:
        found = await asyncio.wait_for(cache.get("m", b"\x50" * 16), 10)
    finally:
        gate.set()
    assert found == EMBEDDING and await busy
    await cache.close()


async def test_a_store_counts_as_stored_only_where_some_level_kept_it(redis_server, tmp_path):
    """With Redis gone a result is kept by L2 alone; with no L2 either, by
    nothing, and the store says so instead of reporting success."""
    with_l2, without = replica(redis_server, tmp_path / "l2"), replica(redis_server, None)
    redis_server.stop_redis()
    await with_l2.put("minilm", b"\x44" * 16, EMBEDDING)
    assert await with_l2.get("minilm", b"\x44" * 16) == EMBEDDING  # from L2
    with pytest.raises(errors.Unavailable, match="kept by no level: Redis is unreachable and there is no L2"):
        await without.put("minilm", b"\x45" * 16, EMBEDDING)
    await with_l2.close()
    await without.close()


async def test_a_result_computed_before_a_purge_is_not_kept_after_it(redis_server, tmp_path):
    """The router stores a miss's result with the generation its lookup read:
    a purge in between (here, or seen on another replica) leaves it out."""
    a, b = replica(redis_server, tmp_path / "a"), replica(redis_server, tmp_path / "b")
    digest = b"\x46" * 16
    missed, generation = await a.lookup("minilm", digest)
    assert missed is None and generation == 0
    await b.purge("minilm")  # while the model computes
    await a.refresh_generations()
    assert await a.put("minilm", digest, EMBEDDING, generation) == "stale"
    assert await a.get("minilm", digest) is None
    assert await a.put("minilm", digest, EMBEDDING, 1) is None  # computed after the purge: kept
    assert await a.get("minilm", digest) == EMBEDDING
    await a.close()
    await b.close()
