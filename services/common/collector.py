"""Python's cyclic garbage collector, kept out of the way of tail latency.

A collection of the oldest generation walks every object the collector tracks,
and the whole process waits meanwhile: every call in flight, at once. In the
router under bench.batching's overload such collections took 20-50 ms each
(17 in five runs), since the heap held everything imported and built at
startup. That part lives as long as the process, so once a service is built
it is moved out of the collector's sight (gc.freeze); later collections walk
only what serving allocates (2-7 ms each in the same runs).

Every pause is measured, by generation: a stall that holds all calls at once
hardly moves a service's p99, but each one delays every caller of the moment."""

import gc
import time

import prometheus_client

PAUSES = prometheus_client.Histogram(
    "infermesh_gc_pause_seconds",
    "Time the cyclic garbage collector held the process, by generation (2: a full collection).",
    ["generation"],
    buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
)
FROZEN = prometheus_client.Gauge(
    "infermesh_gc_frozen_objects",
    "Objects built at startup that the collector no longer walks (gc.freeze once the service is built).",
)
_BY_GENERATION = [PAUSES.labels(str(generation)) for generation in range(3)]
_started: list[float] = []  # the start of the collection under way; one at a time (the GIL)


def _observe(phase: str, info: dict) -> None:
    if phase == "start":
        _started[:] = [time.perf_counter()]
    elif _started:
        _BY_GENERATION[info["generation"]].observe(time.perf_counter() - _started.pop())


def measure_pauses() -> None:
    """Times every collection from now on (infermesh_gc_pause_seconds)."""
    if _observe not in gc.callbacks:
        gc.callbacks.append(_observe)


def freeze_startup_heap() -> int:
    """Collects once, then moves every surviving object to the collector's
    permanent generation: call it once the service is built, before it
    serves. Returns how many objects that was."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    FROZEN.set(frozen)
    return frozen
