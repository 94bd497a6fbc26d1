"""The router's data plane: validate, look up the cache, forward misses, store results.

It knows nothing of gRPC: the transport hands it InferRequest values and gets
InferResult values or domain errors back.
"""

import asyncio
import dataclasses
import functools
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from services.common import errors, identity, outcomes, tracing
from services.common.config import require
from services.common.outcomes import OutcomeLog, OutcomeSettings
from services.common.tensors import TensorData, bytes_elements, check_tensor_data
from services.common.tier import Tier
from services.router import metrics
from services.router.breaker import Breaker, BreakerPolicy, FailureSamples, State
from services.router.bypass import AdaptiveBypass
from services.router.limits import RequestLimits
from services.router.nearcache import NearCache
from services.router.tenants import RateLimiter

log = logging.getLogger(__name__)

SINGLE_FLIGHT_LINGER_S = 0.05
MAX_SHED_MS = 1000  # the longest a batcher's "retry after" makes the router refuse a tier by itself
# A request whose BYTES elements are more than this is checked in a thread (a
# walk of 200 ns an element), so that the event loop goes on meanwhile.
INLINE_ELEMENTS = 4096
ANONYMOUS_STANDARD = identity.Tenant(identity.ANONYMOUS, Tier.STANDARD)


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ModelSignature:
    """What the router knows of a model, as the batcher reports it."""

    name: str
    versions: tuple[str, ...]  # newest first
    ready_versions: tuple[str, ...]
    platform: str
    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]
    max_batch_size: int
    revisions: tuple[tuple[str, str], ...] = ()  # (version, fingerprint of its files)
    fallback: str = ""  # the model that answers while this one's breaker is open

    def revision(self, version: str) -> str:
        return self._revisions.get(version, "")

    @functools.cached_property
    def _revisions(self) -> dict[str, str]:
        return dict(self.revisions)

    @functools.cached_property
    def input_names(self) -> frozenset[str]:
        return frozenset(spec.name for spec in self.inputs)

    @functools.cached_property
    def output_names(self) -> frozenset[str]:
        return frozenset(spec.name for spec in self.outputs)


@dataclasses.dataclass
class InferRequest:
    model: str
    version: str
    id: str
    inputs: list[TensorData]
    outputs: list[str]
    tier: Tier = Tier.STANDARD  # the tier it runs at: its tenant's answer to claimed_tier
    timeout_s: float | None = None
    cache_bypass: bool = False
    claimed_tier: Tier | None = None  # what the request asked for (x-user-tier, the OIP priority), if anything
    tenant: identity.Tenant = ANONYMOUS_STANDARD
    traceparent: str = ""  # the caller's W3C trace context, as sent (tracing.start_request judges it)

    def __post_init__(self):
        self.tier = Tier(self.tier)


@dataclasses.dataclass
class InferResult:
    model: str
    version: str
    id: str
    outputs: list[TensorData]
    cached: bool
    degraded: str = ""  # how a failing model's request was answered instead: "cache" or "fallback <model>/<version>"


class Batcher(Protocol):
    async def submit(
        self,
        model: str,
        version: str,
        inputs: list[TensorData],
        outputs: list[str],
        tier: Tier,
        timeout_s: float,
        tenant: str = identity.ANONYMOUS,
        weight: float = 1.0,
    ) -> tuple[str, list[TensorData]]: ...


class Cache(Protocol):
    async def lookup(self, model: str, digest: bytes, tier: Tier) -> tuple[list[TensorData] | None, int | None]:
        """The cached outputs or None, and the model's cache generation the lookup read (None: unknown)."""

    def store(self, model: str, digest: bytes, outputs: list[TensorData], generation: int | None = None) -> None:
        """Keeps a result computed after a miss, under the generation that lookup read."""


class Catalog:
    """The models the mesh serves; replaced whole on every poll of the batcher."""

    def __init__(self):
        self._models: dict[str, ModelSignature] = {}
        self.updated = asyncio.Event()

    def replace(self, models: list[ModelSignature]) -> None:
        # A model that disappears is kept with no ready version, so callers get
        # UNAVAILABLE (retry) instead of NOT_FOUND while its replicas restart.
        merged = {name: dataclasses.replace(sig, ready_versions=()) for name, sig in self._models.items()}
        merged.update({m.name: m for m in models})
        self._models = merged
        self.updated.set()

    def get(self, name: str) -> ModelSignature | None:
        return self._models.get(name)

    def names(self) -> list[str]:
        return sorted(self._models)

    def is_ready(self) -> bool:
        return any(sig.ready_versions for sig in self._models.values())


@dataclasses.dataclass(frozen=True)
class RouterSettings:
    """What the router's core is configured with (RouterConfig.settings() builds it)."""

    default_timeout_s: float = 60.0  # the deadline of a request that brings none
    breaker_policy: BreakerPolicy = dataclasses.field(default_factory=BreakerPolicy)
    limits: RequestLimits = dataclasses.field(default_factory=RequestLimits)
    # The outcome lines (services.common.outcomes); None writes none.
    outcome_log: OutcomeSettings | None = dataclasses.field(default_factory=OutcomeSettings)

    def __post_init__(self):
        require(self.default_timeout_s > 0, f"default_timeout_s must be > 0, got {self.default_timeout_s}")


class Router:
    """The data plane behind the router's protocol adapters: validation, the
    cache, single-flight, the breaker and its fallback, shedding, the batcher."""

    def __init__(
        self,
        catalog: Catalog,
        batcher: Batcher,
        cache: Cache | None,
        settings: RouterSettings = RouterSettings(),
        *,
        bypass: AdaptiveBypass | None = None,
        near: NearCache | None = None,
        failure_samples: FailureSamples | None = None,
        limiter: RateLimiter | None = None,
        tenant_label: Callable[[str], str] = lambda name: name,
    ):
        self.catalog = catalog
        self._limiter = limiter if limiter is not None else RateLimiter()
        self._tenant_label = tenant_label
        self.limits = settings.limits
        self._breaker_policy = settings.breaker_policy
        self._breakers: dict[str, Breaker] = {}
        self._failure_samples = failure_samples
        self._near = near if near is not None else NearCache(ttl_s=0, max_bytes=0)
        self._default_timeout_s = settings.default_timeout_s
        self._outcomes = OutcomeLog("router", settings.outcome_log) if settings.outcome_log is not None else None
        self._batcher = batcher
        self._cache = cache
        self._bypass = bypass if bypass is not None else AdaptiveBypass()
        # Single-flight: the one computation running per (digest, tier, version
        # asked for), the deadline it runs with, and how many callers wait on it.
        self._running: dict[tuple[bytes, int, str], tuple[asyncio.Task, float]] = {}
        self._waiting: dict[tuple[bytes, int, str], int] = {}
        # (model, tier, tenant) -> a refusal of the batcher that requests like it would get too (Shed):
        # per tenant, as a tenant over its share is refused where others are not.
        self._shedding: dict[tuple[str, int, str], Shed] = {}

    def signature(self, model: str, version: str = "") -> tuple[ModelSignature, str]:
        """The model's signature and the concrete version a request would use."""
        sig = self.catalog.get(model)
        if sig is None:
            raise errors.NotFound(
                f"model {errors.shown(model)} is not served; available models: {self.catalog.names()}"
            )
        if version:
            if version not in sig.versions:
                raise errors.NotFound(
                    f"model '{model}' has no version {errors.shown(version)}; versions: {list(sig.versions)}"
                )
            return sig, version
        return sig, (sig.ready_versions[0] if sig.ready_versions else (sig.versions[0] if sig.versions else ""))

    def is_model_ready(self, model: str, version: str = "") -> bool:
        sig = self.catalog.get(model)
        if sig is None:
            return False
        return version in sig.ready_versions if version else bool(sig.ready_versions)

    async def infer(self, request: InferRequest) -> InferResult:
        started = time.perf_counter()
        code, failure, result = "INTERNAL", None, None
        span = (
            tracing.start_request(
                "router.infer",
                request.traceparent,
                {"model": request.model, "tier": request.tier.label, "tenant": self._tenant_label(request.tenant.name)},
                root=True,
            )
            if tracing.is_on()
            else None
        )
        token = tracing.activate(span)
        timings: dict[str, float] | None = {} if self._outcomes is not None else None
        timed = tracing.TIMINGS.set(timings) if timings is not None else None
        try:
            # Before anything else: a tenant over its rate costs the mesh no more than this.
            self._limiter.take(request.tenant, _rows_asked(request))
            result = await self._infer(request)
            code = "OK"
            return result
        except errors.InfermeshError as exc:
            code = exc.code_name
            failure = exc
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            elapsed_s = time.perf_counter() - started
            tracing.finish(span, token, code)
            # Only known model names become label values: callers cannot grow the series.
            labels = (request.model if self.catalog.get(request.model) else "unknown", request.tier.label, code)
            metrics.REQUESTS_BY[labels].inc()
            if span is None:
                metrics.LATENCY_BY[labels].observe(elapsed_s)
            else:  # an exemplar: this bucket's latest traced request, one click from the dashboard to its trace
                metrics.LATENCY_BY[labels].observe(
                    elapsed_s, exemplar={"trace_id": f"{span.get_span_context().trace_id:032x}"}
                )
            metrics.TENANT_REQUESTS_BY[self._tenant_label(request.tenant.name), code].inc()
            if timed is not None:
                tracing.TIMINGS.reset(timed)
            if self._outcomes is not None:
                self._outcomes.observe(
                    code, elapsed_s, lambda: self._outcome_fields(request, span, timings, result, failure)
                )

    def _outcome_fields(self, request: InferRequest, span, timings, result, failure) -> dict:
        """An outcome line's fields beside its status and latency (outcomes.OutcomeLog)."""
        fields = {
            "trace_id": f"{span.get_span_context().trace_id:032x}"
            if span is not None
            else tracing.trace_id(request.traceparent),
            "traced": span is not None,
            "request_id": outcomes.clipped(request.id),
            "tenant": self._tenant_label(request.tenant.name),
            "model": outcomes.clipped(request.model),
            "version": outcomes.clipped(result.version if result is not None else request.version),
            "tier": request.tier.label,
            "steps_ms": outcomes.steps_ms(timings),
        }
        if result is not None:
            fields["cached"] = result.cached
            if result.degraded:
                fields["degraded"] = result.degraded
        if failure is not None:
            fields["message"] = outcomes.clipped(failure.message, outcomes.MAX_MESSAGE_CHARS)
        return fields

    async def _infer(self, request: InferRequest) -> InferResult:
        """Through the model's circuit breaker when it has a fallback: while the
        breaker is open, answers come from the cache or the fallback model."""
        sig = self.catalog.get(request.model)
        if sig is None or not sig.fallback or request.version or request.model == sig.fallback:
            return await self._infer_primary(request)
        breaker = self._breakers.get(sig.name)
        if breaker is None:  # not setdefault: a Breaker is not free to build, and this runs per request
            breaker = self._breakers[sig.name] = Breaker(self._breaker_policy)
        loop = asyncio.get_running_loop()
        if not breaker.allows(loop.time()):
            self._publish_breaker(sig.name, breaker)
            return await self._degraded(request, sig)
        try:
            result = await self._infer_primary(request)
        except errors.InfermeshError as exc:
            # Only the model's own failures are recorded: one the caller brought on
            # itself (a bad request, its own short deadline) or a busy queue says
            # nothing of the model, and counted as a success it would dilute real failures.
            timeout_s = request.timeout_s if request.timeout_s is not None else self._default_timeout_s
            if not self._breaker_policy.counts(exc.code_name, timeout_s):
                raise
            self._publish_breaker(sig.name, breaker, breaker.record(loop.time(), failed=True))
            if self._failure_samples is not None:
                self._failure_samples.record(sig.name, exc, request)
            if breaker.state is State.CLOSED:
                raise
            return await self._degraded(request, sig)  # the breaker is not closed: this caller need not fail
        self._publish_breaker(sig.name, breaker, breaker.record(loop.time(), failed=False))
        return result

    def _publish_breaker(self, model: str, breaker: Breaker, changed: State | None = None) -> None:
        metrics.BREAKER_STATE_BY[model].set(breaker.state.value)
        if changed is not None:
            metrics.BREAKER_TRANSITIONS.labels(model, changed.name.lower()).inc()
            log.warning("circuit breaker of model %s is now %s", model, changed.name.lower())

    async def _degraded(self, request: InferRequest, sig: ModelSignature) -> InferResult:
        """The cache's answer for this exact request if it has one, else the fallback model's."""
        version = sig.ready_versions[0] if sig.ready_versions else (sig.versions[0] if sig.versions else "")
        if self._cache is not None and not request.cache_bypass:
            inputs = await validated(sig, request, self.limits)
            digest = request_digest(sig.name, version, inputs, request.outputs, sig.revision(version))
            cached = self._near.get(digest) or (await self._cache.lookup(sig.name, digest, request.tier))[0]
            if cached is not None:
                metrics.DEGRADED.labels(sig.name, "cache").inc()
                return InferResult(sig.name, version, request.id, cached, cached=True, degraded="cache")
        try:
            result = await self._infer_primary(dataclasses.replace(request, model=sig.fallback, version=""))
        except (errors.NotFound, errors.Unavailable) as exc:
            raise errors.Unavailable(
                f"model '{sig.name}' is failing (its circuit breaker is open) and its fallback "
                f"'{sig.fallback}' cannot answer either: {exc.message}"
            ) from None
        metrics.DEGRADED.labels(sig.name, "fallback").inc()
        return dataclasses.replace(
            result, model=sig.name, version="", degraded=f"fallback {sig.fallback}/{result.version}"
        )

    async def _infer_primary(self, request: InferRequest) -> InferResult:
        sig, version = self.signature(request.model, request.version)
        if version not in sig.ready_versions:
            raise errors.Unavailable(f"model '{sig.name}' version '{version}' has no ready replica; retry later")
        inputs = await validated(sig, request, self.limits)
        # Every request has a deadline downstream: the caller's, or ours. The
        # batcher's is a little earlier, so that it answers DEADLINE_EXCEEDED
        # itself before the caller's own deadline fires.
        timeout = request.timeout_s if request.timeout_s is not None else self._default_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout - max(0.005, 0.1 * timeout)
        if request.cache_bypass:
            metrics.CACHE_BY["bypassed"].inc()
            used, outputs = await self._submit(
                sig.name, request.version, inputs, request.outputs, request.tier, deadline, request.tenant
            )
            return InferResult(sig.name, used, request.id, outputs, cached=False)
        digest = request_digest(sig.name, version, inputs, request.outputs, sig.revision(version))
        flight = Flight(
            digest, sig.name, version, inputs, request.outputs, request.tier, deadline, request.version, request.tenant
        )
        used, outputs, cached = await self._single_flight(flight)
        return InferResult(sig.name, used, request.id, outputs, cached=cached)

    async def _single_flight(self, flight: "Flight") -> tuple[str, list[TensorData], bool]:
        """Identical requests of one tier (and one version asked for: a request
        pinned to a version never rides on one that named none) share one
        lookup-and-compute. It runs with its first caller's deadline; a caller
        that joins it waits no longer than its own, and one with more time left
        when the first caller's deadline ends the flight (a DEADLINE_EXCEEDED,
        or a RESOURCE_EXHAUSTED that says it would not finish in that time)
        starts a new one. The flight is cancelled only when every caller has
        left. A success lingers briefly, covering the moment before its store
        lands."""
        key = (flight.digest, flight.tier, flight.requested)
        loop = asyncio.get_running_loop()
        while True:
            running = self._running.get(key)
            joined = running is not None
            if running is not None:
                task, runs_until = running
                metrics.CACHE_BY["shared"].inc()
            else:
                if self._cache is None or self._bypass.is_bypassed(flight.model):
                    # Nothing to look up first: a shed level is refused right here, in the
                    # caller's own step, not one turn of the event loop later in a task.
                    self._refuse_if_shed(
                        flight.model, flight.tier, flight.deadline, flight.inputs[0].rows, flight.tenant.name
                    )
                task, runs_until = asyncio.create_task(self._resolve(flight)), flight.deadline
                self._running[key] = (task, runs_until)
                task.add_done_callback(functools.partial(self._finished, key, flight.model))
            self._waiting[key] = self._waiting.get(key, 0) + 1
            try:
                if not joined or flight.deadline >= runs_until:
                    return await asyncio.shield(task)
                try:  # a caller with less time than the flight's: its own deadline holds
                    return await asyncio.wait_for(asyncio.shield(task), flight.deadline - loop.time())
                except TimeoutError:
                    raise errors.DeadlineExceeded(
                        f"request for model '{flight.model}' reached its deadline while an identical request's "
                        f"computation, which it shared, was still running"
                    ) from None
            except (errors.DeadlineExceeded, errors.ResourceExhausted):
                if not joined or flight.deadline <= runs_until or loop.time() >= flight.deadline:
                    raise
                # The first caller's shorter deadline ended the shared flight; ours has time left.
            finally:
                left = self._waiting[key] - 1
                if left:
                    self._waiting[key] = left
                else:
                    del self._waiting[key]
                    if not task.done():
                        task.cancel()

    def _finished(self, key, model: str, task: asyncio.Task) -> None:
        # Only a result the cache now holds lingers: without a store to cover there is
        # nothing to gain, and a timer per request is not free.
        if task.cancelled() or task.exception() is not None or self._cache is None or self._bypass.is_bypassed(model):
            self._forget(key, task)
        else:
            asyncio.get_running_loop().call_later(SINGLE_FLIGHT_LINGER_S, self._forget, key, task)

    def _forget(self, key, task: asyncio.Task) -> None:
        if self._running.get(key, (None,))[0] is task:
            del self._running[key]

    async def _resolve(self, flight: "Flight") -> tuple[str, list[TensorData], bool]:
        # The cache to look up and store in, or None: none, or bypassed for this model now.
        cache = self._cache if self._cache is not None and self._bypass.should_use_cache(flight.model) else None
        if cache is not None:
            near = self._near.get(flight.digest)
            if near is not None:
                metrics.CACHE_BY["near_hit"].inc()
                self._bypass.record(flight.model, hit=True)
                return flight.version, near, True
            with tracing.step("router.cache_lookup"):
                cached, generation = await cache.lookup(flight.model, flight.digest, flight.tier)
            self._bypass.record(flight.model, hit=cached is not None)
            if cached is not None:
                self._near.put(flight.digest, cached)
                return flight.version, cached, True
        elif self._cache is not None:
            metrics.CACHE_BY["bypassed"].inc()
            self._bypass.observe(flight.model, flight.digest)
        used, outputs = await self._submit(
            flight.model, flight.requested, flight.inputs, flight.outputs, flight.tier, flight.deadline, flight.tenant
        )
        if cache is not None and used == flight.version:  # an answer from another version is not this key's
            # Under the generation the lookup read: a purge since makes it unreachable, as it should.
            cache.store(flight.model, flight.digest, outputs, generation)
            self._near.put(flight.digest, outputs)
        return used, outputs, False

    async def _submit(
        self,
        model: str,
        version: str,
        inputs: list[TensorData],
        outputs: list[str],
        tier: Tier,
        deadline: float,
        tenant: identity.Tenant,
    ) -> tuple[str, list[TensorData]]:
        now = asyncio.get_running_loop().time()
        remaining = deadline - now
        if remaining <= 0:
            raise errors.DeadlineExceeded(f"request for model '{model}' reached its deadline before it could be queued")
        rows = inputs[0].rows
        self._refuse_if_shed(model, tier, deadline, rows, tenant.name)
        try:
            with tracing.step("router.submit"):
                return await self._batcher.submit(
                    model, version, inputs, outputs, tier, remaining, tenant.name, tenant.weight
                )
        except errors.ResourceExhausted as exc:
            if exc.retry_after_ms:
                # The hint is how long until a place frees, or how much time this request
                # lacked: a request as large then needs about its own time plus the hint.
                self._shedding[(model, tier, tenant.name)] = Shed(
                    now + min(exc.retry_after_ms, MAX_SHED_MS) / 1000,
                    remaining + exc.retry_after_ms / 1000,
                    rows,
                    exc.message,
                )
            raise

    def _refuse_if_shed(self, model: str, tier: Tier, deadline: float, rows: int, tenant: str) -> None:
        """The batcher refused this tier lately, and this request is at least as
        large as the refused one and has no more time than that one would have
        needed: refuse it here, before it costs the batcher anything. A request
        with more time, or fewer rows (the refusal may have been for the size of
        a batch that would not finish in time), still goes through."""
        shed = self._shedding.get((model, tier, tenant))
        if shed is None:
            return
        now = asyncio.get_running_loop().time()
        remaining = deadline - now
        if now >= shed.until or remaining >= shed.needs_s or rows < shed.rows:
            return
        metrics.SHED.labels(tier.label).inc()
        retry_ms = max(10, int(1000 * (shed.until - now)))
        raise errors.ResourceExhausted(
            f"model '{model}' is refusing {tier.label} requests of {shed.rows} row(s) or more "
            f"that cannot wait about {1000 * shed.needs_s:.0f} ms (this one: {rows} row(s), {1000 * remaining:.0f} "
            f"ms left) for about {retry_ms} ms more, after the batcher refused one so: {shed.reason}; retry after "
            f"about {retry_ms} ms",
            retry_after_ms=retry_ms,
        )


