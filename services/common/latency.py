"""How long a batch runs, learned online: the model server decides refusals
with it per size class, the batcher refuses waiting requests with it per tier,
and the batcher's adaptive policy learns a row's cost per size class from its
parts (MovingTime, size_class)."""

from __future__ import annotations

import math
from collections.abc import Mapping

# Decisions that must hold for nearly every batch, not the average one, take the
# mean plus this many mean deviations: on a loaded machine one batch takes
# severalfold another's time, and a batch let run on the mean alone misses a
# tight deadline about every other time.
CAUTIOUS_DEVIATIONS = 2.0


def size_class(rows: int) -> int:
    """A batch size rounded up to a power of two: few classes, each of similar cost."""
    return 1 << max(rows - 1, 0).bit_length()


def nearest_class(known: Mapping[int, object], rows: int) -> int:
    """The size class of `rows` when `known` has it, else the known class nearest
    it on a log scale (a tie goes to the class learned first)."""
    key = size_class(rows)
    return key if key in known else min(known, key=lambda k: abs(math.log2(k / key)))


class MovingTime:
    """A moving mean of seconds and a moving mean deviation from it, as TCP
    estimates a round trip and its variation; None until observed."""

    def __init__(self, alpha: float = 0.2, beta: float = 0.25) -> None:
        self._alpha = alpha
        self._beta = beta
        self.mean: float | None = None
        self.deviation = 0.0

    def observe(self, seconds: float) -> None:
        if self.mean is None:  # no variation seen yet
            self.mean = seconds
            return
        self.deviation = (1 - self._beta) * self.deviation + self._beta * abs(seconds - self.mean)
        self.mean = (1 - self._alpha) * self.mean + self._alpha * seconds

    def estimate(self, deviations: float = 0.0) -> float | None:
        """The mean plus `deviations` mean deviations; None before any observation."""
        return None if self.mean is None else self.mean + deviations * self.deviation


class LatencyProfile:
    """Seconds per batch per size class, each a MovingTime."""

    def __init__(self, alpha: float = 0.2, beta: float = 0.25) -> None:
        self._alpha = alpha
        self._beta = beta
        self._classes: dict[int, MovingTime] = {}

    def observe(self, rows: int, seconds: float) -> None:
        key = size_class(rows)
        if key not in self._classes:
            self._classes[key] = MovingTime(self._alpha, self._beta)
        self._classes[key].observe(seconds)

    def estimate(self, rows: int, shrink: bool = True, deviations: float = 0.0) -> float | None:
        """The learned time of a batch of `rows`, plus `deviations` times its mean
        deviation; from the nearest class, scaled by rows, when its own is still
        unknown (with `shrink` False, never scaled down: a cautious estimate, as
        small batches are not proportionally quicker); None before any batch ran."""
        if not self._classes:
            return None
        nearest = nearest_class(self._classes, rows)
        scale = size_class(rows) / nearest
        learned = self._classes[nearest].estimate(deviations)
        assert learned is not None  # a class is made as it observes its first batch
        return learned * (scale if shrink else max(scale, 1.0))
