"""A request waiting in a batcher queue, and what the batcher knows of a model."""

import asyncio
import dataclasses
from typing import Any

from services.common import errors
from services.common.tensors import TensorData
from services.common.tier import Tier


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """What the batcher must know of a model to batch it."""

    max_batch_size: int
    inputs: tuple[str, ...]
    # The versions some ready replica holds; empty: the backend does not say, any may be asked for.
    versions: frozenset[str] = frozenset()


@dataclasses.dataclass(eq=False)
class Pending:
    """One request waiting in a queue."""

    inputs: list[TensorData]
    outputs: list[str]
    tier: Tier
    deadline: float | None  # loop time
    future: asyncio.Future[tuple[str, list[TensorData]]]  # (the version that ran, the outputs)
    enqueued: float
    timer: asyncio.TimerHandle | None = None
    length: float = 0.0  # bytes per row of its BYTES inputs: a cheap proxy for token count
    queued: bool = False  # holds a place in its level: counted in the queue's length and rows
    tenant: str = ""  # whose request (the router's verified tenant): tenants share a level by weight
    weight: float = 1.0
    tag: float = 0.0  # its start tag in its level's fair queueing (FairLevel)
    seq: int = 0  # its arrival there
    # (name, dimensions past the batch one) per input: only requests alike share a batch
    shape: tuple[tuple[str, tuple[int, ...]], ...] = ()
    trace: Any = None  # its span in this service (tracing) when its trace is sampled
    rows: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.rows = self.inputs[0].rows

    def answered(self, _future: object = None) -> None:
        """Drops the request's tensors: answered while it waits (expired, refused,
        cancelled), it may stay in its level's deque until the batching task
        passes it, and must not hold its bytes there meanwhile."""
        self.inputs = []

    def taken(self) -> None:
        """From here on the batch's own timeout governs, not the queue's deadline timer."""
        if self.timer is not None:
            self.timer.cancel()


def fail_all(items: list[Pending], error: errors.InfermeshError) -> None:
    """Answers each of `items` not answered yet with `error`."""
    for item in items:
        if not item.future.done():
            item.future.set_exception(error)
