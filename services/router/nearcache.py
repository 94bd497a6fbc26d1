"""The near cache: the hottest results in the router's own memory for a short
time, so a repeated request is answered without a trip to the cache service.

Bounded by entries and bytes (least recently used goes first) and by a short
TTL, which is also how long a Purge takes to reach the routers.
"""

import collections
import time
from collections.abc import Callable

from services.common.tensors import TensorData


class NearCache:
    def __init__(self, ttl_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic):
        self._ttl_s = ttl_s
        self._max_bytes = max_bytes
        self._clock = clock
        self._entries: collections.OrderedDict[bytes, tuple[float, list[TensorData], int]] = collections.OrderedDict()
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self._ttl_s > 0 and self._max_bytes > 0

    def get(self, digest: bytes) -> list[TensorData] | None:
        entry = self._entries.get(digest)
        if entry is None:
            return None
        expires, outputs, size = entry
        if self._clock() >= expires:
            del self._entries[digest]
            self._bytes -= size
            return None
        self._entries.move_to_end(digest)
        return outputs

    def put(self, digest: bytes, outputs: list[TensorData]) -> None:
        if not self.enabled:
            return
        size = sum(len(t.data) for t in outputs) + 64 * len(outputs)
        if size > self._max_bytes:
            return
        old = self._entries.pop(digest, None)
        if old is not None:
            self._bytes -= old[2]
        now = self._clock()
        # Expired entries at the least recently used end go now: results nobody asks for
        # again (distinct inputs) would otherwise sit until the byte bound pushed them out.
        while self._entries:
            expires, _, evicted = next(iter(self._entries.values()))
            if expires > now:
                break
            self._entries.popitem(last=False)
            self._bytes -= evicted
        self._entries[digest] = (now + self._ttl_s, outputs, size)
        self._bytes += size
        while self._bytes > self._max_bytes:
            _, (_, _, evicted) = self._entries.popitem(last=False)
            self._bytes -= evicted

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes
