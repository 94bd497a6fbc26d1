"""The L2 store: LMDB on local disk, bounded, surviving restarts.

LMDB was chosen by measurement (bench/cache_store.py): the fastest reads of
the stores tried and no background compaction competing for the cores.
Values are kept in write order in a second table, so that when the stored
bytes pass the bound the oldest entries go first. Every call blocks, so the
cache service runs them off the event loop: writes in one thread, reads in another
(LMDB readers never wait for its writer).
"""

import logging
import pathlib
import struct
import threading
import time
from typing import overload

import lmdb

from services.cache import metrics

log = logging.getLogger(__name__)
# What a damaged or foreign data file raises (a crash with sync off may leave one).
DAMAGED = (
    lmdb.InvalidError,
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.VersionMismatchError,
    lmdb.IncompatibleError,
    lmdb.PanicError,
    ValueError,
)
_ORDER_KEY = struct.Struct(">dI")  # write time, then a tie-breaking counter; big-endian sorts by time
# Entries' footprints (see `footprint`); an older store counted value bytes alone under
# b"stored_bytes", so its total is recounted once under the new name.
_META_BYTES = b"footprint_bytes"
# Per entry beyond its key (twice) and value: its order key twice, and two B-tree nodes' headers
# and slot pointers, rounded up. Measured: a small entry costs LMDB about this plus page slack.
_ENTRY_OVERHEAD = 2 * _ORDER_KEY.size + 48
_META_GENERATION = b"generation\x00"  # + model: the highest purge generation this store has seen
_META_FLOOR = b"generation_floor"  # every model's least generation (raised when a record was damaged)
MAX_GENERATION = 1 << 62  # within an L2 key's 8 bytes, with room above a fresh one
EVICT_ROOM_DIVISOR = 50  # an eviction frees a fiftieth of the bound


