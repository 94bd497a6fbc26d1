"""Traces: OpenTelemetry spans of each request's costly steps, exported over OTLP.

Off until `configure` is given an OTLP endpoint: every hook then costs one
global check. The context travels in W3C `traceparent` form, in gRPC metadata
on unary calls and in a field of each message on the multiplexed streams, so
that each request of a stream keeps its own trace. Only sampled contexts are
passed on: a service makes spans only for a request whose parent was sampled
(parent-based); a trace that starts at the router is sampled at `trace_ratio`.

A request's span is the current one of its task (`CURRENT`); `step` times a
child of it. Work timed elsewhere (a queue wait, a thread's run) is recorded
afterwards with its own start and end (`record`).
"""

import contextlib
import contextvars
import dataclasses
import logging
import os
import random
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from services.common.bucket import TokenBucket
from services.common.config import require

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"  # the W3C header, and the metadata key on gRPC calls
_TRACEPARENT_LENGTH = 55  # version 00: 2 + 1 + 32 + 1 + 16 + 1 + 2
_HEX = frozenset("0123456789abcdef")
MAX_ATTRIBUTE_CHARS = 256
MAX_LINKS = 256  # a batch span links to each traced request it serves: a frame holds at most 256


@dataclasses.dataclass(frozen=True)
class TracingConfig:
    """Where spans go and how many are kept; every service takes the same flags."""

    # host:port of an OTLP/gRPC collector (Jaeger's, or the cluster's); "" turns tracing off
    otlp_endpoint: str = dataclasses.field(
        default="", metadata={"help": "OTLP/gRPC endpoint (host:port) that spans are sent to; empty: no tracing"}
    )
    # The share of traces sampled where they start (the router); parent-based after that.
    trace_ratio: float = dataclasses.field(
        default=0.01, metadata={"help": "share of traces started here that are sampled, 0..1"}
    )
    # A caller's own sampled traceparent is honoured at most this often: forcing every
    # request to be traced is a cost a caller must not impose on the mesh without bound.
    caller_traces_per_s: float = dataclasses.field(
        default=100.0, metadata={"help": "at most this many caller-sampled traces per second are kept"}
    )

    def __post_init__(self):
        require(0.0 <= self.trace_ratio <= 1.0, f"trace_ratio must be within 0..1, got {self.trace_ratio}")
        require(self.caller_traces_per_s >= 0, f"caller_traces_per_s must be >= 0, got {self.caller_traces_per_s}")
        host, _, port = self.otlp_endpoint.rpartition(":")
        require(
            not self.otlp_endpoint or (bool(host) and port.isdigit()),
            f"otlp_endpoint must be host:port, got {self.otlp_endpoint!r}",
        )


# The current request's span in this task (an OpenTelemetry Span), None when it is not traced.
CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("infermesh_span", default=None)

_tracer: Any = None  # an opentelemetry Tracer once configured
_provider: Any = None
_api: Any = None  # the opentelemetry.trace module, imported by configure
_ratio = 0.0
_caller_bucket: TokenBucket | None = None


def configure(service: str, config: TracingConfig, exporter: Any = None) -> None:
    """Starts exporting this process's spans as `service` over OTLP, or to
    `exporter` (a SpanExporter: the tests' in-memory one); nothing when there
    is neither an endpoint nor an exporter."""
    global _tracer, _provider, _api, _ratio, _caller_bucket
    if not config.otlp_endpoint and exporter is None:
        return
    # Imported here: a mesh without tracing never loads the SDK or its exporter.
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    resource = Resource.create(
        {"service.name": service, "service.instance.id": f"{socket.gethostname()}:{os.getpid()}"}
    )
    # Every span this process makes is of a sampled trace (the decision is made
    # before a span is made, below), so the SDK's own sampler keeps them all.
    # Attribute values are cut at MAX_ATTRIBUTE_CHARS: some (a model's name) come from callers.
    limits = SpanLimits(max_attribute_length=MAX_ATTRIBUTE_CHARS, max_links=MAX_LINKS)
    _provider = TracerProvider(resource=resource, sampler=ALWAYS_ON, span_limits=limits)
    if exporter is not None:
        _provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        # The processor's queue is bounded (2048 spans by default): when the collector
        # is slow or gone, spans are dropped, never held without bound.
        _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_endpoint, insecure=True)))
    _tracer = _provider.get_tracer("infermesh")
    _api = trace
    _ratio = config.trace_ratio
    _caller_bucket = TokenBucket(config.caller_traces_per_s, config.caller_traces_per_s)
    log.info("tracing to %s, %.3g of new traces sampled", config.otlp_endpoint or exporter, _ratio)