@dataclasses.dataclass(frozen=True)
class Shed:
    """A refusal of the batcher, with a retry hint, that the router repeats by
    itself for a while to requests that would get it too."""

    until: float  # loop time
    needs_s: float  # the time a request must be able to wait to be worth sending meanwhile
    rows: int  # of the refused request: a smaller one may fit where it did not
    reason: str  # the batcher's message


@dataclasses.dataclass(frozen=True)
class Flight:
    """One computation that identical requests may share."""

    digest: bytes
    model: str
    version: str  # the version the digest names: the one asked for, or the newest ready one
    inputs: list[TensorData]
    outputs: list[str]
    tier: Tier
    deadline: float  # loop time, the batcher's (a little before the caller's)
    # What goes downstream: the caller's own choice, so a request that named no
    # version is answered by whichever version serves when it runs (during a
    # swap, the catalog here may be a moment behind the model servers).
    requested: str = ""
    tenant: identity.Tenant = ANONYMOUS_STANDARD  # its first caller's: whose share at the batcher it takes


def _rows_asked(request: InferRequest) -> int:
    """The rows a request asks for, as its shapes say before validation (at least 1)."""
    shape = request.inputs[0].shape if request.inputs else ()
    return max(1, shape[0]) if shape else 1


def validate(sig: ModelSignature, request: InferRequest, limits: RequestLimits | None = None) -> list[TensorData]:
    """Checks a request against the model's signature; returns its inputs in the
    model's order. Every error names the field, the value and the model."""
    ordered = check_signature(sig, request)
    check_contents(sig, ordered, limits or RequestLimits())
    return ordered


