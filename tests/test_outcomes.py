"""Outcome lines (services.common.outcomes) as the router writes them: one JSON
document per kept outcome with its ids and steps, bounded per reason however
hard callers push, and caller-sent values cut short."""

import asyncio
import io
import json

import numpy as np
import prometheus_client
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.openmetrics import exposition as openmetrics

from services.common import errors, tracing
from services.common.outcomes import MAX_FIELD_CHARS, OutcomeLog, OutcomeSettings
from services.common.tensors import from_numpy
from services.router.core import Catalog, InferRequest, Router, RouterSettings
from tests.test_router_validation import MLP

pytestmark = pytest.mark.unit

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Batcher:
    """Answers after `delay_s`, or refuses every request with `refusal`."""

    def __init__(self, delay_s: float = 0.0, refusal: errors.InfermeshError | None = None):
        self.delay_s, self.refusal = delay_s, refusal

    async def submit(self, model, version, inputs, outputs, tier, timeout_s, tenant="", weight=1.0):
        await asyncio.sleep(self.delay_s)
        if self.refusal is not None:
            raise self.refusal
        return "1", [from_numpy("OUTPUT0", np.ones((1, 64), np.float32))]


def router_writing_to(stream: io.StringIO, batcher, **settings) -> Router:
    catalog = Catalog()
    catalog.replace([MLP])
    router = Router(catalog, batcher, cache=None, settings=RouterSettings(outcome_log=OutcomeSettings(**settings)))
    router._outcomes = OutcomeLog("router", router._outcomes.settings, stream)
    return router


def request(i: int = 0, **fields) -> InferRequest:
    inputs = [from_numpy("INPUT0", np.full((1, 64), i, np.float32))]
    return InferRequest(**{"model": "mlp", "version": "", "id": f"req-{i}", "inputs": inputs, "outputs": [], **fields})


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


async def test_a_refusal_is_one_line_with_its_ids_status_and_steps():
    stream = io.StringIO()
    router = router_writing_to(stream, Batcher(refusal=errors.ResourceExhausted("queue full", retry_after_ms=5)))
    with pytest.raises(errors.ResourceExhausted):
        await router.infer(request(7, traceparent=TRACEPARENT, timeout_s=5))
    (line,) = lines(stream)
    assert line["reason"] == line["status"] == "RESOURCE_EXHAUSTED"
    assert line["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736" and not line["traced"]  # tracing is off here
    assert line["request_id"] == "req-7" and line["model"] == "mlp" and line["tier"] == "standard"
    assert line["service"] == "router" and "queue full" in line["message"] and line["latency_ms"] >= 0
    assert set(line["steps_ms"]) == {"router.validate", "router.submit"}


async def test_a_slow_success_is_kept_and_a_fast_one_is_not():
    stream = io.StringIO()
    router = router_writing_to(stream, Batcher(delay_s=0.05), slow_s=0.03, success_ratio=0.0)
    await router.infer(request(1, timeout_s=5))
    router._outcomes.settings = OutcomeSettings(slow_s=10, success_ratio=0.0)
    await router.infer(request(2, timeout_s=5))
    (line,) = lines(stream)
    assert line["reason"] == "slow" and line["status"] == "OK" and line["request_id"] == "req-1"
    assert line["steps_ms"]["router.submit"] >= 40 and line["cached"] is False


async def test_a_flood_of_refusals_writes_its_allowance_and_counts_the_rest():
    """However many requests fail, a reason writes lines_per_s lines a second, and
    each line says how many of its reason's were left out before it: every outcome is
    either written or counted."""
    stream = io.StringIO()
    router = router_writing_to(stream, Batcher(refusal=errors.Unavailable("no replica")), lines_per_s=5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    for i in range(500):
        with pytest.raises(errors.Unavailable):
            await router.infer(request(i, timeout_s=5))
    elapsed_s = loop.time() - started
    assert len(lines(stream)) <= 5 + 5 * elapsed_s + 1  # the banked second, and what refilled meanwhile
    await asyncio.sleep(0.25)  # a token comes back
    with pytest.raises(errors.Unavailable):
        await router.infer(request(999, timeout_s=5))
    written = lines(stream)
    assert written[-1]["request_id"] == "req-999" and written[-1]["suppressed_before"] > 0
    assert len(written) + sum(line.get("suppressed_before", 0) for line in written) == 501


async def test_a_hostile_model_name_and_request_id_are_cut_short():
    stream = io.StringIO()
    router = router_writing_to(stream, Batcher())
    with pytest.raises(errors.NotFound):
        await router.infer(request(0, model="m" * 100_000, id="i" * 100_000))
    (line,) = lines(stream)
    assert line["status"] == "NOT_FOUND"
    assert len(line["model"]) <= MAX_FIELD_CHARS + 3 and len(line["request_id"]) <= MAX_FIELD_CHARS + 3
    assert len(line["message"]) < 2000


async def test_a_traced_request_names_its_own_trace_and_its_latency_carries_an_exemplar():
    exporter = InMemorySpanExporter()
    tracing.configure("infermesh-router", tracing.TracingConfig(trace_ratio=1.0), exporter=exporter)
    try:
        stream = io.StringIO()
        router = router_writing_to(stream, Batcher(refusal=errors.Unavailable("no replica")))
        with pytest.raises(errors.Unavailable):
            await router.infer(request(3, traceparent=TRACEPARENT, timeout_s=5))
    finally:
        tracing.shutdown()
    (line,) = lines(stream)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert line["traced"] and line["trace_id"] == f"{spans['router.infer'].context.trace_id:032x}"
    assert spans["router.submit"].parent.span_id == spans["router.infer"].context.span_id
    assert spans["router.infer"].status.status_code.name == "ERROR"
    # The latency histogram's bucket carries the trace id as an exemplar (OpenMetrics only).
    exposed = openmetrics.generate_latest(prometheus_client.REGISTRY).decode()
    assert f'# {{trace_id="{line["trace_id"]}"}}' in exposed


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"slow_s": 0}, "slow request threshold must be > 0 s, got 0"),
        ({"success_ratio": 2}, "success ratio must be within 0..1, got 2"),
        ({"lines_per_s": -1}, "outcome lines per second must be >= 0, got -1"),
    ],
)
def test_settings_checks_name_the_value(fields, message):
    with pytest.raises(ValueError, match=message):
        OutcomeSettings(**fields)
