"""Automatic cache bypass: a model whose lookups almost never hit stops paying
for them, and while it is bypassed the cache sees none of its traffic, not
even a sample: no lookups, no stores.

Whether the workload has started repeating is judged here, from the requests
themselves: the router remembers the digests of the bypassed model's recent
requests, and a request whose digest it remembers is one the cache would
likely have answered. Once such repeats are twice the hit rate that engaged
the bypass, over a window as long as the one that engaged it, the bypass
lifts and lookups resume.
"""

import collections
import dataclasses

from services.router import metrics


@dataclasses.dataclass
class _ModelWindow:
    outcomes: collections.deque[bool]  # hit or not, of the last `window` lookups (or, bypassed, of requests)
    hits: int = 0  # in outcomes
    bypassed: bool = False
    # While bypassed: the digests of the latest requests, oldest first, to tell a repeat.
    seen: dict[bytes, None] = dataclasses.field(default_factory=dict)


class AdaptiveBypass:
    def __init__(self, window: int = 500, min_hit_rate: float = 0.01, memory: int = 10_000):
        self._window = window
        self._min_hit_rate = min_hit_rate
        self._memory = memory  # digests remembered per bypassed model
        self._models: dict[str, _ModelWindow] = {}

    def _state(self, model: str) -> _ModelWindow:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = _ModelWindow(collections.deque(maxlen=self._window))
            metrics.CACHE_BYPASS.labels(model).set(0)
        return state

    def should_use_cache(self, model: str) -> bool:
        """True when this request should look up (and store): unless the model is bypassed."""
        state = self._models.get(model)
        return state is None or not state.bypassed

    def record(self, model: str, hit: bool) -> None:
        """The outcome of a lookup; a full window under the minimum hit rate engages the bypass."""
        state = self._state(model)
        if state.bypassed:
            return
        if self._push(state, hit) and state.hits < self._min_hit_rate * len(state.outcomes):
            self._switch(model, state, bypassed=True)

    def observe(self, model: str, digest: bytes) -> None:
        """A request of a bypassed model, which the cache did not see: whether
        it repeats a recent one judges whether the bypass lifts."""
        state = self._state(model)
        if not state.bypassed:
            return
        seen = state.seen
        repeat = digest in seen
        if repeat:
            del seen[digest]  # to the newest end: a popular input stays remembered
        elif len(seen) >= self._memory:
            del seen[next(iter(seen))]
        seen[digest] = None
        if self._push(state, repeat) and state.hits >= 2 * self._min_hit_rate * len(state.outcomes):
            self._switch(model, state, bypassed=False)

    def _push(self, state: _ModelWindow, hit: bool) -> bool:
        """Adds an outcome; whether the window is full."""
        outcomes = state.outcomes
        if len(outcomes) == outcomes.maxlen:
            state.hits -= outcomes[0]
        outcomes.append(hit)
        state.hits += hit
        return len(outcomes) == outcomes.maxlen

    def _switch(self, model: str, state: _ModelWindow, bypassed: bool) -> None:
        state.bypassed = bypassed
        state.outcomes.clear()
        state.hits = 0
        state.seen = {}
        metrics.CACHE_BYPASS.labels(model).set(1 if bypassed else 0)

    def is_bypassed(self, model: str) -> bool:
        state = self._models.get(model)
        return state is not None and state.bypassed
