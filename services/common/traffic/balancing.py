"""Balancing as Envoy does it: one weighted pick of a destination per call,
and the panic mode in which a subset's calls go to every host, ejected or not."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol, TypeVar

OVERPROVISIONING_PERCENT = 140  # Envoy's default overprovisioning factor, which Istio leaves as it is


class Weighted(Protocol):
    @property
    def weight(self) -> int: ...


W = TypeVar("W", bound=Weighted)


def pick(destinations: Sequence[W], rng: random.Random) -> W:
    """One weighted pick; weights are relative, a weight of 0 is never picked."""
    total = sum(d.weight for d in destinations)
    point = rng.uniform(0, total)
    for destination in destinations:
        point -= destination.weight
        if point < 0 and destination.weight > 0:
            return destination
    return next(d for d in reversed(destinations) if d.weight > 0)


def in_panic(hosts: int, healthy: int, min_health_percent: float) -> bool:
    """Envoy panics when the healthy share is below minHealthPercent and the
    subset's availability (that share x the overprovisioning factor of 1.4,
    capped at 100%) is below 100%."""
    availability = min(100, OVERPROVISIONING_PERCENT * healthy // hosts)
    return availability < 100 and 100.0 * healthy / hosts < min_health_percent