def shutdown() -> None:
    """Sends what is buffered and stops the exporter."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def is_on() -> bool:
    return _tracer is not None


def _fields(traceparent: str) -> tuple[str, str, str] | None:
    """(trace id, parent id, flags) of a well-formed traceparent, else None; its
    length is checked before anything is walked."""
    if len(traceparent) != _TRACEPARENT_LENGTH or traceparent[2] != "-" or traceparent[35] != "-":
        return None
    if traceparent[52] != "-" or traceparent[:2] == "ff" or not _HEX.issuperset(traceparent.replace("-", "")):
        return None
    trace_id, span_id = traceparent[3:35], traceparent[36:52]
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return trace_id, span_id, traceparent[53:]


def parse(traceparent: str) -> Any:
    """The sampled remote SpanContext a traceparent names, else None: absent,
    malformed (ignored, as W3C asks), or not sampled."""
    fields = _fields(traceparent)
    if fields is None or not int(fields[2], 16) & 1 or _api is None:
        return None
    trace, span = int(fields[0], 16), int(fields[1], 16)
    return _api.SpanContext(trace, span, is_remote=True, trace_flags=_api.TraceFlags(_api.TraceFlags.SAMPLED))


def format_traceparent(span_context) -> str:
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-01"


def current_traceparent() -> str:
    """The traceparent of this task's current span, "" when it is not traced."""
    span = CURRENT.get()
    return "" if span is None else format_traceparent(span.get_span_context())


def metadata() -> tuple[tuple[str, str], ...]:
    """gRPC metadata that carries the current span's context, if any."""
    span = CURRENT.get()
    return () if span is None else ((TRACEPARENT, format_traceparent(span.get_span_context())),)


def _span_context(span_or_context) -> Any:
    """The SpanContext of a Span, or the SpanContext given."""
    return span_or_context.get_span_context() if hasattr(span_or_context, "get_span_context") else span_or_context


def _context_of(parent) -> Any:
    """An OpenTelemetry Context whose span is `parent` (a SpanContext), for a child's start."""
    return _api.set_span_in_context(_api.NonRecordingSpan(parent)) if parent is not None else None


def start_request(
    name: str, traceparent: str = "", attributes: Mapping[str, Any] | None = None, *, root: bool = False
) -> Any:
    """A request's span as it enters this service, or None when it is not
    traced. A sampled `traceparent` is its parent; where traces start
    (`root`: the router), one without is sampled at trace_ratio, and a
    caller's sampled one is honoured within caller_traces_per_s."""
    if _tracer is None:
        return None
    parent = parse(traceparent) if traceparent else None
    if root:
        if parent is not None:
            if _caller_bucket is not None and not _caller_bucket.take():
                return None
        elif not _ratio or random.random() >= _ratio:
            return None
    elif parent is None:
        return None
    return _tracer.start_span(name, context=_context_of(parent), kind=_api.SpanKind.SERVER, attributes=attributes)


def start_child(parent, name: str, attributes: Mapping[str, Any] | None = None, links: Sequence[Any] = ()) -> Any:
    """A span under `parent` (a Span or a SpanContext), started now."""
    return _tracer.start_span(
        name, context=_context_of(_span_context(parent)), attributes=attributes, links=_links(links)
    )


