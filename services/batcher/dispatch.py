"""Dispatch: sends one model version's batches to the backend and answers their requests.

One execution serves every request of a batch; one bad request never fails
its neighbours (a batch that fails for a reason of its own is run again one
request at a time); every request is always answered, whatever happens."""

import asyncio
import logging
import time

from services.batcher import metrics
from services.batcher.admission import Admission
from services.batcher.pending import Pending, fail_all
from services.batcher.policy import Policy
from services.batcher.slots import SlotPool
from services.common import errors, tracing
from services.common.tensors import concat_rows, split_rows

log = logging.getLogger(__name__)


class Dispatch:
    """The sending half of one model version's queue."""

    def __init__(
        self,
        model: str,
        version: str,
        backend,
        slots: SlotPool,
        admission: Admission,
        batch_policy: Policy,
        default_timeout_s: float,
    ):
        self.model = model
        self.version = version
        self._backend = backend  # core.Backend
        self._slots = slots
        self._admission = admission
        self._batch_policy = batch_policy
        self._default_timeout_s = default_timeout_s

    async def execute(self, batch: list[Pending], slot: str, forming_since: float | None = None) -> None:
        """Runs a batch that holds `slot` (released after); answers every request of it, whatever happens.
        `forming_since`: when the batching task began to gather it (loop time), for its trace."""
        try:
            live = [item for item in batch if self._admission.sendable(item)]
            if live:
                await self.run(live, forming_since=forming_since)
        except Exception as exc:  # resolved below, never lost
            log.exception("batch of model %s failed unexpectedly", self.model)
            fail_all(batch, errors.Internal(f"batch of model '{self.model}' failed: {type(exc).__name__}"))
        except asyncio.CancelledError:  # close(): the batcher is shutting down
            fail_all(batch, errors.Unavailable(f"batcher is shutting down; model '{self.model}' batch not finished"))
            raise
        finally:
            self._slots.release(slot)
            fail_all(batch, errors.Internal("request was not answered"))

    async def run(self, batch: list[Pending], rerun: bool = False, forming_since: float | None = None) -> None:
        """Sends one batch and answers its requests. A `rerun` is one request of
        a failed batch run alone: its queue wait was observed with the batch,
        and it is not split again."""
        if rerun and batch[0].future.done():  # answered (its caller gone) before its turn: its tensors are dropped
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        # A batch runs by its latest request's deadline: by its earliest, a VIP request with time to
        # spare would be refused with the tight standard ones an aged standard batch may lead.
        deadlines = [item.deadline for item in batch if item.deadline is not None]
        timeout_s = max(deadlines) - now if len(deadlines) == len(batch) else self._default_timeout_s
        names = [t.name for t in batch[0].inputs]  # submit() checked that every request has exactly these
        inputs = [concat_rows([next(t for t in item.inputs if t.name == name) for item in batch]) for name in names]
        counts = [item.rows for item in batch]
        # One execution serves every request: ask for the union of what they want ([] means all).
        wanted = [] if any(not item.outputs for item in batch) else sorted({o for item in batch for o in item.outputs})
        metrics.BATCH_ROWS.labels(self.model).observe(sum(counts))
        for item in () if rerun else batch:
            metrics.QUEUE_WAIT.labels(self.model, item.tier.label).observe(now - item.enqueued)
        tier = max(item.tier for item in batch)  # the batch's tier: the model server runs VIP batches first
        expected_s = self._admission.sent(tier, sum(counts), now)
        span = self._trace_batch(batch, now, tier, rerun, forming_since) if tracing.is_on() else None
        token = tracing.activate(span)
        completed, split, code = None, False, "INTERNAL"
        try:
            version, outputs = await self._backend.execute(
                self.model, self.version, inputs, wanted, max(timeout_s, 0.001), tier=tier
            )
            code = "OK"
            self._admission.ran(tier, loop.time() - now)
            self._batch_policy.observe_batch(sum(counts), loop.time() - now)
            completed = sum(counts)
        except errors.InfermeshError as exc:
            code = exc.code_name
            if not rerun and len(batch) > 1 and not exc.retryable and not _no_time_or_room(exc):
                # One bad request must not fail its neighbours: run each alone (below, once
                # this batch is off the books). Not when the model server is out of time or
                # room: one RPC per request would only add load.
                log.warning(
                    "batch of %d for model %s failed (%s); retrying one by one", len(batch), self.model, exc.message
                )
                split = True
            else:
                if isinstance(exc, errors.DeadlineExceeded):
                    self._admission.ran_out_of_time(batch, tier, now, timeout_s, expected_s)
                fail_all(batch, exc)
                return
        finally:
            self._admission.ended(tier, sum(counts), completed, loop.time())
            tracing.finish(span, token, code)
        if split:
            # Each request that can still be answered: its caller has not gone, its deadline has not passed.
            alone = [item for item in batch if self._admission.sendable(item)]
            await asyncio.gather(*(self.run([item], rerun=True) for item in alone))
            return
        parts = {out.name: split_rows(out, counts) for out in outputs}
        for i, item in enumerate(batch):
            if not item.future.done():
                names = item.outputs or list(parts)
                item.future.set_result((version, [parts[name][i] for name in names]))

    def _trace_batch(
        self, batch: list[Pending], now: float, tier, rerun: bool, forming_since: float | None
    ) -> object | None:
        """The batch's span, when any of its requests is traced: the child of the
        first such request's span, linked to each of theirs (one run serves them
        all), after their queue waits and the batch's forming are recorded."""
        traced = [item.trace for item in batch if item.trace is not None]
        if not traced:
            return None
        now_ns = time.time_ns()
        if not rerun:
            for item in batch:
                if item.trace is not None:
                    tracing.record(
                        item.trace,
                        "batcher.queue_wait",
                        tracing.wall_ns(item.enqueued, now, now_ns),
                        now_ns,
                        {"tier": item.tier.label},
                    )
        span = tracing.start_child(
            traced[0],
            "batcher.batch",
            {
                "model": self.model,
                "version": self.version,
                "tier": tier.label,
                "batch.requests": len(batch),
                "batch.rows": sum(item.rows for item in batch),
                "batch.rerun": rerun,
            },
            links=traced,
        )
        if forming_since is not None and not rerun:
            tracing.record(span, "batcher.form", tracing.wall_ns(forming_since, now, now_ns), now_ns)
        return span


def _no_time_or_room(exc: errors.InfermeshError) -> bool:
    """Out of time, or refused by a busy model server (its refusals carry a retry
    hint; gRPC's own RESOURCE_EXHAUSTED, e.g. an oversized message, does not, and
    splitting the batch is what isolates the request that caused it)."""
    return isinstance(exc, errors.DeadlineExceeded) or (
        isinstance(exc, errors.ResourceExhausted) and exc.retry_after_ms > 0
    )
