"""How long a batch runs, learned online per size class: the batcher's
adaptive policy plans with it, the model server decides refusals with it."""

from __future__ import annotations

import math


def size_class(rows: int) -> int:
    """A batch size rounded up to a power of two: few classes, each of similar cost."""
    return 1 << max(rows - 1, 0).bit_length()


class LatencyProfile:
    """Seconds per batch per size class: a moving average, and a moving mean
    deviation from it (as TCP estimates a round trip and its variation), for
    decisions that must hold for nearly every batch, not the average one."""

    def __init__(self, alpha: float = 0.2, beta: float = 0.25):
        self._alpha = alpha
        self._beta = beta
        self._seconds: dict[int, float] = {}
        self._deviation: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        key = size_class(rows)
        old = self._seconds.get(key)
        if old is None:  # no variation seen yet
            self._seconds[key], self._deviation[key] = seconds, 0.0
            return
        self._deviation[key] = (1 - self._beta) * self._deviation[key] + self._beta * abs(seconds - old)
        self._seconds[key] = (1 - self._alpha) * old + self._alpha * seconds

    def estimate(self, rows: int, shrink: bool = True, deviations: float = 0.0) -> float | None:
        """The learned time of a batch of `rows`, plus `deviations` times its mean
        deviation; from the nearest class, scaled by rows, when its own is still
        unknown (with `shrink` False, never scaled down: a cautious estimate, as
        small batches are not proportionally quicker); None before any batch ran."""
        if not self._seconds:
            return None
        key = size_class(rows)
        nearest = key if key in self._seconds else min(self._seconds, key=lambda k: abs(math.log2(k) - math.log2(key)))
        scale = key / nearest
        return (self._seconds[nearest] + deviations * self._deviation[nearest]) * (scale if shrink else max(scale, 1.0))
