"""The cache trusts no caller's generation and no stored one: a Store under
any generation but the current one is refused (a poisoned entry cannot wait
for the purge meant to remove it); damaged generation records, in L2 or in
Redis, never stop start-up and move the model to a fresh generation; and the
models a replica remembers for callers stay bounded."""

import logging

import lmdb
import numpy as np
import pytest
import redis

from services.cache import generations
from services.common import errors
from services.common.tensors import from_numpy
from tests.test_cache_core import EMBEDDING, NAMESPACE, redis_server, replica  # noqa: F401 - the fixture

pytestmark = pytest.mark.service

POISON = [from_numpy("EMBEDDING", np.full((1, 384), 6.66, dtype=np.float32))]
DIGEST = b"\x5a" * 16


async def test_a_store_under_the_next_generation_is_refused_and_no_purge_brings_it_back(redis_server, tmp_path):
    """The issue's attack: a direct caller stores under current + 1; the purge
    that should remove the cache's answers would then make it the answer."""
    cache = replica(redis_server, tmp_path / "l2")
    _, generation = await cache.lookup("minilm", DIGEST)
    with pytest.raises(
        errors.InvalidArgument,
        match=r"field 'generation' is 1 for model 'minilm', but its "
        r"current generation is 0",
    ):
        await cache.put("minilm", DIGEST, POISON, generation + 1)
    with pytest.raises(errors.InvalidArgument, match="field 'generation' is 18446744073709551615"):
        await cache.put("minilm", DIGEST, POISON, 2**64 - 1)
    assert await cache.get("minilm", DIGEST) is None
    assert (await cache.purge("minilm"))[0] == 1
    assert await cache.get("minilm", DIGEST) is None, "the entry stored ahead of the purge answered after it"
    assert await cache.put("minilm", DIGEST, EMBEDDING, 1) is None  # under the current one: kept
    assert await cache.get("minilm", DIGEST) == EMBEDDING
    await cache.close()


async def test_a_store_under_a_generation_another_replica_purged_to_is_kept(redis_server, tmp_path):
    """Ahead of this replica is not ahead of Redis: it reads Redis again first."""
    a, b = replica(redis_server, tmp_path / "a"), replica(redis_server, tmp_path / "b")
    assert (await a.lookup("minilm", DIGEST))[1] == 0
    assert (await b.purge("minilm"))[0] == 1  # a has not followed yet
    assert await a.put("minilm", DIGEST, EMBEDDING, 1) is None
    assert await a.get("minilm", DIGEST) == EMBEDDING
    await a.close()
    await b.close()


def _damage_generation_record(path, model: str, value: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=3, map_size=64 << 20)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"generation\x00" + model.encode(), value)
    env.close()


@pytest.mark.parametrize("damage", [b"garbage", b"-3", b"9" * 40, b""])
async def test_a_damaged_generation_record_in_l2_starts_a_fresh_generation(redis_server, tmp_path, caplog, damage):
    path = tmp_path / "l2"
    cache = replica(redis_server, path)
    await cache.put("minilm", DIGEST, EMBEDDING)  # generation 0, in L2
    await cache.close()
    _damage_generation_record(path, "minilm", damage)
    redis.Redis.from_url(redis_server.redis_url).flushall()  # Redis restarted empty: L2 alone remembers
    with caplog.at_level(logging.ERROR, logger="services.cache.disk"):
        cache = replica(redis_server, path)  # starts
    assert "generation records damaged" in caplog.text and "fresh generation" in caplog.text
    assert await cache.get("minilm", DIGEST) is None, "an entry older than the lost record answered"
    generation = (await cache.lookup("minilm", DIGEST))[1]
    assert generation > 1 << 40
    assert await cache.put("minilm", DIGEST, EMBEDDING, generation) is None
    assert await cache.get("minilm", DIGEST) == EMBEDDING
    await cache.close()
    cache = replica(redis_server, path)  # the floor was recorded: the next start keeps it, quietly
    assert (await cache.lookup("minilm", DIGEST))[1] == generation
    assert await cache.get("minilm", DIGEST) == EMBEDDING
    await cache.close()


@pytest.mark.parametrize("damage", [b"garbage", b"-3", b"9" * 40])
async def test_a_damaged_generation_in_redis_starts_a_fresh_generation(redis_server, tmp_path, caplog, damage):
    client = redis.Redis.from_url(redis_server.redis_url)
    cache = replica(redis_server, None)
    await cache.put("minilm", DIGEST, EMBEDDING)
    client.set(f"{NAMESPACE}:v1:generation:minilm", damage)
    with caplog.at_level(logging.ERROR, logger="services.cache.core"):
        await cache.refresh_generations(["minilm"])
    assert "damaged generation" in caplog.text
    generation = cache.current_generation("minilm")
    assert generation > 1 << 40 and int(client.get(f"{NAMESPACE}:v1:generation:minilm")) == generation
    assert await cache.get("minilm", DIGEST) is None
    assert (await cache.purge("minilm"))[0] == generation + 1
    await cache.close()


async def test_the_models_a_replica_remembers_for_callers_are_bounded(redis_server, tmp_path, monkeypatch):
    monkeypatch.setattr(generations, "MAX_CONFIRMED_MODELS", 50)
    a, b = replica(redis_server, tmp_path / "a"), replica(redis_server, tmp_path / "b")
    await a.put("minilm", DIGEST, EMBEDDING)
    for i in range(400):
        await a.lookup(f"model-{i}", DIGEST)
    assert len(a.generations._confirmed) <= 50 and a.generations._generations == {}  # the state under test
    assert "minilm" not in a.generations._confirmed
    await b.purge("minilm")  # while a had forgotten it: a reads it again, never serves the purged entry
    assert await a.get("minilm", DIGEST) is None and a.current_generation("minilm") == 1
    await a.close()
    await b.close()
