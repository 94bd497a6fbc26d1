"""The cache's value codec, its disk store and the router's automatic bypass."""

import os
import struct

import lmdb
import numpy as np
import pytest

from services.cache import codec
from services.cache.disk import DiskStore, footprint
from services.common.tensors import TensorData, from_numpy, to_numpy
from services.router.bypass import AdaptiveBypass
from services.router.nearcache import NearCache

pytestmark = pytest.mark.unit


def embedding_tensor(rows: int = 2) -> TensorData:
    vectors = np.random.default_rng(rows).standard_normal((rows, 384)).astype(np.float32)
    return from_numpy("EMBEDDING", vectors / np.linalg.norm(vectors, axis=1, keepdims=True))


def test_codec_round_trips_fixed_and_bytes_tensors_exactly():
    tensors = [embedding_tensor(), from_numpy("T", np.array([b"", "é".encode()], dtype=object))]
    for compress in (False, True):
        assert codec.decode(codec.encode(tensors, compress=compress)) == tensors


def test_codec_compresses_only_when_it_pays():
    repetitive = from_numpy("X", np.zeros((64, 64), np.float32))
    assert len(codec.encode([repetitive], compress=True)) < len(repetitive.data) / 10
    noise = TensorData("X", "UINT8", (4096,), os.urandom(4096))
    assert codec.encode([noise], compress=True)[4] & codec.ZSTD == 0  # incompressible: kept raw


def test_codec_fp16_keeps_fp32_where_a_value_would_overflow():
    """FP16 has nothing finite beyond ±65504: such a tensor is stored as it is,
    its neighbour in the same value still narrowed."""
    big = from_numpy("LOGITS", np.array([[7e4, -1e5, 1.5]], np.float32))
    small = from_numpy("EMBEDDING", np.array([[0.25, -0.5, 1.0]], np.float32))
    packed = codec.encode([big, small], fp16=True)
    decoded = {t.name: to_numpy(t) for t in codec.decode(packed)}
    assert decoded["LOGITS"].tolist() == [[7e4, -1e5, 1.5]]
    assert decoded["EMBEDDING"].tolist() == [[0.25, -0.5, 1.0]]
    assert len(packed) < len(codec.encode([big, small]))  # the embedding still went to FP16


def test_codec_fp16_halves_embeddings_within_cosine_budget():
    tensor = embedding_tensor(16)
    packed = codec.encode([tensor], fp16=True)
    assert len(packed) < 0.55 * len(tensor.data)
    (back,) = codec.decode(packed)
    assert back.datatype == "FP32" and back.shape == tensor.shape
    a, b = to_numpy(tensor), to_numpy(back)
    assert (np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min() > 0.99999


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"IMC",
        b"pickle\x80\x04",
        b"IMC1\x00\x01",
        b"IMC1\x01\x01garbage-not-zstd",
        codec.encode([embedding_tensor()])[:-7],  # truncated data
        codec.encode([embedding_tensor()]) + b"extra",  # trailing bytes
        b"IMC1\x00\x01" + struct.pack("<H", 1) + b"X" + b"\x04NOPE" + b"\x00" + struct.pack("<I", 0),  # bad dtype
    ],
)
def test_foreign_or_corrupt_values_are_rejected_never_executed(value):
    with pytest.raises(codec.CorruptValue):
        codec.decode(value)


def test_disk_store_is_bounded_drops_oldest_first_and_survives_reopen(tmp_path):
    store = DiskStore(tmp_path, max_bytes=1 << 20)
    for batch in range(30):
        store.put_many([(f"m\x00{batch:03d}{i:03d}".encode(), os.urandom(4096)) for i in range(10)])
    assert store.stored_bytes <= 1 << 20
    newest, oldest = store.get_many([b"m\x00029009", b"m\x00000000"])
    assert newest is not None and oldest is None
    count, stored = len(store), store.stored_bytes
    store.close()
    reopened = DiskStore(tmp_path, max_bytes=1 << 20)
    assert (len(reopened), reopened.stored_bytes) == (count, stored)
    assert reopened.get_many([b"m\x00029009"])[0] == newest
    assert reopened.delete_prefix(b"m\x00") == count
    assert len(reopened) == 0 and reopened.stored_bytes == 0
    reopened.close()


def test_replacing_a_value_keeps_the_byte_count_right(tmp_path):
    store = DiskStore(tmp_path, max_bytes=1 << 20)
    store.put_many([(b"k", b"x" * 100)])
    store.put_many([(b"k", b"y" * 40)])
    assert store.stored_bytes == footprint(b"k", b"y" * 40) and store.get_many([b"k"]) == [b"y" * 40]
    store.close()


def test_bypass_turns_on_for_a_unique_workload_and_off_when_it_repeats():
    bypass = AdaptiveBypass(window=10, min_hit_rate=0.1, memory=100)
    for _ in range(10):
        assert bypass.should_use_cache("m")
        bypass.record("m", hit=False)
    assert bypass.is_bypassed("m")
    assert not any(bypass.should_use_cache("m") for _ in range(50))  # no probes: the cache sees nothing
    for i in range(30):  # all distinct: no repeats, the bypass holds
        bypass.observe("m", bytes([i]))
    assert bypass.is_bypassed("m")
    for i in range(8):  # one repeat in a window of ten: not enough
        bypass.observe("m", bytes([100 + i]) if i != 3 else b"\x05")
    assert bypass.is_bypassed("m")
    bypass.observe("m", b"\x05")  # the second: twice the minimum hit rate lifts it
    assert not bypass.is_bypassed("m")
    assert all(bypass.should_use_cache("m") for _ in range(5))
    assert not bypass.is_bypassed("other")


