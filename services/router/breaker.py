"""A circuit breaker per model with degradation: while a model fails, answer
from the cache or its fallback model instead of failing callers.

Closed: every request goes to the model; when the share of failures over the
window passes `open_error_rate` (5%, with at least `min_requests` seen), the
breaker opens. Open: requests are degraded (cache, else the fallback model)
for `open_s`. Half-open: a share of the requests tries the model again, the
rest stay degraded; each step whose failure share stays under
`recover_error_rate` (1%) over at least `min_requests` raises the share
(10% -> 25% -> 50% -> 100% = closed); a step over `open_error_rate` opens
the breaker again. Only the model's own failures count (`counts`), and
only answers of the model are recorded at all: a caller's mistake, its own
short deadline, its going away, a busy queue or the router's shedding say
nothing of the model, either way.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import json
import os
import pathlib
import random
import time
from typing import TYPE_CHECKING

from services.common import errors
from services.common.tensors import TensorData, split_bytes_elements

if TYPE_CHECKING:  # the core imports this module
    from services.router.core import InferRequest

COUNTED_CODES = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED"})
HALF_OPEN_STEPS = (0.10, 0.25, 0.50)
SAMPLE_CONTENTS = ("off", "redacted", "full")


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
    # A DEADLINE_EXCEEDED of a request whose own timeout was shorter than this
    # is the caller's deadline, not the model's failure: a model that is really
    # hung times out requests with ample budgets too, so nothing is missed, and a
    # caller sending tiny deadlines cannot open the breaker for everyone.
    min_counted_timeout_s: float = 1.0

    def counts(self, code_name: str, timeout_s: float) -> bool:
        """Whether a failure with this status, of a request that had `timeout_s`
        in all, is the model's own."""
        if code_name == "DEADLINE_EXCEEDED":
            return timeout_s >= self.min_counted_timeout_s
        return code_name in COUNTED_CODES


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
    for later analysis, at most `per_minute` lines a minute and `max_bytes` a
    file: past it the file becomes `<path>.1` (one rotated file is kept), so
    the two never pass twice the bound. What a line holds of the inputs is
    `content`: "redacted" (shapes, and of each text a short hash keyed by a
    secret of this process, so repeats of one text show without the text),
    "full" (texts cut to 200 characters) or "off" (no file at all)."""

    TEXTS_PER_TENSOR = 8
    TEXT_CHARS = 200

    def __init__(self, path: str, per_minute: int = 120, content: str = "redacted", max_bytes: int = 8 << 20):
        if content not in SAMPLE_CONTENTS:
            raise ValueError(f"failure samples content must be one of {SAMPLE_CONTENTS}, got {content!r}")
        self._path = pathlib.Path(path)
        self._rotated = self._path.with_name(self._path.name + ".1")
        self._content = content
        self._max_bytes = max_bytes
        if content != "off":
            self._path.parent.mkdir(parents=True, exist_ok=True)
        self._size = self._path.stat().st_size if self._path.is_file() else 0
        self._key = os.urandom(16)
        self._per_minute = per_minute
        self._minute, self._written = -1, 0

    def record(self, model: str, error: errors.InfermeshError, request: InferRequest) -> None:
        if self._content == "off":
            return
        now = time.time()
        if int(now // 60) != self._minute:
            self._minute, self._written = int(now // 60), 0
        if self._written >= self._per_minute:
            return
        self._written += 1
        inputs = [self._describe(tensor) for tensor in request.inputs]
        line = {
            "time": round(now, 3),
            "model": model,
            "status": error.code_name,
            "message": errors.clipped(error.message),
            "tier": request.tier,
            "inputs": inputs,
        }
        data = (json.dumps(line, ensure_ascii=False) + "\n").encode()
        if self._size and self._size + len(data) > self._max_bytes:
            os.replace(self._path, self._rotated)
            self._size = 0
        with self._path.open("ab") as f:
            f.write(data)
        self._size += len(data)

    def _describe(self, tensor: TensorData) -> dict[str, object]:
        described: dict[str, object] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if tensor.datatype == "BYTES":
            texts = split_bytes_elements(tensor.data, tensor.name)[: self.TEXTS_PER_TENSOR]
            if self._content == "full":
                described["texts"] = [t.decode("utf-8", "replace")[: self.TEXT_CHARS] for t in texts]
            else:
                described["text_hashes"] = [hashlib.blake2b(t, digest_size=8, key=self._key).hexdigest() for t in texts]
        return described
