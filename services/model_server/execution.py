"""Running batches: ONNX Runtime sessions for one model version, their
executors, the VIP-first gate in front of them, warm-up and verification.

ONNX Runtime releases the GIL while it runs, so each session instance runs in
its own single-thread executor: the event loop stays free, and batches for
one session do not fight over the cores its intra-op pool already uses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import heapq
import io
import itertools
import json
import logging
import os
import pathlib
import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort

from services.common import errors, tracing
from services.common.latency import CAUTIOUS_DEVIATIONS, LatencyProfile
from services.common.tensors import NUMPY_DTYPES, TensorData, concat_rows, from_numpy, split_rows, to_numpy
from services.common.tier import Tier
from services.model_server import metrics
from services.model_server.repository import (
    MAX_TOKENIZER_BYTES,
    ConfigError,
    Golden,
    ModelConfig,
    read_bounded,
    version_fingerprint,
)
from services.model_server.shards import ShardedSession, ShardError, ShardFailed

log = logging.getLogger(__name__)

TEXT_FEEDS = ("input_ids", "attention_mask", "token_type_ids")
HIGHER_TIER_MEMORY_S = 10.0  # how long one batch of a tier makes lower ones run in slices
MAX_TIERS_SEEN = 16  # tiers remembered (callers send them); past it the longest unseen is forgotten
OPTIMIZATION = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


class LoadFailed(Exception):
    """A version that cannot take traffic; `reason` is one of file, session,
    warmup, verification, error (unexpected; the metric's label) and the
    message says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def has_nvidia_gpu() -> bool:
    return pathlib.Path("/proc/driver/nvidia/version").exists()


def cuda_usable(device: str) -> bool:
    """Whether sessions may use CUDA: asked for, or a GPU is present, and ORT offers it."""
    available = ort.get_available_providers()
    wants_cuda = device == "cuda" or (device == "auto" and has_nvidia_gpu())
    if device == "cuda" and "CUDAExecutionProvider" not in available:
        raise RuntimeError(f"device=cuda but ONNX Runtime offers only {available}")
    usable = wants_cuda and "CUDAExecutionProvider" in available
    if usable:
        load_cuda_libraries()
    return usable


@functools.cache
def load_cuda_libraries() -> None:
    """Loads the CUDA and cuDNN libraries that ONNX Runtime's CUDA provider
    links against from the nvidia-* wheels (onnxruntime-gpu[cuda,cudnn],
    nvidia-cublas) before any session asks for it. Those wheels put them in
    site-packages, where the dynamic loader would never look; without this the
    CUDA provider fails to load and every session quietly runs on the CPU."""
    said = io.StringIO()
    with contextlib.redirect_stdout(said):  # ORT reports what it could not load with print()
        ort.preload_dlls()
    if said.getvalue().strip():
        log.warning("loading the CUDA libraries: %s", " ".join(said.getvalue().split()))


class NoTurn(Exception):
    """No session instance came free within the time a batch could wait."""


@dataclasses.dataclass
class Running:
    """What runs on an instance: a whole batch, or one slice of a batch."""

    started: float  # loop time
    rows: int  # in this run
    left: int  # the batch's rows still to run, these included
    tier: int

    def rows_ahead_of(self, tier: int) -> int:
        """The rows a batch of `tier` arriving now would wait for: a batch of a
        higher tier waits for this slice only (the batch steps aside after it)."""
        return self.rows if tier > self.tier else self.left


@dataclasses.dataclass
class Hold:
    """An instance held by one batch (TierGate.hold)."""

    tier: int
    order: int  # its place among batches of its tier, kept when it steps aside
    index: int | None  # None while it has stepped aside


class TierGate:
    """Hands out `capacity` session instances; batches waiting for one go
    highest tier first, FIFO within a tier. (The executors alone would
    be FIFO: a VIP batch would wait behind every standard batch already sent.)
    The last `reserved` instances run only batches of `reserved_tier` or
    above, so such a batch never waits for a lower one that is running. With
    `lend_after_s`, they are lent to lower batches once no such batch has come
    for that long (counted from the gate's creation): a reservation nobody uses
    would leave its cores idle. The first such batch after a lull may then wait
    for one lent batch; the reservation holds again from its arrival on."""

    def __init__(
        self,
        capacity: int = 1,
        queued=None,
        reserved: int = 0,
        reserved_tier: int = Tier.VIP,
        lend_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._capacity = capacity
        self._general = capacity - reserved
        self._reserved_tier = reserved_tier
        self._lend_after_s = lend_after_s
        self._clock = clock
        self._reserved_seen_at = clock()  # the latest batch that may use the reserved instances
        self._free = list(range(capacity))
        self._waiting: list[tuple[int, int, asyncio.Future, int]] = []  # (-tier, order, turn, rows)
        self._order = itertools.count()
        self._queued = queued  # a gauge of the batches waiting, if any
        self.waiting = 0

    @contextlib.asynccontextmanager
    async def turn(self, tier: int, wait_s: float | None = None, rows: int = 1):
        """Yields the index of the instance the batch (of `rows` rows) may use;
        raises NoTurn when none came free within `wait_s` (None: no limit)."""
        async with self.hold(tier, wait_s, rows) as held:
            yield held.index

    @contextlib.asynccontextmanager
    async def hold(self, tier: int, wait_s: float | None = None, rows: int = 1):
        """As turn, but yields a Hold: a batch run in slices may step aside
        between two of them (step_aside), so the instance it holds may change."""
        order = next(self._order)
        if tier >= self._reserved_tier:
            self._reserved_seen_at = self._clock()
        elif self.lending():
            self._hand_on_free(at_least=tier)  # lending may have begun while batches waited
        # No waiting batch may use a free instance (each is handed on at release), so
        # taking one that this batch may use passes nobody.
        instance = self._take_free(tier)
        if instance is None:
            future = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (-tier, order, future, rows))
            self._count_waiting(+1)
            try:
                instance = await (future if wait_s is None else asyncio.wait_for(future, max(wait_s, 0.0)))
            except (asyncio.CancelledError, TimeoutError) as exc:
                if future.done() and not future.cancelled():
                    self._release(future.result())  # it was our turn: hand it on
                if isinstance(exc, TimeoutError):
                    raise NoTurn from None
                raise
            finally:
                self._count_waiting(-1)
        held = Hold(tier, order, instance)
        try:
            yield held
        finally:
            if held.index is not None:
                self._release(held.index)

    async def step_aside(self, held: Hold, rows: int) -> bool:
        """Between two slices of a batch: if a batch of a higher tier waits, hands
        it the instance and waits for one again, ahead of every batch of its own
        tier that came later (its place in line is kept). Returns whether it
        stepped aside."""
        if not self.waiting_above(held.tier):
            return False
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (-held.tier, held.order, future, rows))
        self._count_waiting(+1)
        index, held.index = held.index, None
        assert index is not None  # a batch steps aside from the instance it holds
        self._release(index)  # to the higher batch: it is first in line
        try:
            held.index = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release(future.result())
            raise
        finally:
            self._count_waiting(-1)
        return True

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def reserved(self) -> int:
        """Instances reserved for batches of `reserved_tier` or above."""
        return self._capacity - self._general

    def waiting_above(self, tier: int) -> bool:
        """Whether a batch of a higher tier than `tier` waits for an instance."""
        return any(-p > tier and not future.done() for p, _, future, _ in self._waiting)

    def lending(self) -> bool:
        """Whether the reserved instances run lower batches too (see the class)."""
        return (
            self._general < self._capacity
            and self._lend_after_s is not None
            and self._clock() - self._reserved_seen_at >= self._lend_after_s
        )

    def may_use(self, instance: int, tier: int) -> bool:
        return instance < self._general or tier >= self._reserved_tier or self.lending()

    def lent(self, instance: int, tier: int) -> bool:
        """Whether a batch of `tier` on `instance` runs there on loan."""
        return instance >= self._general and tier < self._reserved_tier

    def usable(self, tier: int) -> int:
        """How many instances a batch of `tier` may run on."""
        return self._capacity if tier >= self._reserved_tier or self.lending() else self._general

    def busy(self, tier: int) -> bool:
        """Whether a batch of `tier` arriving now would wait."""
        return not any(self.may_use(i, tier) for i in self._free) or bool(self.rows_ahead_of(tier))

    def _take_free(self, tier: int) -> int | None:
        # Reserved instances first for the batches they are reserved for, last for a
        # batch on loan: general ones stay for the rest, and reserved ones for whoever
        # they are reserved for.
        for instance in sorted(self._free, reverse=tier >= self._reserved_tier):
            if self.may_use(instance, tier):
                self._free.remove(instance)
                return instance
        return None

    def in_use(self) -> int:
        return self._capacity - len(self._free)

    def rows_ahead_of(self, tier: int) -> list[int]:
        """The sizes of the waiting batches that a new batch of `tier` would wait behind."""
        return [rows for p, _, future, rows in self._waiting if -p >= tier and not future.done()]

    def _count_waiting(self, change: int) -> None:
        self.waiting += change
        if self._queued is not None:  # shared by two loads of one version during a reload: add, never set
            self._queued.inc(change)

    def _hand_on_free(self, at_least: int | None = None) -> None:
        """Hands free instances to waiting batches that may now use them (of
        tier `at_least` or above: those a batch arriving now would not pass)."""
        for instance in list(self._free):
            self._free.remove(instance)
            self._give(instance, at_least)

    def _release(self, instance: int) -> None:
        """Hands `instance` to the first waiting batch that may use it, else frees it;
        while lending, free reserved instances go to waiting batches too (lending
        begins with time passing, not with an event that would hand them on)."""
        self._give(instance)
        if self.lending():
            self._hand_on_free()

    def _give(self, instance: int, at_least: int | None = None) -> None:
        self._waiting = [entry for entry in self._waiting if not entry[2].done()]
        eligible = [
            entry
            for entry in self._waiting
            if self.may_use(instance, -entry[0]) and (at_least is None or -entry[0] >= at_least)
        ]
        if not eligible:
            heapq.heapify(self._waiting)
            self._free.append(instance)
            return
        first = min(eligible)
        self._waiting.remove(first)
        heapq.heapify(self._waiting)
        first[2].set_result(instance)