class DiskStore:
    """get_many / put_many / delete_prefix over LMDB, at most `max_bytes` of entries (see `footprint`)."""

    def __init__(self, path: str | pathlib.Path, max_bytes: int):
        self._path = pathlib.Path(path)
        self._path.mkdir(parents=True, exist_ok=True)
        self._max_bytes = max_bytes
        self._counter = 0
        self._lock = threading.Lock()
        try:
            self._open()
        except DAMAGED as exc:
            # A cache may start over; a service that will not start takes the mesh with it.
            aside = self._move_aside()
            log.error(
                "L2 store in %s cannot be opened (%s: %s); moved its data file to %s and started an empty store",
                self._path,
                type(exc).__name__,
                exc,
                aside,
            )
            self._open()

    def _open(self) -> None:
        # The map is the file's upper bound; values plus LMDB's own pages stay well inside it.
        self._env = lmdb.open(
            str(self._path),
            map_size=max(4 * self._max_bytes, 64 << 20),
            max_dbs=3,
            sync=False,
            metasync=False,
            lock=True,
        )
        try:
            self._values = self._env.open_db(b"values")
            self._order = self._env.open_db(b"order")
            self._meta = self._env.open_db(b"meta")
            with self._env.begin(db=self._meta) as txn:
                raw = txn.get(_META_BYTES)
            self.stored_bytes = int(raw) if raw else self._recount()
        except BaseException:
            self._env.close()
            raise

    def _recount(self) -> int:
        with self._env.begin(write=True) as txn:
            stored = sum(footprint(k, _value(v)) for k, v in txn.cursor(db=self._values))
            txn.put(_META_BYTES, str(stored).encode(), db=self._meta)
        return stored

    def _move_aside(self) -> pathlib.Path:
        """Keeps the damaged file for a look, as the one newest such file: older
        ones go, so that a store damaged again and again cannot fill the disk."""
        for older in self._path.glob("data.mdb.damaged-*"):
            older.unlink(missing_ok=True)
        aside = self._path / f"data.mdb.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
        (self._path / "data.mdb").rename(aside)
        (self._path / "lock.mdb").unlink(missing_ok=True)
        return aside

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """The values of `keys`, None where a key is absent or its page is
        damaged (each such failure logged and counted, never raised)."""
        try:
            with self._env.begin(db=self._values, buffers=False) as txn:
                return [_value(txn.get(k)) for k in keys]
        except DAMAGED as exc:
            metrics.ERRORS.labels("l2_get").inc()
            log.warning(
                "L2 read of %d keys failed (%s: %s); reading them one by one", len(keys), type(exc).__name__, exc
            )
        return [self._get_alone(k) for k in keys]

    def _get_alone(self, key: bytes) -> bytes | None:
        try:
            with self._env.begin(db=self._values, buffers=False) as txn:
                return _value(txn.get(key))
        except DAMAGED:
            metrics.ERRORS.labels("l2_get").inc()
            return None

    @property
    def max_key_bytes(self) -> int:
        return self._env.max_key_size()

    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        """Writes all of `items` or, when it raises, none of them. Should LMDB's
        map fill before the bound is reached (page slack beyond what `footprint`
        counts), the oldest quarter goes and the write is tried once more."""
        for key, value in items:
            if not 0 < len(key) <= self.max_key_bytes:
                raise ValueError(f"an L2 key of {len(key)} bytes; LMDB takes 1 to {self.max_key_bytes}")
            if footprint(key, value) > self._max_bytes:
                raise ValueError(f"an L2 value of {len(value)} bytes; the bound is {self._max_bytes}")
        try:
            self._put_many(items)
        except lmdb.MapFullError:
            target = min(self.stored_bytes, self._max_bytes) * 3 // 4
            log.warning(
                "L2's map filled with %d bytes counted (bound %d); evicting down to %d",
                self.stored_bytes,
                self._max_bytes,
                target,
            )
            with self._lock, self._env.begin(write=True) as txn:
                stored = self._evict(txn, self.stored_bytes, target)
                txn.put(_META_BYTES, str(stored).encode(), db=self._meta)
            self.stored_bytes = stored
            self._put_many(items)

    def _put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        with self._lock, self._env.begin(write=True) as txn:
            # Counted aside and kept only once the transaction commits.
            stored = self.stored_bytes
            now = time.time()
            for key, value in items:
                self._counter = (self._counter + 1) & 0xFFFFFFFF
                order_key = _ORDER_KEY.pack(now, self._counter)
                old = txn.get(key, db=self._values)
                if old is not None:
                    stored -= footprint(key, _value(old))
                    txn.delete(old[: _ORDER_KEY.size], db=self._order)
                # Each value carries its order key, so replacing it can drop the old order entry.
                txn.put(key, order_key + value, db=self._values)
                txn.put(order_key, key, db=self._order)
                stored += footprint(key, value)
            if stored > self._max_bytes:
                # A little room, so that not every write evicts; little, as the eviction holds up the
                # writes behind it, for a time that grows with what it frees and with the bound.
                stored = self._evict(txn, stored, self._max_bytes - self._max_bytes // EVICT_ROOM_DIVISOR)
            txn.put(_META_BYTES, str(stored).encode(), db=self._meta)
        self.stored_bytes = stored

    def _evict(self, txn: "lmdb.Transaction[bytes]", stored: int, target: int) -> int:
        """Deletes the oldest entries until `target` bytes are counted; returns the count."""
        evicted = 0
        with txn.cursor(db=self._order) as cursor:
            for order_key, key in cursor:
                if stored <= target:
                    break
                value = txn.get(key, db=self._values)
                if value is not None:
                    stored -= footprint(key, _value(value))
                    txn.delete(key, db=self._values)
                txn.delete(order_key, db=self._order)
                evicted += 1
        log.info("L2 evicted %d oldest entries; %d bytes stored", evicted, stored)
        return stored

    def delete_prefix(self, prefix: bytes) -> int:
        """Deletes every key starting with `prefix`; returns how many."""
        deleted = 0
        with self._lock, self._env.begin(write=True) as txn:
            stored = self.stored_bytes
            with txn.cursor(db=self._values) as cursor:
                if cursor.set_range(prefix):
                    while cursor.key().startswith(prefix):
                        value = cursor.value()
                        txn.delete(value[: _ORDER_KEY.size], db=self._order)
                        stored -= footprint(cursor.key(), _value(value))
                        deleted += 1
                        if not cursor.delete():
                            break
            txn.put(_META_BYTES, str(stored).encode(), db=self._meta)
        self.stored_bytes = stored
        return deleted

    def generations(self) -> dict[str, int]:
        """The highest generation recorded per model (see `record_generations`).
        A damaged record is dropped and the floor raised to a fresh generation
        (logged): that model's entries here may then be older than its purge,
        and only a generation above every one ever used keeps them unreachable."""
        found, damaged = {}, []
        with self._env.begin(db=self._meta) as txn, txn.cursor() as cursor:
            if cursor.set_range(_META_GENERATION):
                for key, value in cursor:
                    if not key.startswith(_META_GENERATION):
                        break
                    generation = _generation_value(value)
                    try:
                        model = key[len(_META_GENERATION) :].decode()
                    except UnicodeDecodeError:
                        generation = None
                    if generation is None:
                        damaged.append((key, value))
                    else:
                        found[model] = generation
        floor = self.generation_floor()
        if damaged or floor is None:
            fresh = fresh_generation()
            with self._lock, self._env.begin(write=True, db=self._meta) as txn:
                for key, _ in damaged:
                    txn.delete(key)
                txn.put(_META_FLOOR, str(fresh).encode())
            log.error(
                "L2 store in %s: generation records damaged (%s); dropped them, and every model starts at "
                "fresh generation %d or above",
                self._path,
                ", ".join(f"{k!r}: {v[:40]!r}" for k, v in damaged[:4]) or "the floor record",
                fresh,
            )
        return found

    def generation_floor(self) -> int | None:
        """The least generation of every model (0 until a damaged record raised
        it; None when the floor's own record is damaged)."""
        with self._env.begin(db=self._meta) as txn:
            raw = txn.get(_META_FLOOR)
        return 0 if raw is None else _generation_value(raw)

    def record_generations(self, generations: dict[str, int]) -> None:
        """Keeps each model's generation, never lowering one already recorded:
        it outlives Redis, which may restart empty and read back 0."""
        with self._lock, self._env.begin(write=True, db=self._meta) as txn:
            for model, generation in generations.items():
                key = _META_GENERATION + model.encode()
                old = _generation_value(txn.get(key) or b"0")
                if old is None or old < generation:
                    txn.put(key, str(generation).encode())

    def __len__(self) -> int:
        with self._env.begin(db=self._values) as txn:
            return txn.stat(self._values)["entries"]

    def close(self) -> None:
        self._env.sync(True)
        self._env.close()


def footprint(key: bytes, value: bytes) -> int:
    """What one entry costs LMDB near enough, the measure of the bound: the key
    in both tables, the value, and the fixed overhead of two B-tree entries."""
    return 2 * len(key) + len(value) + _ENTRY_OVERHEAD


@overload
def _value(stored: bytes) -> bytes: ...
@overload
def _value(stored: bytes | None) -> bytes | None: ...
def _value(stored: bytes | None) -> bytes | None:
    """A stored value without its order key; None for none."""
    return None if stored is None else stored[_ORDER_KEY.size :]


def fresh_generation() -> int:
    """A generation above any a store has used: microseconds since the epoch
    (generations count purges up from 0; nobody purges a million times a second)."""
    return time.time_ns() // 1000


def _generation_value(raw: bytes) -> int | None:
    """A recorded generation, or None when the record is damaged."""
    return int(raw) if raw.isdigit() and len(raw) <= 19 and int(raw) < MAX_GENERATION else None
