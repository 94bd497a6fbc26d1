"""Byte budgets and connection limits every service shares: the bytes of the
requests a process holds at once are bounded, from its memory limit, besides
their number; idle connections and streams age out.

A request's bytes are counted when it is accepted and released when it is
answered (success, error, cancellation, deadline alike). One that would take
the held bytes past the budget is refused with RESOURCE_EXHAUSTED, with a
retry hint, before it is parsed further or copied on to the next hop.
"""

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any, ClassVar

from services.common import errors, metrics
from services.common.config import require

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
# A held request costs its process several times its bytes at once: the
# message gRPC received, its parsed copy, the domain tensors, the message to
# the next hop and gRPC's send buffer, not all alive together. The derived
# budget leaves room for this many copies of every held byte.
HELD_COPIES = 4
RETRY_MIN_MS, RETRY_MAX_MS, RETRY_UNKNOWN_MS = 10, 2000, 100
RELEASE_WINDOW_S = 5.0  # the releases that estimate how fast held bytes free up


class ByteBudget:
    """The bytes of the requests `service` holds, at most `limit_bytes` at once.

    `acquire` either counts a request's bytes or raises ResourceExhausted
    naming the service, the budget and the request's size, with a retry hint:
    about how long the releases of the last few seconds take to free what is
    lacking. Every acquire must be matched by one release (`hold` does it)."""

    def __init__(self, service: str, limit_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.limit_bytes = limit_bytes
        self.held_bytes = 0
        self.held_requests = 0
        self._clock = clock
        self._released: collections.deque[tuple[float, int]] = collections.deque(maxlen=256)
        # Read when scraped: nothing per request.
        metrics.HELD_REQUEST_BYTES.labels(service).set_function(lambda: self.held_bytes)
        metrics.BUDGET_BYTES.labels(service).set(limit_bytes)
        self._refusals = metrics.BUDGET_REFUSALS.labels(service)

    def acquire(self, size: int, what: str = "request") -> None:
        if self.held_bytes + size > self.limit_bytes:
            self._refusals.inc()
            retry_ms = self._retry_ms(self.held_bytes + size - self.limit_bytes)
            if size > self.limit_bytes:
                raise errors.ResourceExhausted(
                    f"{what} of {size} bytes exceeds the {self.service}'s byte budget of {self.limit_bytes} bytes "
                    "on its own; send it in smaller parts"
                )
            raise errors.ResourceExhausted(
                f"{what} of {size} bytes would take the {self.service} past its byte budget of {self.limit_bytes} "
                f"bytes ({self.held_bytes} held by {self.held_requests} request(s)); retry after about {retry_ms} ms",
                retry_after_ms=retry_ms,
            )
        self.held_bytes += size
        self.held_requests += 1

    def release(self, size: int) -> None:
        self.held_bytes -= size
        self.held_requests -= 1
        self._released.append((self._clock(), size))

    def release_when_done(self, future: "asyncio.Future[Any]", size: int) -> None:
        """Releases `size` once `future` (a task, say) is done, however it ends."""
        future.add_done_callback(lambda _: self.release(size))

    def hold(self, size: int, what: str = "request") -> "_Held":
        """A context manager that holds `size` bytes for its block (acquired on entry)."""
        self.acquire(size, what)
        return _Held(self, size)

    def _retry_ms(self, lacking: int) -> int:
        now = self._clock()
        while self._released and now - self._released[0][0] > RELEASE_WINDOW_S:
            self._released.popleft()
        if len(self._released) < 2:
            return RETRY_UNKNOWN_MS
        span = max(now - self._released[0][0], 1e-3)
        rate = sum(size for _, size in self._released) / span  # bytes freed per second lately
        return int(min(max(1000 * lacking / rate, RETRY_MIN_MS), RETRY_MAX_MS))


class _Held:
    __slots__ = ("_budget", "_size")

    def __init__(self, budget: ByteBudget, size: int) -> None:
        self._budget, self._size = budget, size

    def __enter__(self) -> "_Held":
        return self

    def __exit__(self, *exc: object) -> None:
        self._budget.release(self._size)


@dataclasses.dataclass(frozen=True)
class ServingLimits:
    """The fields of every service's config that bound what it holds and how
    long connections and streams live. A service's config extends it, with its
    own `baseline_bytes` (what the process takes serving nothing) and its own
    default memory limit, the one its pod states."""

    baseline_bytes: ClassVar[int] = 256 * MIB

    memory_limit_bytes: int = dataclasses.field(
        default=1 * GIB,
        metadata={
            "help": "the memory this process may use (its pod's limit); sizes request_budget_bytes when that is 0"
        },
    )
    request_budget_bytes: int = dataclasses.field(
        default=0,
        metadata={
            "help": "bytes of the requests held at once, counted when one is accepted and released when it is "
            f"answered; more is refused with RESOURCE_EXHAUSTED; 0: (memory_limit_bytes - the service's "
            f"baseline) / {HELD_COPIES}"
        },
    )
    max_control_request_bytes: int = dataclasses.field(
        default=64 * KIB,
        metadata={
            "help": "largest request of a control RPC (health, metadata, model control, listings); larger gets "
            "RESOURCE_EXHAUSTED"
        },
    )
    max_connection_idle_s: float = dataclasses.field(
        default=300.0, metadata={"help": "a connection with no call for this long is closed (GOAWAY); 0 keeps it"}
    )
    max_connection_age_s: float = dataclasses.field(
        default=1800.0,
        metadata={
            "help": "a connection this old takes no new calls (GOAWAY) and its calls get max_connection_age_grace_s "
            "to finish; 0: no age"
        },
    )
    max_connection_age_grace_s: float = dataclasses.field(
        default=60.0, metadata={"help": "how long the calls of an aged connection may go on before it is closed"}
    )
    max_concurrent_streams: int = dataclasses.field(
        default=1024,
        metadata={
            "help": "calls (HTTP/2 streams) open at once on one connection, so that one caller's idle streams "
            "cannot take every call the server admits"
        },
    )

    def __post_init__(self) -> None:
        baseline = self.baseline_bytes
        require(
            self.memory_limit_bytes > baseline,
            f"memory_limit_bytes must exceed the {type(self).__name__} baseline of {baseline} bytes, "
            f"got {self.memory_limit_bytes}",
        )
        require(self.request_budget_bytes >= 0, f"request_budget_bytes must be >= 0, got {self.request_budget_bytes}")
        require(
            self.memory_needed_bytes <= self.memory_limit_bytes,
            f"request_budget_bytes {self.budget_bytes} needs {self.memory_needed_bytes} bytes (baseline "
            f"{baseline} + {HELD_COPIES} x the budget), more than memory_limit_bytes {self.memory_limit_bytes}",
        )
        require(
            self.max_control_request_bytes >= 1024,
            f"max_control_request_bytes must be >= 1024, got {self.max_control_request_bytes}",
        )
        for name in ("max_connection_idle_s", "max_connection_age_s", "max_connection_age_grace_s"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        require(
            self.max_concurrent_streams >= 1, f"max_concurrent_streams must be >= 1, got {self.max_concurrent_streams}"
        )

    @property
    def budget_bytes(self) -> int:
        """The byte budget in force: the one given, or the one the memory limit allows."""
        return self.request_budget_bytes or (self.memory_limit_bytes - self.baseline_bytes) // HELD_COPIES

    @property
    def memory_needed_bytes(self) -> int:
        """What the process may take with its budget full: the baseline and every held byte's copies."""
        return self.baseline_bytes + HELD_COPIES * self.budget_bytes

    def check_largest(self, name: str, largest_bytes: int) -> None:
        """A request as large as `name` allows must fit in the budget, or it could never be served."""
        require(
            self.budget_bytes >= largest_bytes,
            f"the byte budget ({self.budget_bytes} bytes) must hold one request of {name} "
            f"({largest_bytes} bytes); raise request_budget_bytes or memory_limit_bytes",
        )