# Batches estimated to run this long or less, on the CPU, run on the event loop (_run_on).
INLINE_RUN_S = 0.0002


@dataclasses.dataclass
class Instance:
    """One ONNX Runtime session and the thread that runs it."""

    session: ort.InferenceSession
    executor: concurrent.futures.ThreadPoolExecutor
    device_id: int | None  # a CUDA device, or None on the CPU
    feed_names: frozenset[str]

    def run(self, graph_outputs: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self.device_id is None:
            return self.session.run(graph_outputs, feeds)
        # On a GPU, IOBinding copies each input to the device once and lets ORT
        # write outputs into device buffers it allocates, instead of staging
        # both through extra host copies inside run().
        binding = self.session.io_binding()
        for name, array in feeds.items():
            binding.bind_ortvalue_input(
                name, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), "cuda", self.device_id)
            )
        for name in graph_outputs:
            binding.bind_output(name, "cuda", self.device_id)
        self.session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()


class LoadedVersion:
    """One version of one model, loaded, warmed up and verified; runs batches."""

    def __init__(
        self,
        config: ModelConfig,
        version: str,
        instances: list[Instance],
        tokenizer,
        fingerprint: str,
        memory_bytes: int,
        revision: str = "",
    ):
        self.config = config
        self.version = version
        self.instances = instances
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint  # names, sizes and times of the files: cheap to compare
        self.revision = revision  # a hash of the contents that decide the outputs
        self.memory_bytes = memory_bytes
        self.loaded_at = time.time()
        self.gate = TierGate(
            len(instances),
            metrics.QUEUED.labels(config.name, version),
            reserved=config.instances.reserved_for_vip,
            lend_after_s=config.instances.lend_reserved_after_s,
        )
        self.run_s = 0.0  # a first guess at a batch's time, from warm-up, until batches have run
        self.profile = LatencyProfile()  # what batches took, per size class
        # What the runs themselves took, without the hand-off to an instance's thread
        # and back: which batches run on the event loop is decided by this (_run_on).
        self.run_profile = LatencyProfile()
        self._running: dict[int, Running] = {}  # instance -> what runs on it
        self.slice_s = 0.0  # the longest slice a batch runs in while higher tiers come; 0: whole batches
        self._seen_at: dict[int, float] = {}  # tier -> loop time its latest batch arrived
        self.broken = ""  # why a shard failed; such a version is not ready
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def provider(self) -> str:
        return self.instances[0].session.get_providers()[0]

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def execute(
        self,
        inputs: dict[str, TensorData],
        outputs: list[str],
        tier: int,
        timeout_s: float | None = None,
        slice_rows: int | None = None,
    ) -> list[TensorData]:
        """Runs one batch on a free instance, VIP batches first; counts as in flight from the call on.

        A batch with `timeout_s` that finds every instance busy is refused
        with RESOURCE_EXHAUSTED at once when the batches running and waiting
        ahead of it leave it no time to run, and otherwise waits only while it
        could still finish; when its turn comes, it runs only if it can still
        finish by what its size takes now, and sliced, each slice after the
        first only if the rest still can (_time_lacking). It is refused before
        its deadline, never left to time out. Envoy counts a timeout (504)
        against the replica and would eject a busy but healthy one; it counts
        429 as no failure. Times are
        estimated per batch size (estimate_s): a VIP batch of one text and a
        standard batch of 32 differ tenfold."""
        self._in_flight += 1
        self._idle.clear()
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        rows = next(iter(inputs.values())).rows if inputs else 1
        own_s = self.estimate_s(rows, CAUTIOUS_DEVIATIONS)
        wait_s = None if timeout_s is None else timeout_s - own_s - errors.REFUSAL_MARGIN_S
        retry_s = own_s
        try:
            if wait_s is not None and self.gate.busy(tier):
                now = loop.time()
                running_s = sum(
                    max(self.estimate_s(r.rows_ahead_of(tier)) - (now - r.started), 0.0)
                    for i, r in self._running.items()
                    if self.gate.may_use(i, tier)
                )
                running_s += max(self.gate.in_use() - len(self._running), 0) * own_s  # held, size unknown
                queued_s = sum(self.estimate_s(n) for n in self.gate.rows_ahead_of(tier))
                expected_wait_s = (running_s + queued_s) / self.gate.usable(tier)
                if expected_wait_s > wait_s:
                    retry_s = expected_wait_s - wait_s  # how much time it lacked
                    raise NoTurn  # refused now rather than after waiting in vain
            counts = self._slice_counts(rows, tier, loop.time(), slice_rows)
            if len(counts) > 1 and slice_rows is None:
                metrics.SLICED.labels(self.config.name).inc()
            gate_ns = time.time_ns()
            async with self.gate.hold(tier, wait_s, counts[0]) as held:
                if (span := tracing.CURRENT.get()) is not None:  # provider asks the session: traced batches only
                    attributes = {"tier": tier, "provider": self.provider, "instance": held.index}
                    tracing.record(span, "model_server.gate", gate_ns, time.time_ns(), attributes)
                if (lacking_s := self._time_lacking(arrived, timeout_s, [rows])) > 0:
                    retry_s = lacking_s
                    raise NoTurn
                self._count_loan(held.index, tier)
                if len(counts) == 1:
                    return await self._run_on(held.index, inputs, outputs, Running(0.0, rows, rows, tier))
                # Each input in len(counts) parts: piece i holds every input's part i.
                parts_of = [split_rows(t, counts) for t in inputs.values()]
                pieces = [dict(zip(inputs, parts, strict=True)) for parts in zip(*parts_of, strict=True)]
                results, left = [], rows
                for i, (piece, count) in enumerate(zip(pieces, counts, strict=True)):
                    if i and await self.gate.step_aside(held, count):
                        metrics.STEPPED_ASIDE.labels(self.config.name).inc()
                    if i and (lacking_s := self._time_lacking(arrived, timeout_s, counts[i:])) > 0:
                        retry_s = lacking_s
                        raise NoTurn  # refused before its deadline, not finished after it
                    results.append(await self._run_on(held.index, piece, outputs, Running(0.0, count, left, tier)))
                    left -= count
                return [concat_rows(list(parts)) for parts in zip(*results, strict=True)]
        except NoTurn:  # only a batch with timeout_s waits for a limited time
            assert timeout_s is not None
            metrics.SHED.labels(self.config.name).inc()
            raise errors.ResourceExhausted(
                f"model '{self.config.name}' version {self.version} is busy: this batch would not finish before its "
                f"deadline ({1000 * timeout_s:.0f} ms left, a batch of {rows} takes about "
                f"{1000 * self.estimate_s(rows):.0f} ms); "
                f"retry shortly",
                retry_after_ms=max(1, round(1000 * retry_s)),
            ) from None
        except ShardFailed as exc:
            self.broken = str(exc)
            raise errors.Unavailable(
                f"model '{self.config.name}' version {self.version} lost a tensor-parallel "
                f"shard ({exc}); retry on another replica"
            ) from None
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
            took_s = loop.time() - arrived
            if timeout_s is not None and took_s > timeout_s:
                metrics.LATE.labels(self.config.name).inc()
                log.info(
                    "%s version %s: a batch of %d rows (tier %d) finished %.0f ms after its deadline: "
                    "%.0f ms with %.0f ms left, its run estimated at %.0f ms",
                    self.config.name,
                    self.version,
                    rows,
                    tier,
                    1000 * (took_s - timeout_s),
                    1000 * took_s,
                    1000 * timeout_s,
                    1000 * own_s,
                )

    def _time_lacking(self, arrived: float, timeout_s: float | None, counts: list[int]) -> float:
        """Checked again when a batch's turn comes, and before each slice after
        the first: how much more time than it has left the batch (or the rest
        of its slices, `counts`) needs, its next run cautiously and any later
        slices by their mean. The batches it waited for may have run longer
        than estimated (a loaded machine's batches vary severalfold), and each
        of them taught the profile so; slices interleave with VIP batches, and
        a batch estimated at 150 ms was seen to take 1.6 s so. Such a batch is
        refused then rather than run past its deadline (the caller would get a
        timeout, and the work would be wasted all the same)."""
        if timeout_s is None:
            return 0.0
        left_s = arrived + timeout_s - asyncio.get_running_loop().time()
        needed_s = self.estimate_s(counts[0], CAUTIOUS_DEVIATIONS) + sum(self.estimate_s(n) for n in counts[1:])
        return needed_s + errors.REFUSAL_MARGIN_S - left_s

    def _count_loan(self, index: int, tier: int) -> None:
        """Counts a caller's batch (not the golden probe's, below every caller) starting on a lent instance."""
        if tier >= 0 and self.gate.lent(index, tier):
            metrics.LENT.labels(self.config.name).inc()

    async def _run_on(
        self, index: int, inputs: dict[str, TensorData], outputs: list[str], running: Running
    ) -> list[TensorData]:
        """Runs `inputs` (running.rows rows) on instance `index`."""
        loop = asyncio.get_running_loop()
        instance = self.instances[index]
        running.started = loop.time()
        self._running[index] = running
        try:
            if instance.device_id is None and not self.tokenizer and self._run_estimate_s(running.rows) <= INLINE_RUN_S:
                # A run this short costs less than the hand-off to the instance's thread and back
                # (two thread wake-ups, a few hundred microseconds on a loaded machine): it runs
                # here, the event loop held no longer than by a handful of requests' own work.
                result, run_s = self._timed_run(instance, inputs, outputs)
            else:
                # In the request's context, so that the run's steps are recorded under its span.
                context = contextvars.copy_context()
                result, run_s = await loop.run_in_executor(
                    instance.executor, context.run, self._timed_run, instance, inputs, outputs
                )
        finally:
            del self._running[index]
        self.profile.observe(running.rows, loop.time() - running.started)
        self.run_profile.observe(running.rows, run_s)
        return result

    def _timed_run(
        self, instance: Instance, inputs: dict[str, TensorData], outputs: list[str]
    ) -> tuple[list[TensorData], float]:
        started = time.perf_counter()
        result = self.run(instance, inputs, outputs)
        return result, time.perf_counter() - started

    def _run_estimate_s(self, rows: int) -> float:
        """How long the run itself of a batch of `rows` takes, where it runs.
        Not estimate_s: that counts the hand-off to a thread, and a batch that
        once went there (a warm-up on a loaded machine) would seem too long to
        come back."""
        learned = self.run_profile.estimate(rows, shrink=False)
        return self.run_s if learned is None else learned

    def _slice_counts(self, rows: int, tier: int, now: float, slice_rows: int | None = None) -> list[int]:
        """The slices to run a batch in: slices of `slice_rows` when the caller asks
        (the golden probe does); else the whole batch, unless slice_s is set and
        batches of a higher tier came lately; then slices the latency profile
        says take at most slice_s, so that such a batch waits for one slice at
        most instead of the whole batch (execution itself is not preemptive)."""
        self._seen_at[tier] = now
        if len(self._seen_at) > MAX_TIERS_SEEN:
            del self._seen_at[min(self._seen_at, key=self._seen_at.__getitem__)]
        if slice_rows is not None:
            size = slice_rows
        elif (
            self.slice_s > 0
            and rows > 1
            and any(other > tier and now - seen < HIGHER_TIER_MEMORY_S for other, seen in self._seen_at.items())
        ):
            size = rows
            while size > 1 and self.estimate_s(size) > self.slice_s:
                size = (size + 1) // 2
        else:
            return [rows]
        return [min(size, rows - start) for start in range(0, rows, size)]

    def estimate_s(self, rows: int, deviations: float = 0.0) -> float:
        """How long a batch of `rows` rows runs: what batches of its size took
        lately (plus `deviations` times how much they varied), else the nearest
        size measured (scaled up for a larger batch, never down), else the
        warm-up's guess."""
        learned = self.profile.estimate(rows, shrink=False, deviations=deviations)
        return self.run_s if learned is None else learned

    def run(self, instance: Instance, inputs: dict[str, TensorData], outputs: list[str]) -> list[TensorData]:
        """Runs one batch synchronously on one instance (call it in that instance's executor)."""
        if self.tokenizer is None:
            feeds = self._feeds(instance, inputs)
        else:
            with tracing.step("model_server.tokenise"):
                feeds = self._feeds(instance, inputs)
        wanted = outputs or [spec.name for spec in self.config.outputs]
        graph_names = [self.config.graph_outputs.get(name, name) for name in wanted]
        with tracing.step("onnxruntime.run"):
            results = instance.run(graph_names, feeds)
        specs = {spec.name: spec for spec in self.config.outputs}
        return [
            from_numpy(name, np.asarray(value), specs[name].datatype)
            for name, value in zip(wanted, results, strict=True)  # ONNX Runtime answers each name asked
        ]

    def _feeds(self, instance: Instance, inputs: dict[str, TensorData]) -> dict[str, np.ndarray]:
        if self.tokenizer is None:
            return {name: to_numpy(tensor) for name, tensor in inputs.items()}
        (text,) = inputs.values()
        texts = []
        for i, item in enumerate(to_numpy(text).reshape(-1)):
            try:
                texts.append(item.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise errors.InvalidArgument(
                    f"input '{text.name}' element {i} is not UTF-8 text (byte {exc.start}: {exc.reason})"
                ) from None
        encodings = self.tokenizer.encode_batch(texts)
        preprocess = self.config.preprocess
        assert preprocess is not None  # a tokenizer is made from it (load_version)
        limit = preprocess.max_text_tokens
        for i, encoding in enumerate(encodings):
            # Past max_length the tokenizer keeps the rest as overflowing pieces.
            if encoding.overflowing and _text_tokens(encoding) > limit:
                raise errors.InvalidArgument(
                    f"input '{text.name}' element {i} of model '{self.config.name}' has more than {limit} tokens; "
                    f"the limit is {limit} tokens per text (preprocess.max_text_tokens), and the model reads the "
                    f"first {preprocess.max_length}"
                )
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        metrics.PADDING.labels(self.config.name).observe(1.0 - mask.sum() / max(mask.size, 1))
        feeds = {"attention_mask": mask}
        if "input_ids" in instance.feed_names:
            feeds["input_ids"] = np.array([e.ids for e in encodings], dtype=np.int64)
        if "token_type_ids" in instance.feed_names:
            feeds["token_type_ids"] = np.array([e.type_ids for e in encodings], dtype=np.int64)
        return {name: value for name, value in feeds.items() if name in instance.feed_names}

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def close(self) -> None:
        for instance in self.instances:
            instance.executor.shutdown(wait=True, cancel_futures=False)
            if isinstance(instance.session, ShardedSession):
                instance.session.close()


# ---------------------------------------------------------------- loading


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def load_version(
    config: ModelConfig, version: str, use_cuda: bool, threads: int, golden: Golden | None
) -> LoadedVersion:
    """Loads one version beside whatever serves now, warms it up with
    representative batches and checks it against the golden probe. Blocking:
    call it off the event loop. Raises LoadFailed; nothing is left running then."""
    folder = config.path / version
    model_file = folder / "model.onnx"
    if config.tp_degree > 1:
        model_file = folder / f"tp{config.tp_degree}" / "manifest.json"  # a sharded model needs no whole graph
    if not model_file.is_file():
        raise LoadFailed("file", f"{folder}: missing {model_file.relative_to(folder)}")
    tokenizer, tokenizer_bytes = None, None
    if config.preprocess is not None:
        tokenizer_bytes = _tokenizer_bytes(config, version)
        tokenizer = _tokenizer(tokenizer_bytes, folder / config.preprocess.tokenizer_file, config.preprocess.max_length)
    fingerprint = version_fingerprint(folder)
    started, rss_before = time.perf_counter(), _rss_bytes()
    count = config.instances.count
    intra = config.execution.intra_op_threads or max(1, threads // count)
    instances: list[Instance] = []
    try:
        for i in range(count):
            device_id = None
            if use_cuda and config.execution.providers[0] == "cuda":
                device_id = config.instances.gpus[i % len(config.instances.gpus)]
            if config.tp_degree > 1:
                session = _sharded_session(config, folder, device_id, intra)
                device_id = None  # each shard binds its own device
            else:
                session = _session(model_file, config, device_id, intra)
                if device_id is not None and session.get_providers()[0] != "CUDAExecutionProvider":
                    device_id = None  # ORT fell back to the CPU
            executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"ort-{config.name}-{version}"
            )
            instances.append(Instance(session, executor, device_id, frozenset(i.name for i in session.get_inputs())))
        loaded = LoadedVersion(
            config, version, instances, tokenizer, fingerprint, 0, _revision(config, model_file, tokenizer_bytes)
        )
        _check_signature(loaded, model_file)
        for instance in instances:
            for size in config.warmup_batch_sizes:
                try:
                    started = time.perf_counter()
                    loaded.run(instance, warmup_inputs(config, golden, size), [])
                    loaded.run_s = time.perf_counter() - started  # a first guess at a batch's time
                except Exception as exc:  # noqa: BLE001 - any failure of a warm-up run fails the load
                    raise LoadFailed(
                        "warmup", f"{config.name} version {version} failed warm-up at batch {size}: {first_line(exc)}"
                    ) from None
        if golden is not None:
            passed, detail = compare(loaded.run(instances[0], golden_feeds(config, golden), []), golden, config)
            if not passed:
                raise LoadFailed("verification", f"{config.name} version {version} fails its golden probe: {detail}")
        loaded.memory_bytes = max(0, _rss_bytes() - rss_before)
    except BaseException:
        for instance in instances:
            instance.executor.shutdown(wait=False)
            if isinstance(instance.session, ShardedSession):
                instance.session.close()
        raise
    log.info(
        "loaded %s version %s on %s (%d instance(s), %d threads each) in %.2fs, +%.0f MB resident",
        config.name,
        version,
        loaded.provider,
        count,
        intra,
        time.perf_counter() - started,
        loaded.memory_bytes / 1e6,
    )
    return loaded


def _revision(config: ModelConfig, model_file: pathlib.Path, tokenizer_bytes: bytes | None) -> str:
    """A hash of what decides the outputs: the graph (or the shard manifest, which
    lists every shard's sha256), the tokenizer, and the config fields that change
    what they compute (the signature, the tokenizer's settings, which graph
    output answers for which output). The same on every replica holding the
    same files and config, wherever and whenever they were copied. The router
    keys its cache by it, so a reload that changes only such a field (a
    max_length, a graph output) must change it too. Instances, execution
    settings and the version policy are left out: they change how and where a
    batch runs, not its answer (beyond rounding, which the golden probe bounds)."""
    digest = hashlib.blake2b(digest_size=12)
    deciding = {
        "inputs": [dataclasses.astuple(s) for s in config.inputs],
        "outputs": [dataclasses.astuple(s) for s in config.outputs],
        # max_text_tokens decides which texts are refused, not what an answer holds
        "preprocess": None if config.preprocess is None else dataclasses.astuple(config.preprocess)[:3],
        "graph_outputs": config.graph_outputs,
    }
    digest.update(json.dumps(deciding, sort_keys=True).encode() + b"\0")
    with open(model_file, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if tokenizer_bytes is not None:
        digest.update(tokenizer_bytes)
    return digest.hexdigest()


def _session(path: pathlib.Path, config: ModelConfig, device_id: int | None, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = config.execution.inter_op_threads
    options.graph_optimization_level = OPTIMIZATION[config.execution.graph_optimization]
    # Other services share these cores; spinning threads would steal them.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    providers: list[str | tuple[str, dict[str, int]]] = ["CPUExecutionProvider"]
    if device_id is not None:
        providers = [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]
    try:
        return ort.InferenceSession(str(path), options, providers=providers)
    except Exception as exc:  # noqa: BLE001 - ORT raises exception types of its own for bad files
        raise LoadFailed("session", f"{path}: ONNX Runtime cannot load it: {first_line(exc)}") from None


def _sharded_session(
    config: ModelConfig, folder: pathlib.Path, first_device: int | None, threads: int
) -> ShardedSession:
    """The version's shard set for tp_degree: shard i on GPU gpus[i] (CPU here), one thread pool each."""
    degree = config.tp_degree
    devices: list[int | None] = [None] * degree
    if first_device is not None:
        devices = [config.instances.gpus[i % len(config.instances.gpus)] for i in range(degree)]
    per_shard = max(1, threads // degree)
    try:
        return ShardedSession(
            folder / f"tp{degree}", degree, lambda path, device: _session(path, config, device, per_shard), devices
        )
    except ShardError as exc:
        raise LoadFailed("file", f"{config.name} tp_degree {degree}: {exc}") from None


def _text_tokens(encoding) -> int:
    """The tokens of a text before truncation: its own in every piece the
    tokenizer cut it into, and the special tokens of one."""
    pieces = [encoding, *encoding.overflowing]
    own = sum(len(piece.ids) - sum(piece.special_tokens_mask) for piece in pieces)  # padding is special too
    return own + sum(encoding.special_tokens_mask) - (len(encoding.ids) - sum(encoding.attention_mask))


def _tokenizer_bytes(config: ModelConfig, version: str) -> bytes:
    """The version's tokenizer file, confined to its folder and read with a bound
    (load_config checked it already: a failure here is a file changed since)."""
    assert config.preprocess is not None  # only a model with preprocess has a tokenizer
    try:
        path = config.tokenizer_path(version)
        if not path.exists():
            raise LoadFailed(
                "file",
                f"{config.path / version / config.preprocess.tokenizer_file}: missing "
                "(named by preprocess.tokenizer_file)",
            )
        return read_bounded(path, MAX_TOKENIZER_BYTES, "preprocess.tokenizer_file")
    except ConfigError as exc:
        raise LoadFailed("file", str(exc)) from None


def _tokenizer(data: bytes, path: pathlib.Path, max_length: int):
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions for bad files
        raise LoadFailed("file", f"{path}: not a tokenizers file: {first_line(exc)}") from None
    tokenizer.enable_truncation(max_length=max_length)
    tokenizer.enable_padding()  # to the longest text of the batch
    return tokenizer


def _check_signature(loaded: LoadedVersion, model_file: pathlib.Path) -> None:
    config = loaded.config
    session = loaded.instances[0].session
    graph_inputs = {i.name for i in session.get_inputs()}
    graph_outputs = {o.name for o in session.get_outputs()}
    if config.preprocess is not None:
        if "attention_mask" not in graph_inputs or graph_inputs - set(TEXT_FEEDS):
            raise LoadFailed(
                "file",
                f"{model_file}: a text model's graph takes a subset of {list(TEXT_FEEDS)} "
                f"including attention_mask, this one takes {sorted(graph_inputs)}",
            )
    elif graph_inputs != {s.name for s in config.inputs}:
        raise LoadFailed(
            "file",
            f"{model_file}: the graph's inputs {sorted(graph_inputs)} are not the config's "
            f"{sorted(s.name for s in config.inputs)}",
        )
    missing = [
        config.graph_outputs.get(s.name, s.name)
        for s in config.outputs
        if config.graph_outputs.get(s.name, s.name) not in graph_outputs
    ]
    if missing:
        raise LoadFailed("file", f"{model_file}: the graph has no output(s) {missing}; it has {sorted(graph_outputs)}")


def first_line(exc: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


# ---------------------------------------------------------------- warm-up and verification


def golden_feeds(config: ModelConfig, golden: Golden) -> dict[str, TensorData]:
    return {spec.name: from_numpy(spec.name, golden.inputs[spec.name], spec.datatype) for spec in config.inputs}


def warmup_inputs(config: ModelConfig, golden: Golden | None, rows: int) -> dict[str, TensorData]:
    """A batch of `rows` rows: the golden probe's inputs repeated (representative
    texts and lengths), else zeros of the right shape."""
    feeds = {}
    for spec in config.inputs:
        if golden is not None:
            source = golden.inputs[spec.name]
            array = source[np.arange(rows) % len(source)]
        elif spec.datatype == "BYTES":
            array = np.array(
                [b"warm up the model", b"a second, longer sentence to warm up padding"] * rows, dtype=object
            )[:rows].reshape([rows] + [1] * (len(spec.shape) - 1))
        else:
            shape = [rows] + [d if d > 0 else 1 for d in spec.shape[1:]]
            array = np.zeros(shape, dtype=NUMPY_DTYPES[spec.datatype])
        feeds[spec.name] = from_numpy(spec.name, array, spec.datatype)
    return feeds


def compare(results: list[TensorData], golden: Golden, config: ModelConfig) -> tuple[bool, str]:
    """Whether outputs match the golden probe within the config's tolerance, and
    a line with the worst row's figures."""
    probe = config.golden_probe
    assert probe is not None
    by_name = {t.name: to_numpy(t) for t in results}
    worst_cos, worst_abs, failures = 1.0, 0.0, []
    for name, expected in golden.outputs.items():
        got = by_name.get(name)
        if got is None or got.shape != expected.shape:
            return (
                False,
                f"output {name} has shape {None if got is None else list(got.shape)}, expected {list(expected.shape)}",
            )
        got64 = got.reshape(len(got), -1).astype(np.float64)
        want64 = expected.reshape(len(expected), -1).astype(np.float64)
        if not np.isfinite(got64).all():
            return False, f"output {name} holds NaN or infinity"
        abs_diff = np.abs(got64 - want64).max(axis=1)
        norms = np.linalg.norm(got64, axis=1) * np.linalg.norm(want64, axis=1)
        cosine = np.where(
            norms > 0, (got64 * want64).sum(axis=1) / np.maximum(norms, 1e-30), np.where(abs_diff == 0, 1.0, 0.0)
        )
        worst_cos, worst_abs = min(worst_cos, float(cosine.min())), max(worst_abs, float(abs_diff.max()))
        if probe.min_cosine is not None and (cosine < probe.min_cosine).any():
            row = int(cosine.argmin())
            failures.append(f"output {name} row {row} has cosine {cosine[row]:.6f} < min_cosine {probe.min_cosine}")
        if probe.max_abs is not None and (abs_diff > probe.max_abs).any():
            row = int(abs_diff.argmax())
            failures.append(f"output {name} row {row} differs by {abs_diff[row]:.3g} > max_abs {probe.max_abs}")
    figures = f"worst cosine {worst_cos:.6f}, largest difference {worst_abs:.3g}"
    return (False, "; ".join(failures) + f" ({figures})") if failures else (True, figures)