async def validated(sig: ModelSignature, request: InferRequest, limits: RequestLimits) -> list[TensorData]:
    """validate, with the walk of many BYTES elements in a thread."""
    with tracing.step("router.validate"):
        ordered = check_signature(sig, request)
        if bytes_elements(ordered) > INLINE_ELEMENTS:
            await asyncio.to_thread(check_contents, sig, ordered, limits)
        else:
            check_contents(sig, ordered, limits)
    return ordered


def check_contents(sig: ModelSignature, ordered: list[TensorData], limits: RequestLimits) -> None:
    """Checks each input's data against its shape (check_signature passed):
    as many bytes as the shape needs, or exactly its count of BYTES elements,
    each of at most max_text_bytes. Costs the shape's element count at most."""
    for spec, tensor in zip(sig.inputs, ordered, strict=True):
        check_tensor_data(tensor, _where(spec, sig.name), limits.max_text_bytes)


def check_signature(sig: ModelSignature, request: InferRequest) -> list[TensorData]:
    """The checks of validate that cost a step per input, not per element:
    names, datatypes, shapes and outputs; returns the inputs in the model's order."""
    model = sig.name
    by_name: dict[str, TensorData] = {tensor.name: tensor for tensor in request.inputs}
    if len(by_name) != len(request.inputs) or by_name.keys() != sig.input_names:
        _check_input_names(sig, request.inputs, by_name)
    rows = None
    ordered = []
    for spec in sig.inputs:
        tensor = by_name[spec.name]
        if tensor.datatype != spec.datatype:
            raise errors.InvalidArgument(
                f"{_where(spec, model)} has datatype {errors.shown(tensor.datatype)}; expected {spec.datatype}"
            )
        shape = tensor.shape
        if (
            len(shape) != len(spec.shape)
            or any(d < 0 for d in shape)
            or any(want != -1 and got != want for got, want in zip(shape[1:], spec.shape[1:], strict=True))
        ):
            _shape_error(spec, model, list(shape))
        batch = shape[0]
        if batch == 0:
            raise errors.InvalidArgument(f"{_where(spec, model)} has shape {list(shape)}: the batch dimension is 0")
        if batch > sig.max_batch_size:
            raise errors.InvalidArgument(
                f"{_where(spec, model)} has shape {list(shape)}: batch of {batch} exceeds "
                f"max_batch_size {sig.max_batch_size}"
            )
        if rows is not None and batch != rows:
            raise errors.InvalidArgument(
                f"{_where(spec, model)} has batch dimension {batch} but another input has {rows}"
            )
        rows = batch
        ordered.append(tensor)
    if request.outputs:
        known = sig.output_names
        unknown = [name for name in request.outputs if name not in known]
        if unknown:
            raise errors.InvalidArgument(
                f"requested output(s) {errors.shown_list(unknown)} do not exist in model "
                f"'{model}'; outputs: {sorted(known)}"
            )
        if len(set(request.outputs)) != len(request.outputs):
            raise errors.InvalidArgument(f"requested outputs {errors.shown_list(request.outputs)} name an output twice")
    return ordered


