"""Automatic cache bypass: a model whose lookups almost never hit stops paying
for them. While bypassed, a small sample of its requests still looks up and
stores, so the bypass lifts by itself when the workload starts repeating;
the probes are judged over a window a tenth as long, so that lifting takes
about as many requests as engaging did."""

import collections
import dataclasses

from services.router import metrics


@dataclasses.dataclass
class _ModelWindow:
    outcomes: collections.deque
    bypassed: bool = False
    counter: int = 0


class AdaptiveBypass:
    def __init__(self, window: int = 500, min_hit_rate: float = 0.01, probe_every: int = 20):
        self._window = window
        self._min_hit_rate = min_hit_rate
        self._probe_every = probe_every
        self._models: dict[str, _ModelWindow] = {}

    def _state(self, model: str) -> _ModelWindow:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = _ModelWindow(collections.deque(maxlen=self._window))
        return state

    def should_use_cache(self, model: str) -> bool:
        """True when this request should look up (and store): always unless the
        model is bypassed, then one request in `probe_every`."""
        state = self._state(model)
        if not state.bypassed:
            return True
        state.counter += 1
        return state.counter % self._probe_every == 0

    def record(self, model: str, hit: bool) -> None:
        state = self._state(model)
        state.outcomes.append(hit)
        if len(state.outcomes) < state.outcomes.maxlen:
            return
        rate = sum(state.outcomes) / len(state.outcomes)
        if not state.bypassed and rate < self._min_hit_rate:
            state.bypassed = True
            state.outcomes = collections.deque(maxlen=max(10, self._window // 10))
        elif state.bypassed and rate >= 2 * self._min_hit_rate:
            state.bypassed = False
            state.outcomes = collections.deque(maxlen=self._window)
        metrics.CACHE_BYPASS.labels(model).set(1 if state.bypassed else 0)

    def is_bypassed(self, model: str) -> bool:
        return self._state(model).bypassed
