"""The result cache's core in this process, against a real redis-server and a
real LMDB store: generations across Redis restarts, batches with a bad item,
damaged L2 files."""

import asyncio

import numpy as np
import pytest
import redis

from services.cache.core import ResultCache
from services.cache.disk import DiskStore
from services.common import errors
from services.common.tensors import TensorData, from_numpy
from services.launcher.mesh import Mesh

EMBEDDING = [from_numpy("EMBEDDING", np.linspace(-1, 1, 384, dtype=np.float32).reshape(1, 384))]
NAMESPACE = "core-test"


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server of our own (no persistence, as `make run` starts it), restartable."""
    mesh = Mesh(log_dir=tmp_path / "logs")
    mesh.start_redis()
    yield mesh
    mesh.stop()


def replica(redis_server, path, **kwargs) -> ResultCache:
    disk = DiskStore(path, 64 << 20) if path is not None else None
    return ResultCache(redis_server.redis_url, NAMESPACE, 300, 50, 0.0, disk=disk, **kwargs)


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


@pytest.mark.parametrize("digest, outputs, fp16", [
    (b"\x01" * 16, EMBEDDING * 256, False),                                    # more tensors than the format holds
    (b"\x01" * 600, EMBEDDING, False),                                         # longer than an LMDB key
    (b"\x01" * 16, [TensorData("EMBEDDING", "FP32", (1, 2), b"\0" * 6)], True),  # bytes contradict the shape
    (b"\x01" * 16, [], False),                                                 # nothing to keep
], ids=["256-tensors", "600-byte-digest", "short-fp32", "no-outputs"])
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