def _where(spec: Spec, model: str) -> str:
    return f"input '{spec.name}' of model '{model}'"


def _check_input_names(sig: ModelSignature, inputs: list[TensorData], by_name: dict[str, TensorData]) -> None:
    """Raises for an input given twice, one the model does not take, or one missing."""
    model = sig.name
    seen = set()
    for tensor in inputs:
        if tensor.name in seen:
            raise errors.InvalidArgument(
                f"input {errors.shown(tensor.name)} appears twice in the request for model '{model}'"
            )
        seen.add(tensor.name)
    expected = sig.input_names
    unexpected = sorted(set(by_name) - expected)
    if unexpected:
        raise errors.InvalidArgument(
            f"unexpected input(s) {errors.shown_list(unexpected)} for model '{model}'; it takes {sorted(expected)}"
        )
    missing = sorted(expected - set(by_name))
    raise errors.InvalidArgument(f"missing input(s) {missing} for model '{model}'; it takes {sorted(expected)}")


def _shape_error(spec: Spec, model: str, shape: list[int]) -> None:
    where = _where(spec, model)
    if any(d < 0 for d in shape):
        raise errors.InvalidArgument(f"{where} has shape {shape} with a negative dimension")
    if len(shape) != len(spec.shape):
        raise errors.InvalidArgument(
            f"{where} has shape {shape}; expected {len(spec.shape)} dimension(s) like {list(spec.shape)}"
        )
    for axis, (got, want) in enumerate(zip(shape[1:], spec.shape[1:], strict=True), start=1):
        if want != -1 and got != want:
            raise errors.InvalidArgument(
                f"{where} has shape {shape}; dimension {axis} must be {want}, expected {list(spec.shape)}"
            )


