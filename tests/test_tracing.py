"""services.common.tracing: W3C trace contexts as callers send them (good and
hostile), sampling where traces start, and spans' parents and links."""

import asyncio
import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import tracing

pytestmark = pytest.mark.unit

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE_ID}-{SPAN_ID}-01"


@pytest.fixture
def spans():
    """Tracing on, into memory, for one test: yields the exporter; off again after."""
    exporter = InMemorySpanExporter()
    yield from _configured(exporter, tracing.TracingConfig(trace_ratio=1.0))


def _configured(exporter, config):
    tracing.configure("infermesh-test", config, exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def test_off_until_configured_and_every_hook_is_free():
    assert not tracing.is_on()
    assert tracing.start_request("router.infer", SAMPLED, root=True) is None
    assert tracing.current_traceparent() == "" and tracing.metadata() == ()
    with tracing.step("router.validate") as step:
        assert step is None  # the shared no-op: nothing was made
    tracing.record(None, "anything", 0, 1)


def test_a_callers_sampled_traceparent_is_the_parent(spans):
    span = tracing.start_request("router.infer", SAMPLED, {"model": "mlp"}, root=True)
    assert span is not None
    with tracing.current(span):
        assert tracing.current_traceparent().startswith(f"00-{TRACE_ID}-")
        with tracing.step("router.validate"):
            pass
    tracing.end(span, "OK")
    finished = {s.name: s for s in spans.get_finished_spans()}
    root, step = finished["router.infer"], finished["router.validate"]
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert f"{root.parent.span_id:016x}" == SPAN_ID and root.parent.is_remote
    assert step.parent.span_id == root.context.span_id and step.context.trace_id == root.context.trace_id
    assert root.attributes["rpc.grpc.status"] == "OK" and root.attributes["model"] == "mlp"


@pytest.mark.parametrize(
    "traceparent",
    [
        f"00-{TRACE_ID}-{SPAN_ID}-00",  # not sampled: no spans here, the caller asked for none
        f"00-{TRACE_ID.upper()}-{SPAN_ID}-01",  # W3C's hex is lower case
        f"ff-{TRACE_ID}-{SPAN_ID}-01",  # version ff is invalid
        f"00-{'0' * 32}-{SPAN_ID}-01",  # all-zero trace id
        f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero parent id
        f"00-{TRACE_ID}-{SPAN_ID}-01-extra",
        f"00_{TRACE_ID}_{SPAN_ID}_01",
        f"00-{TRACE_ID[:-1]}g-{SPAN_ID}-01",
        "00-" + "a" * 16 * 1024 * 1024,  # 16 MiB: refused by its length, before any walk
        "",
    ],
)
def test_a_malformed_or_unsampled_traceparent_is_ignored(spans, traceparent):
    assert tracing.parse(traceparent) is None
    # Below the router, no parent: no span.
    assert tracing.start_request("batcher.submit", traceparent) is None


def test_a_malformed_traceparent_at_the_router_starts_a_trace_of_its_own(spans):
    span = tracing.start_request("router.infer", "00-garbage", root=True)
    assert span is not None and span.parent is None
    tracing.end(span, "OK")


def test_where_traces_start_they_are_sampled_at_the_ratio():
    exporter = InMemorySpanExporter()
    for _ in _configured(exporter, tracing.TracingConfig(trace_ratio=0.0)):
        assert all(tracing.start_request("router.infer", root=True) is None for _ in range(200))
    for _ in _configured(exporter, tracing.TracingConfig(trace_ratio=0.5)):
        kept = [tracing.start_request("router.infer", root=True) for _ in range(2000)]
        assert 800 < sum(span is not None for span in kept) < 1200
        for span in kept:
            tracing.end(span)


def test_callers_cannot_force_every_request_to_be_traced():
    """A caller that marks every request sampled gets caller_traces_per_s of them traced, no more."""
    exporter = InMemorySpanExporter()
    for _ in _configured(exporter, tracing.TracingConfig(trace_ratio=0.0, caller_traces_per_s=5)):
        started = time.monotonic()
        honoured = [tracing.start_request("router.infer", SAMPLED, root=True) for _ in range(1000)]
        elapsed = time.monotonic() - started
        assert sum(span is not None for span in honoured) <= 5 + 5 * elapsed + 1


def test_a_batch_span_links_to_every_request_it_serves(spans):
    requests = [tracing.start_request("batcher.submit", f"00-{i:032x}-{SPAN_ID}-01") for i in range(1, 4)]
    now_ns = time.time_ns()
    for request in requests:
        tracing.record(request, "batcher.queue_wait", now_ns - 1_000_000, now_ns)
    batch = tracing.start_child(requests[0], "batcher.batch", {"batch.requests": 3}, links=requests)
    with tracing.current(batch):
        (key, traceparent) = tracing.metadata()[0]
    tracing.end(batch, "OK")
    for request in requests:
        tracing.end(request, "OK")
    assert key == "traceparent" and tracing.parse(traceparent).span_id == batch.get_span_context().span_id
    finished = spans.get_finished_spans()
    (batch_span,) = [s for s in finished if s.name == "batcher.batch"]
    assert batch_span.parent.span_id == requests[0].get_span_context().span_id
    assert {link.context.trace_id for link in batch_span.links} == {1, 2, 3}
    waits = [s for s in finished if s.name == "batcher.queue_wait"]
    assert len(waits) == 3 and all(s.end_time - s.start_time == 1_000_000 for s in waits)


async def test_the_current_span_is_each_tasks_own(spans):
    """Requests run concurrently on one event loop: each task sees its own span."""

    async def request(i: int) -> str:
        span = tracing.start_request("batcher.submit", f"00-{i:032x}-{SPAN_ID}-01")
        with tracing.current(span):
            await asyncio.sleep(0)
            seen = tracing.current_traceparent()
        tracing.end(span)
        return seen

    seen = await asyncio.gather(*(request(i) for i in range(1, 20)))
    assert [int(t[3:35], 16) for t in seen] == list(range(1, 20))


def test_span_attributes_are_bounded(spans):
    span = tracing.start_request("router.infer", root=True, attributes={"model": "m" * 100_000})
    tracing.end(span)
    (finished,) = spans.get_finished_spans()
    assert len(finished.attributes["model"]) == tracing.MAX_ATTRIBUTE_CHARS


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"trace_ratio": 1.5}, "trace_ratio must be within 0..1, got 1.5"),
        ({"caller_traces_per_s": -1}, "caller_traces_per_s must be >= 0, got -1"),
        ({"otlp_endpoint": "jaeger"}, "otlp_endpoint must be host:port, got 'jaeger'"),
    ],
)
def test_config_checks_name_the_value(fields, message):
    with pytest.raises(ValueError, match=message):
        tracing.TracingConfig(**fields)
