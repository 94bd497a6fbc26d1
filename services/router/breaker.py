"""A circuit breaker per model with degradation: while a model fails, answer
from the cache or its fallback model instead of failing callers.

Closed: every request goes to the model; when the share of failures over the
window passes `open_error_rate` (5%, with at least `min_requests` seen), the
breaker opens. Open: requests are degraded (cache, else the fallback model)
for `open_s`. Half-open: a share of the requests tries the model again, the
rest stay degraded; each step whose failure share stays under
`recover_error_rate` (1%) over at least `min_requests` raises the share
(10% -> 25% -> 50% -> 100% = closed); a step over `open_error_rate` opens
the breaker again. Only failures that say the model is unwell count:
UNAVAILABLE, INTERNAL, UNKNOWN, DEADLINE_EXCEEDED. A caller's mistake or a
busy queue (RESOURCE_EXHAUSTED) is not the model failing.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import random

COUNTED_CODES = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED"})
HALF_OPEN_STEPS = (0.10, 0.25, 0.50)


class State(enum.Enum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclasses.dataclass(frozen=True)
class BreakerPolicy:
    open_error_rate: float = 0.05
    recover_error_rate: float = 0.01
    window_s: float = 10.0
    min_requests: int = 20
    open_s: float = 5.0


class Breaker:
    """One model's breaker; time comes from the caller (loop time), so it is testable."""

    def __init__(self, policy: BreakerPolicy, rng: random.Random | None = None):
        self.policy = policy
        self.state = State.CLOSED
        self.step = 0  # index into HALF_OPEN_STEPS while half-open
        self._opened_at = 0.0
        self._outcomes: collections.deque[tuple[float, bool]] = collections.deque()  # (time, failed)
        self._failures = 0  # failed ones among _outcomes, kept as they come and go: record() is per request
        self._rng = rng or random.Random()

    def allows(self, now: float) -> bool:
        """Whether this request goes to the model (else it is degraded)."""
        if self.state is State.OPEN and now - self._opened_at >= self.policy.open_s:
            self._enter(State.HALF_OPEN, now)
        if self.state is State.CLOSED:
            return True
        if self.state is State.OPEN:
            return False
        return self._rng.random() < HALF_OPEN_STEPS[self.step]

    def record(self, now: float, failed: bool) -> State | None:
        """Counts one answer of the model; returns the new state if it changed."""
        self._outcomes.append((now, failed))
        self._failures += failed
        while self._outcomes and now - self._outcomes[0][0] > self.policy.window_s:
            self._failures -= self._outcomes.popleft()[1]
        seen = len(self._outcomes)
        if seen < self.policy.min_requests or self.state is State.OPEN:
            return None
        rate = self._failures / seen
        if rate > self.policy.open_error_rate:
            self._enter(State.OPEN, now)
            return State.OPEN
        if self.state is State.HALF_OPEN and rate < self.policy.recover_error_rate:
            if self.step + 1 < len(HALF_OPEN_STEPS):
                self.step += 1
                self._forget()  # each step is judged on its own answers
                return None
            self._enter(State.CLOSED, now)
            return State.CLOSED
        return None

    def _forget(self) -> None:
        self._outcomes.clear()
        self._failures = 0

    def _enter(self, state: State, now: float) -> None:
        self.state = state
        self.step = 0
        self._forget()
        if state is State.OPEN:
            self._opened_at = now


class FailureSamples:
    """Requests that failed with a counted error, appended to a JSON-lines file
    for later analysis: time, model, status, message and the inputs in short
    (texts cut to 200 characters, other tensors by shape), at most
    `per_minute` lines a minute so a failing model cannot fill the disk."""

    def __init__(self, path: str, per_minute: int = 120):
        import pathlib

        self._path = pathlib.Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._per_minute = per_minute
        self._minute, self._written = -1, 0

    def record(self, model: str, error, request) -> None:
        import json
        import time

        from services.common.tensors import split_bytes_elements

        now = time.time()
        if int(now // 60) != self._minute:
            self._minute, self._written = int(now // 60), 0
        if self._written >= self._per_minute:
            return
        self._written += 1
        inputs = []
        for tensor in request.inputs:
            if tensor.datatype == "BYTES":
                texts = [t.decode("utf-8", "replace")[:200] for t in split_bytes_elements(tensor.data, tensor.name)[:8]]
                inputs.append({"name": tensor.name, "shape": list(tensor.shape), "texts": texts})
            else:
                inputs.append({"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)})
        line = {"time": round(now, 3), "model": model, "status": error.code_name, "message": error.message,
                "tier": request.tier, "inputs": inputs}
        with self._path.open("a") as f:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