# (model, version, outputs, revision) -> hashed so far
_DIGEST_PREFIXES: dict[tuple[str, str, tuple[str, ...], str], hashlib.blake2b] = {}
_DIGEST_HEADS: dict[tuple, bytes] = {}  # (name, datatype, shape) -> its framed header
_DIGEST_MEMO_ENTRIES = 4096  # both are cleared when full: their keys come from validated requests, so are few


def request_digest(model: str, version: str, inputs: list[TensorData], outputs: list[str], revision: str = "") -> bytes:
    """128-bit BLAKE2b of everything that decides the answer: model, version
    and the revision of its files, each input's name, datatype, shape and
    bytes, and the outputs asked for."""
    key = (model, version, tuple(outputs), revision)
    prefix = _DIGEST_PREFIXES.get(key)
    if prefix is None:
        if len(_DIGEST_PREFIXES) >= _DIGEST_MEMO_ENTRIES:
            _DIGEST_PREFIXES.clear()
        prefix = _DIGEST_PREFIXES[key] = hashlib.blake2b(digest_size=16, person=b"infermesh-v1")
        for part in (model, version, ",".join(outputs), revision):
            prefix.update(len(part).to_bytes(4, "little") + part.encode())
    h = prefix.copy()
    for tensor in inputs:
        head_key = (tensor.name, tensor.datatype, tensor.shape)
        head = _DIGEST_HEADS.get(head_key)
        if head is None:
            if len(_DIGEST_HEADS) >= _DIGEST_MEMO_ENTRIES:
                _DIGEST_HEADS.clear()
            text = f"{tensor.name}|{tensor.datatype}|{','.join(map(str, tensor.shape))}".encode()
            head = _DIGEST_HEADS[head_key] = len(text).to_bytes(4, "little") + text
        h.update(head)
        h.update(len(tensor.data).to_bytes(8, "little"))
        h.update(tensor.data)
    return h.digest()