def test_bypass_remembers_a_bounded_number_of_digests_most_recent_first():
    """A repeat is one of the last `memory` distinct requests; an input asked
    again is remembered anew, so one that keeps coming back stays known."""
    bypass = AdaptiveBypass(window=4, min_hit_rate=0.25, memory=3)
    for _ in range(4):
        bypass.record("m", hit=False)
    for digest in (b"a", b"b", b"c", b"a", b"d"):  # "a" repeats and is refreshed; "d" pushes "b" out
        bypass.observe("m", digest)
    assert bypass.is_bypassed("m")  # one repeat in the window of four: under twice the minimum
    bypass.observe("m", b"b")  # forgotten: not a repeat
    assert bypass.is_bypassed("m")
    bypass.observe("m", b"a")  # still remembered: the window's second repeat
    assert not bypass.is_bypassed("m")


def test_near_cache_expires_and_stays_within_its_byte_bound():
    now = [0.0]
    near = NearCache(ttl_s=1.0, max_bytes=3 * (1536 + 64), clock=lambda: now[0])
    tensor = embedding_tensor(1)
    for i in range(4):
        near.put(bytes([i]), [tensor])
    assert len(near) == 3 and near.get(b"\x00") is None  # least recently used went first
    assert near.get(b"\x01") == [tensor]
    near.put(b"\x04", [tensor])
    assert near.get(b"\x02") is None and near.get(b"\x01") == [tensor]  # a get refreshes recency
    now[0] = 1.5
    assert near.get(b"\x01") is None and near.bytes < 3 * (1536 + 64)
    assert not NearCache(ttl_s=0, max_bytes=1 << 20).enabled


def test_near_cache_results_nobody_asks_for_again_go_once_expired_not_at_the_byte_bound():
    """Distinct inputs: every result is put once and never read. Past their TTL
    they must not sit in memory until the byte bound pushes them out."""
    now = [0.0]
    near = NearCache(ttl_s=1.0, max_bytes=1 << 30, clock=lambda: now[0])
    tensor = embedding_tensor(1)
    for i in range(100):
        now[0] = i * 0.1  # ten puts a second, each a new digest
        near.put(i.to_bytes(2, "big"), [tensor])
    assert len(near) <= 11 and near.bytes <= 11 * (1536 + 64)  # about one TTL's worth, not all 100


def test_a_refused_write_leaves_the_byte_count_as_it_was(tmp_path):
    store = DiskStore(tmp_path, max_bytes=1 << 20)
    store.put_many([(b"k", b"x" * 100)])
    with pytest.raises(ValueError, match="L2 value of 2097152 bytes"):  # more than the bound: never kept
        store.put_many([(b"a", b"y" * 50), (b"huge", b"z" * (2 << 20))])
    with pytest.raises(ValueError, match="L2 key of 600 bytes"):
        store.put_many([(b"b", b"y" * 50), (b"k" * 600, b"z")])
    assert store.stored_bytes == footprint(b"k", b"x" * 100) and store.get_many([b"a", b"b"]) == [None, None]
    store.close()
    assert DiskStore(tmp_path, max_bytes=1 << 20).stored_bytes == footprint(b"k", b"x" * 100)


def lmdb_bytes_in_use(path) -> int:
    """Pages LMDB's tables hold now (free pages aside), in bytes."""
    env = lmdb.open(str(path), max_dbs=3, readonly=True, lock=False)
    with env.begin() as txn:
        tables = [None, *(env.open_db(name, txn=txn, create=False) for name in (b"values", b"order", b"meta"))]
        stats = [txn.stat(db) if db is not None else env.stat() for db in tables]
    env.close()
    return sum(s["psize"] * (s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]) for s in stats)


def test_the_bound_holds_what_lmdb_really_uses_for_small_results(tmp_path):
    value = codec.encode([from_numpy("LABEL", np.array([[3]], np.int64))], compress=True)  # 48 bytes
    store = DiskStore(tmp_path, max_bytes=1 << 20)
    for batch in range(40):
        store.put_many(
            [(b"clf\x00" + bytes(8) + i.to_bytes(4, "big") + batch.to_bytes(12, "big"), value) for i in range(500)]
        )
    assert store.stored_bytes <= 1 << 20
    store.close()
    # Counting values alone held 20,000 of them, over 4 MiB of pages; page slack allows some excess.
    assert lmdb_bytes_in_use(tmp_path) < 1.6 * (1 << 20)


def test_only_the_newest_damaged_l2_file_is_kept(tmp_path):
    """A store damaged again and again (a node that keeps crashing) must not
    fill the disk with the files it moved aside."""
    for round_ in range(3):
        store = DiskStore(tmp_path, max_bytes=1 << 20)
        store.put_many([(b"k", b"x" * 100)])
        store.close()
        data = tmp_path / "data.mdb"
        data.write_bytes(b"\xa5" * 8192 + data.read_bytes()[8192:])  # both meta pages: MDB_INVALID
        for older in tmp_path.glob("data.mdb.damaged-*"):  # distinct names, as a second apart they would be
            older.rename(tmp_path / f"data.mdb.damaged-round{round_}-{older.name[-6:]}")
        DiskStore(tmp_path, max_bytes=1 << 20).close()
    assert len(list(tmp_path.glob("data.mdb.damaged-*"))) == 1


def test_a_disk_store_whose_floor_record_is_damaged_gets_a_fresh_one(tmp_path):
    store = DiskStore(tmp_path / "l2", 64 << 20)
    assert store.generations() == {} and store.generation_floor() == 0
    with store._env.begin(write=True, db=store._meta) as txn:
        txn.put(b"generation_floor", b"not a number")
    assert store.generation_floor() is None
    store.generations()
    assert store.generation_floor() > 1 << 40
    store.close()
