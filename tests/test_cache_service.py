"""The cache service against a real redis-server: TTL, L2 on disk across
restarts, Redis going away and coming back, foreign values, purge."""

import time

import grpc
import numpy as np
import pytest
import redis
from infermesh.cache.v1 import cache_pb2, cache_pb2_grpc

from services.common.protoconv import tensors_to_proto
from services.common.tensors import TensorData, from_numpy
from services.launcher.mesh import Mesh, MeshConfig
from tests.conftest import metric

pytestmark = pytest.mark.service

TOKEN = "test-admin-token"


class CacheOnly:
    """redis-server and the cache service alone, restartable."""

    def __init__(self, tmp_path, ttl_s=1):
        self.mesh = Mesh(
            MeshConfig(
                log_dir=tmp_path / "logs",
                l2_path=tmp_path / "l2",
                cache_args=(
                    "--ttl-s",
                    str(ttl_s),
                    "--admin-token",
                    TOKEN,
                    "--generation-poll-s",
                    "0.2",
                    "--breaker-open-s",
                    "0.5",
                ),
            )
        )

    def start(self):
        if "redis" not in self.mesh.processes:
            self.mesh.start_redis()
        self.mesh.start_cache().wait_ready(60)
        self.channel = grpc.insecure_channel(self.mesh.address("cache"))
        self.stub = cache_pb2_grpc.CacheStub(self.channel)
        return self

    def stop_cache(self):
        self.channel.close()
        self.mesh.stop_service("cache")

    @property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.mesh.redis_url)

    def store(self, model, digest, tensors):
        summary = self.stub.Store(
            iter([cache_pb2.StoreRequest(model=model, digest=digest, outputs=tensors_to_proto(tensors))]), timeout=10
        )
        assert (summary.stored, summary.failed) == (1, 0)

    def lookup(self, model, digest):
        (response,) = list(
            self.stub.Lookup(iter([cache_pb2.LookupRequest(id=7, model=model, digest=digest)]), timeout=10)
        )
        assert response.id == 7
        return response

    def hits(self, level):
        return metric(self.mesh.metrics_url("cache"), "infermesh_cache_lookups_total", level=level, result="hit")

    def close(self):
        self.channel.close()
        self.mesh.stop()


@pytest.fixture
def cache(tmp_path):
    service = CacheOnly(tmp_path).start()
    yield service
    service.close()


def l1_key(model, digest, generation=0):
    return f"infermesh:v1:{model}:g{generation}:{digest.hex()}"


EMBEDDING = from_numpy("EMBEDDING", np.linspace(-1, 1, 384, dtype=np.float32).reshape(1, 384))


