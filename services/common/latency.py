"""How long a batch runs, learned online per size class: the batcher's
adaptive policy plans with it, the model server decides refusals with it."""

from __future__ import annotations

import math


def size_class(rows: int) -> int:
    """A batch size rounded up to a power of two: few classes, each of similar cost."""
    return 1 << max(rows - 1, 0).bit_length()


class LatencyProfile:
    """Seconds per batch, a moving average per size class."""

    def __init__(self, alpha: float = 0.2):
        self._alpha = alpha
        self._seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        key = size_class(rows)
        old = self._seconds.get(key)
        self._seconds[key] = seconds if old is None else (1 - self._alpha) * old + self._alpha * seconds

    def estimate(self, rows: int, shrink: bool = True) -> float | None:
        """The learned time of a batch of `rows`; from the nearest class, scaled
        by rows, when its own is still unknown (with `shrink` False, never scaled
        down: a cautious estimate, as small batches are not proportionally
        quicker); None before any batch ran."""
        if not self._seconds:
            return None
        key = size_class(rows)
        if key in self._seconds:
            return self._seconds[key]
        nearest = min(self._seconds, key=lambda k: abs(math.log2(k) - math.log2(key)))
        scale = key / nearest
        return self._seconds[nearest] * (scale if shrink else max(scale, 1.0))
