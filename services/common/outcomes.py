"""Outcome lines: one JSON line per request outcome worth keeping, bounded per reason.

Kept: every refusal and error (by its gRPC status), every request slower than
`slow_s`, and a sample of the rest. Each reason (a status name, "slow",
"sampled": a fixed, small set) may write at most `lines_per_s` lines a second;
the next line of a reason says how many of its lines were left out meanwhile.
A line carries the request's trace id, so that a slow request's trace is one
search away in Jaeger, and its per-step durations (tracing.TIMINGS).
"""

import dataclasses
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from services.common.config import require

LOGGER = "infermesh.outcome"
MAX_FIELD_CHARS = 128  # caller-sent values (a model's name, a request id) are cut to this
MAX_MESSAGE_CHARS = 512


@dataclasses.dataclass(frozen=True)
class OutcomeSettings:
    slow_s: float = 1.0  # a success slower than this is logged
    success_ratio: float = 0.001  # the share of other successes that is logged
    lines_per_s: float = 20.0  # per reason

    def __post_init__(self) -> None:
        require(self.slow_s > 0, f"slow request threshold must be > 0 s, got {self.slow_s}")
        require(0.0 <= self.success_ratio <= 1.0, f"success ratio must be within 0..1, got {self.success_ratio}")
        require(self.lines_per_s >= 0, f"outcome lines per second must be >= 0, got {self.lines_per_s}")


class _Allowance:
    """A token bucket of `rate` lines a second (a second's worth banked), and what it refused since its last line."""

    __slots__ = ("at", "rate", "suppressed", "tokens")

    def __init__(self, rate: float):
        self.rate, self.tokens, self.at, self.suppressed = rate, rate, time.monotonic(), 0

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        self.suppressed += 1
        return False


class OutcomeLog:
    """Writes the outcome lines of one service (see the module's docstring)."""

    def __init__(self, service: str, settings: OutcomeSettings, stream: TextIO | None = None):
        self.service = service
        self.settings = settings
        self._allowances: dict[str, _Allowance] = {}
        self._log = logging.getLogger(LOGGER)
        if stream is not None or not self._log.handlers:
            # Bare lines, apart from the service's own log format: each is one JSON document.
            handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            self._log.handlers = [handler]
            self._log.propagate = False
            self._log.setLevel(logging.INFO)

    def reason(self, status: str, elapsed_s: float) -> str | None:
        """Why an outcome is kept ("slow", "sampled", or its status), or None."""
        if status != "OK":
            return status
        if elapsed_s >= self.settings.slow_s:
            return "slow"
        ratio = self.settings.success_ratio
        return "sampled" if ratio and random.random() < ratio else None

    def observe(self, status: str, elapsed_s: float, fields: Callable[[], dict[str, Any]]) -> bool:
        """Writes the outcome's line if it is kept and its reason's allowance has room;
        `fields` is called only then. True when a line was written."""
        reason = self.reason(status, elapsed_s)
        if reason is None:
            return False
        allowance = self._allowances.get(reason)
        if allowance is None:  # reasons are status names and two words: a small, fixed set
            allowance = self._allowances[reason] = _Allowance(self.settings.lines_per_s)
        if not allowance.take():
            return False
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}Z",
            "service": self.service,
            "reason": reason,
            "status": status,
            "latency_ms": round(elapsed_s * 1000, 3),
            **fields(),
        }
        if allowance.suppressed:
            line["suppressed_before"] = allowance.suppressed  # lines of this reason left out since the last
            allowance.suppressed = 0
        self._log.info(json.dumps(line, separators=(",", ":"), default=str))
        return True


def clipped(value: str, limit: int = MAX_FIELD_CHARS) -> str:
    return value if len(value) <= limit else value[:limit] + "..."


def steps_ms(timings: dict[str, float] | None) -> dict[str, float]:
    return {name: round(seconds * 1000, 3) for name, seconds in (timings or {}).items()}