def test_entries_expire_from_redis_after_their_ttl_and_l2_still_answers(cache):
    digest = b"\x01" * 16
    cache.store("minilm", digest, [EMBEDDING])
    assert cache.lookup("minilm", digest).hit
    assert cache.redis.ttl(l1_key("minilm", digest)) in (0, 1)
    deadline = time.monotonic() + 5
    while cache.redis.exists(l1_key("minilm", digest)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not cache.redis.exists(l1_key("minilm", digest)), "the L1 entry outlived its 1 s TTL"
    l2_before = cache.hits("l2")
    response = cache.lookup("minilm", digest)
    assert response.hit and response.outputs[0].data == EMBEDDING.data
    assert cache.hits("l2") == l2_before + 1
    deadline = time.monotonic() + 5  # the L2 hit is promoted back to L1
    while not cache.redis.exists(l1_key("minilm", digest)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cache.redis.exists(l1_key("minilm", digest))


def test_l2_survives_a_cache_service_restart(cache):
    digest = b"\x02" * 16
    cache.store("minilm", digest, [EMBEDDING])
    assert cache.lookup("minilm", digest).hit
    cache.stop_cache()
    cache.redis.flushall()
    cache.start()
    response = cache.lookup("minilm", digest)
    assert response.hit and response.outputs[0].data == EMBEDDING.data
    assert cache.hits("l2") == 1
    assert metric(cache.mesh.metrics_url("cache"), "infermesh_cache_l2_bytes") > len(EMBEDDING.data)


def test_foreign_and_corrupt_values_in_redis_are_misses(cache):
    for i, junk in enumerate([b"\x80\x04\x95pickle", b"IMC1\x00\x05", b"", b"IMC1\x01\x01not-zstd"]):
        digest = bytes([0x30 + i]) * 16
        cache.redis.set(l1_key("minilm", digest), junk)
        assert not cache.lookup("minilm", digest).hit
    digest = b"\x3f" * 16
    cache.redis.rpush(l1_key("minilm", digest), b"a list, not a string")
    assert not cache.lookup("minilm", digest).hit
    assert metric(cache.mesh.metrics_url("cache"), "infermesh_cache_invalid_values_total", level="l1") >= 3
    assert cache.mesh.processes["cache"].alive()


def test_redis_killed_then_restarted_mid_test(cache):
    before = b"\x04" * 16
    cache.store("minilm", before, [EMBEDDING])
    cache.mesh.stop_redis()
    # Redis is gone: L2 still answers, new results still land in L2, nothing fails.
    assert cache.lookup("minilm", before).hit
    during = b"\x05" * 16
    cache.store("minilm", during, [EMBEDDING])
    assert cache.lookup("minilm", during).hit
    assert not cache.lookup("minilm", b"\x06" * 16).hit
    assert metric(cache.mesh.metrics_url("cache"), "infermesh_cache_errors_total") > 0
    cache.mesh.start_redis()
    after = b"\x07" * 16
    deadline = time.monotonic() + 10
    while not cache.redis.exists(l1_key("minilm", after)) and time.monotonic() < deadline:
        cache.store("minilm", after, [EMBEDDING])
        time.sleep(0.2)
    assert cache.redis.exists(l1_key("minilm", after)), "the cache did not go back to Redis by itself"


def test_purge_needs_the_token_and_forgets_every_level(cache):
    digest = b"\x08" * 16
    cache.store("minilm", digest, [EMBEDDING])
    cache.store("mlp", digest, [EMBEDDING])
    for metadata, code in (
        ((), grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", "Bearer wrong"),), grpc.StatusCode.UNAUTHENTICATED),
    ):
        with pytest.raises(grpc.RpcError) as info:
            cache.stub.Purge(cache_pb2.PurgeRequest(model="minilm"), metadata=metadata, timeout=10)
        assert info.value.code() == code and "Bearer" in info.value.details()
    assert cache.lookup("minilm", digest).hit
    response = cache.stub.Purge(
        cache_pb2.PurgeRequest(model="minilm"), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10
    )
    assert response.generation == 1 and response.l2_deleted == 1
    assert not cache.lookup("minilm", digest).hit
    assert cache.lookup("mlp", digest).hit  # other models keep theirs
    cache.store("minilm", digest, [EMBEDDING])
    assert cache.redis.exists(l1_key("minilm", digest, generation=1))
    assert cache.lookup("minilm", digest).hit


def store_request(model="minilm", digest=b"\x09" * 16, outputs=(EMBEDDING,)):
    return cache_pb2.StoreRequest(model=model, digest=digest, outputs=tensors_to_proto(list(outputs)))


@pytest.mark.parametrize(
    "request_, message",
    [
        (store_request(model=""), "StoreRequest 1 of this stream: model is empty"),
        (store_request(model="a\x00b"), "model 'a\\x00b' is not a model name"),
        (store_request(digest=b""), "digest of model 'minilm' is 0 bytes (empty); a request digest is 16"),
        (store_request(digest=b"\x02" * 600), "digest of model 'minilm' is 600 bytes (0202020202020202)"),
        (store_request(outputs=()), "outputs of model 'minilm': holds 0 tensors; 1 to 255 fit"),
        (store_request(outputs=(EMBEDDING,) * 256), "holds 256 tensors; 1 to 255 fit"),
        (
            store_request(outputs=(TensorData("EMBEDDING", "FP32", (1, 384), b"\0" * 6),)),
            "holds 6 bytes; FP32 of shape",
        ),
    ],
    ids=["empty-model", "nul-model", "empty-digest", "long-digest", "no-outputs", "256-outputs", "short-data"],
)
def test_a_malformed_store_is_refused_naming_the_field_and_the_ones_before_it_are_kept(cache, request_, message):
    before = b"\x0a" * 16
    with pytest.raises(grpc.RpcError) as info:
        cache.stub.Store(iter([store_request(digest=before), request_]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    assert cache.lookup("minilm", before).hit


@pytest.mark.parametrize(
    "model, digest, message",
    [
        ("", b"\x01" * 16, "LookupRequest id 7: model is empty"),
        ("minilm", b"", "LookupRequest id 7: digest of model 'minilm' is 0 bytes"),
        ("minilm", b"\x01" * 20, "digest of model 'minilm' is 20 bytes"),
    ],
    ids=["empty-model", "empty-digest", "long-digest"],
)
def test_a_malformed_lookup_is_a_miss_naming_the_field_and_the_stream_goes_on(cache, model, digest, message):
    good = b"\x0c" * 16
    cache.store("minilm", good, [EMBEDDING])
    lookups = [
        cache_pb2.LookupRequest(id=7, model=model, digest=digest),
        cache_pb2.LookupRequest(id=8, model="minilm", digest=good),
    ]
    answers = {r.id: r for r in cache.stub.Lookup(iter(lookups), timeout=10)}
    assert not answers[7].hit and message in answers[7].error
    assert answers[8].hit and not answers[8].error


def test_a_damaged_l2_file_is_moved_aside_and_the_service_starts_on_an_empty_one(cache, tmp_path):
    digest = b"\x0b" * 16
    cache.store("minilm", digest, [EMBEDDING])
    cache.stop_cache()
    data = tmp_path / "l2" / "data.mdb"
    raw = bytearray(data.read_bytes())
    raw[:8192] = b"\xa5" * 8192  # both meta pages: LMDB answers MDB_INVALID
    data.write_bytes(bytes(raw))
    cache.redis.flushall()
    cache.start()
    assert "cannot be opened (InvalidError" in cache.mesh.processes["cache"].log_tail(50)
    assert len(list((tmp_path / "l2").glob("data.mdb.damaged-*"))) == 1
    assert not cache.lookup("minilm", digest).hit
    cache.store("minilm", digest, [EMBEDDING])
    cache.redis.flushall()
    assert cache.lookup("minilm", digest).hit and cache.hits("l2") == 1


def test_a_store_with_the_generation_of_a_lookup_before_a_purge_is_stale(cache):
    digest = b"\x47" * 16
    assert cache.lookup("minilm", digest).generation == 0
    purged = cache.stub.Purge(
        cache_pb2.PurgeRequest(model="minilm"), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=10
    )
    assert purged.generation == 1
    stale = cache_pb2.StoreRequest(model="minilm", digest=digest, outputs=tensors_to_proto([EMBEDDING]), generation=0)
    fresh = cache_pb2.StoreRequest(model="minilm", digest=b"\x48" * 16, outputs=tensors_to_proto([EMBEDDING]))
    summary = cache.stub.Store(iter([stale, fresh]), timeout=10)
    assert (summary.stored, summary.failed, summary.stale) == (1, 0, 1)
    assert not cache.lookup("minilm", digest).hit
    assert cache.lookup("minilm", b"\x48" * 16).generation == 1