def _links(contexts: Sequence[Any]) -> list[Any]:
    if not contexts:
        return []
    return [_api.Link(_span_context(c)) for c in contexts]


def end(span, error: str = "") -> None:
    """Ends `span`; an `error` (a gRPC status name) marks it failed."""
    if span is None:
        return
    if error and error != "OK":
        span.set_status(_api.Status(_api.StatusCode.ERROR, error))
    if error:
        span.set_attribute("rpc.grpc.status", error)
    span.end()


def record(
    parent, name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None, links=()
) -> None:
    """A finished span under `parent` (a Span or a SpanContext) that ran from start_ns to end_ns (time.time_ns)."""
    if _tracer is None or parent is None:
        return
    span = _tracer.start_span(
        name,
        context=_context_of(_span_context(parent)),
        attributes=attributes,
        links=_links(links),
        start_time=start_ns,
    )
    span.end(end_time=end_ns)


# The current request's step durations in seconds by step name, where its service logs
# its outcome (outcomes.py): filled by `step` whether or not the request is traced.
TIMINGS: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("infermesh_timings", default=None)


class _Step:
    """A child span of the current one, current itself inside its block (so that a
    call made there carries it), and its duration added to the request's timings."""

    __slots__ = ("attributes", "name", "parent", "span", "start_ns", "timings", "token")

    def __init__(self, parent, name: str, attributes, timings: dict[str, float] | None):
        self.parent, self.name, self.attributes, self.timings = parent, name, attributes, timings
        self.span: Any = None
        self.token: contextvars.Token[Any] | None = None

    def __enter__(self):
        self.start_ns = time.time_ns()
        if self.parent is not None:
            self.span = _tracer.start_span(
                self.name, context=_context_of(self.parent.get_span_context()), attributes=self.attributes
            )
            self.token = CURRENT.set(self.span)
        return self

    def __exit__(self, kind, exc, traceback):
        end_ns = time.time_ns()
        if self.timings is not None:
            self.timings[self.name] = self.timings.get(self.name, 0.0) + (end_ns - self.start_ns) / 1e9
        if self.span is not None and self.token is not None:
            CURRENT.reset(self.token)
            if exc is not None:
                self.span.set_status(_api.Status(_api.StatusCode.ERROR, getattr(exc, "code_name", kind.__name__)))
            self.span.end(end_time=end_ns)
        return False


_NO_STEP = contextlib.nullcontext()


def step(name: str, attributes: Mapping[str, Any] | None = None):
    """Times a child of the current span over a `with` block, and adds its
    duration to the request's TIMINGS; nothing when there is neither."""
    span, timings = CURRENT.get(), TIMINGS.get()
    return _NO_STEP if span is None and timings is None else _Step(span, name, attributes, timings)


def trace_id(traceparent: str) -> str:
    """The trace id (32 hex digits) a well-formed traceparent names, sampled or not; "" otherwise."""
    fields = _fields(traceparent)
    return "" if fields is None else fields[0]


def activate(span) -> contextvars.Token[Any] | None:
    """Makes `span` this task's current one (None: nothing); hand the token to finish()."""
    return None if span is None else CURRENT.set(span)


def finish(span, token: contextvars.Token[Any] | None, status: str) -> None:
    """Undoes activate() and ends `span` with a gRPC status name (see end)."""
    if token is not None:
        CURRENT.reset(token)
        end(span, status)


@contextlib.contextmanager
def current(span) -> Iterator[None]:
    """Makes `span` the current one of this task for the block (None: leaves things as they are)."""
    token = activate(span)
    try:
        yield
    finally:
        if token is not None:
            CURRENT.reset(token)


def wall_ns(loop_time: float, now_loop: float, now_ns: int) -> int:
    """An event-loop time (loop.time()) as time.time_ns, given one moment read on both clocks."""
    return now_ns - int((now_loop - loop_time) * 1e9)
