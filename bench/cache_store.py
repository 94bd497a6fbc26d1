"""Chooses the cache's L2 by measurement: embedded key-value stores (LMDB,
RocksDB through rocksdict, SQLite as the baseline), compressors (none, lz4,
zstd) and fp16 storage of embeddings, on real minilm embeddings.

    .venv/bin/python -m bench.cache_store

Writes bench/results/cache_store.{json,md}.
"""

import argparse
import os
import pathlib
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time

import lmdb
import lz4.frame
import numpy as np
import rocksdict
import zstandard

from bench.report import machine, write
from bench.workload import InProcessMinilm, texts

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = ROOT / "build" / "models" / "minilm" / "1"
COUNT = 4000
BATCH = 32
RUNS = 3


def embeddings(count: int) -> np.ndarray:
    model = InProcessMinilm(MODEL)
    pool = texts(count, seed=42)
    return np.concatenate([model.embed(pool[start : start + 64]) for start in range(0, count, 64)])


class LmdbStore:
    def __init__(self, path):
        self.env = lmdb.open(str(path), map_size=1 << 30, sync=False, metasync=False)

    def put_many(self, items):
        with self.env.begin(write=True) as txn:
            for k, v in items:
                txn.put(k, v)

    def get_many(self, keys):
        with self.env.begin() as txn:
            return [txn.get(k) for k in keys]

    def close(self):
        self.env.close()


class RocksStore:
    def __init__(self, path):
        self.db = rocksdict.Rdict(str(path))

    def put_many(self, items):
        batch = rocksdict.WriteBatch()
        for k, v in items:
            batch.put(k, v)
        self.db.write(batch)

    def get_many(self, keys):
        return self.db[keys]

    def close(self):
        self.db.close()


class SqliteStore:
    def __init__(self, path):
        self.db = sqlite3.connect(str(path / "kv.sqlite"))
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS kv (k BLOB PRIMARY KEY, v BLOB) WITHOUT ROWID")

    def put_many(self, items):
        with self.db:
            self.db.executemany("INSERT OR REPLACE INTO kv VALUES (?, ?)", items)

    def get_many(self, keys):
        marks = ",".join("?" * len(keys))
        found = dict(self.db.execute(f"SELECT k, v FROM kv WHERE k IN ({marks})", keys).fetchall())
        return [found.get(k) for k in keys]

    def close(self):
        self.db.close()


def folder_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure_store(cls, values: list[bytes]) -> dict:
    keys = [os.urandom(16) for _ in values]
    path = pathlib.Path(tempfile.mkdtemp(prefix="l2-"))
    store = cls(path)
    started = time.perf_counter()
    for i in range(0, len(keys), BATCH):
        store.put_many(list(zip(keys[i : i + BATCH], values[i : i + BATCH], strict=True)))
    put_s = time.perf_counter() - started
    order = keys[:]
    random.Random(1).shuffle(order)
    started = time.perf_counter()
    for i in range(0, len(order), BATCH):
        assert all(v is not None for v in store.get_many(order[i : i + BATCH]))
    get_s = time.perf_counter() - started
    store.close()
    size = folder_bytes(path)
    shutil.rmtree(path)
    return {"put_per_s": len(keys) / put_s, "get_per_s": len(keys) / get_s, "disk_bytes": size}


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print("computing real minilm embeddings ...", flush=True)
    vectors = embeddings(COUNT)
    raw32 = [v.astype("<f4").tobytes() for v in vectors]
    raw16 = [v.astype("<f2").tobytes() for v in vectors]
    back = np.stack([np.frombuffer(b, "<f2").astype(np.float32) for b in raw16])
    cosine = np.sum(back * vectors, axis=1) / (np.linalg.norm(back, axis=1) * np.linalg.norm(vectors, axis=1))
    zstd = zstandard.ZstdCompressor(level=3)
    codecs = {"none": lambda b: b, "lz4": lz4.frame.compress, "zstd-3": zstd.compress}
    compression = {}
    for precision, values in (("fp32", raw32), ("fp16", raw16)):
        for name, codec in codecs.items():
            started = time.perf_counter()
            packed = [codec(v) for v in values]
            elapsed = time.perf_counter() - started
            compression[f"{precision}+{name}"] = {
                "bytes_per_value": statistics.mean(len(p) for p in packed),
                "ratio_vs_fp32_raw": sum(len(p) for p in packed) / sum(len(v) for v in raw32),
                "compress_us": 1e6 * elapsed / len(values),
            }
            print(f"  {precision}+{name}: {compression[f'{precision}+{name}']}", flush=True)
    stores = {}
    for name, cls in (("lmdb", LmdbStore), ("rocksdict", RocksStore), ("sqlite", SqliteStore)):
        runs = [measure_store(cls, [zstd.compress(v) for v in raw32]) for _ in range(RUNS)]
        stores[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"  {name}: {stores[name]}", flush=True)
    report = {
        "machine": machine(),
        "command": "python -m bench.cache_store",
        "values": COUNT,
        "batch": BATCH,
        "runs": RUNS,
        "date": time.strftime("%Y-%m-%d"),
        "fp16_cosine": {"min": float(cosine.min()), "mean": float(cosine.mean())},
        "compression": compression,
        "stores": stores,
    }
    lines = [
        f"Machine: {report['machine']}. Command: `{report['command']}`. {COUNT} real minilm embeddings "
        f"(384 × FP32), batches of {BATCH}; store figures are medians of {RUNS} runs.",
        "",
        "| encoding | bytes per embedding | size vs raw FP32 | encode µs |",
        "|---|---|---|---|",
    ]
    for name, c in compression.items():
        lines.append(f"| {name} | {c['bytes_per_value']:.0f} | {c['ratio_vs_fp32_raw']:.2f} | {c['compress_us']:.1f} |")
    lines += [
        "",
        f"FP16 storage: cosine to the FP32 embedding min {cosine.min():.7f}, mean {cosine.mean():.7f}.",
        "",
        "| store (zstd-3 FP32 values) | puts/s | gets/s | disk bytes |",
        "|---|---|---|---|",
    ]
    for name, s in stores.items():
        lines.append(f"| {name} | {s['put_per_s']:.0f} | {s['get_per_s']:.0f} | {s['disk_bytes']:,} |")
    write(ROOT / "bench" / "results", "cache_store", report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
