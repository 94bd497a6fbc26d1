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

from services.common.bucket import TokenBucket
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


class OutcomeLog:
    """Writes the outcome lines of one service (see the module's docstring)."""

    def __init__(self, service: str, settings: OutcomeSettings, stream: TextIO | None = None):
        self.service = service
        self.settings = settings
        # Per reason: its allowance, and how many of its lines it refused since its last one.
        self._allowances: dict[str, TokenBucket] = {}
        self._suppressed: dict[str, int] = {}
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
            rate = self.settings.lines_per_s
            allowance = self._allowances[reason] = TokenBucket(rate, rate)
        if not allowance.take():
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            return False
        now = time.time()
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z",
            "service": self.service,
            "reason": reason,
            "status": status,
            "latency_ms": round(elapsed_s * 1000, 3),
            **fields(),
        }
        suppressed = self._suppressed.pop(reason, 0)
        if suppressed:
            line["suppressed_before"] = suppressed  # lines of this reason left out since the last
        self._log.info(json.dumps(line, separators=(",", ":"), default=str))
        return True


def clipped(value: str, limit: int = MAX_FIELD_CHARS) -> str:
    return value if len(value) <= limit else value[:limit] + "..."


def steps_ms(timings: dict[str, float] | None) -> dict[str, float]:
    return {name: round(seconds * 1000, 3) for name, seconds in (timings or {}).items()}
