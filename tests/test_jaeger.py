"""The tests' trace backend (tests/jaeger.py): a real Jaeger v2 takes spans over OTLP/gRPC
(through the OpenTelemetry SDK, as the services send them) and OTLP/HTTP, gives each trace
back with its parents, links and attributes intact, and listens on loopback only, on the
ports it was given and no others."""

import json
import os
import secrets
import socket
import urllib.request

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

from tests.jaeger import Link, jaeger  # noqa: F401 - the fixture

pytestmark = pytest.mark.service


class _KnownTraceIds(RandomIdGenerator):
    """Gives each new trace the next of `trace_ids`; span ids stay random."""

    def __init__(self, *trace_ids: int):
        self._trace_ids = iter(trace_ids)

    def generate_trace_id(self) -> int:
        return next(self._trace_ids)


def test_a_trace_sent_through_the_sdk_over_otlp_grpc_comes_back_whole(jaeger):
    request_trace, batch_trace = secrets.randbits(128), secrets.randbits(128)
    provider = TracerProvider(
        resource=Resource.create({"service.name": "router"}), id_generator=_KnownTraceIds(request_trace, batch_trace)
    )
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=jaeger.otlp_grpc_endpoint, insecure=True))
    )
    tracer = provider.get_tracer(__name__)
    with tracer.start_as_current_span("ModelInfer", kind=otel_trace.SpanKind.SERVER) as infer:
        infer.set_attributes({"model": "minilm", "batch.size": 3, "cache.hit": False, "score": 0.5, "tags": ["a", "b"]})
        with tracer.start_as_current_span("batcher.enqueue", kind=otel_trace.SpanKind.CLIENT) as enqueue:
            pass
    # A batch span in a trace of its own, linked to the request it carries.
    request = enqueue.get_span_context()
    with tracer.start_as_current_span("batch", links=[otel_trace.Link(request, {"request.id": "r-1"})]) as batch:
        batch.set_status(otel_trace.StatusCode.ERROR, "model failed")
    provider.shutdown()

    spans = {s.name: s for s in jaeger.trace(f"{request_trace:032x}", min_spans=2)}
    assert set(spans) == {"ModelInfer", "batcher.enqueue"}
    root, child = spans["ModelInfer"], spans["batcher.enqueue"]
    assert root.parent_span_id is None
    assert root.span_id == f"{infer.get_span_context().span_id:016x}"
    assert (child.span_id, child.parent_span_id) == (f"{request.span_id:016x}", root.span_id)
    assert (root.service, root.kind, child.kind) == ("router", "SERVER", "CLIENT")
    assert root.attributes == {"model": "minilm", "batch.size": 3, "cache.hit": False, "score": 0.5, "tags": ["a", "b"]}

    (batch_span,) = jaeger.trace(f"{batch_trace:032x}")
    assert batch_span.name == "batch"
    assert batch_span.parent_span_id is None
    assert batch_span.status == "ERROR"
    assert batch_span.links == (Link(f"{request_trace:032x}", child.span_id, {"request.id": "r-1"}),)


def test_a_trace_posted_as_otlp_json_over_http_comes_back_whole(jaeger):
    trace_id, root_id, child_id, linked_id = secrets.token_hex(16), *(secrets.token_hex(8) for _ in range(3))
    other_trace = secrets.token_hex(16)

    def span(span_id, name, **fields):
        return {
            "traceId": trace_id,
            "spanId": span_id,
            "name": name,
            "kind": 1,
            "startTimeUnixNano": "1",
            "endTimeUnixNano": "2",
        } | fields

    body = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "batcher"}}]},
                "scopeSpans": [
                    {
                        "scope": {"name": "tests"},
                        "spans": [
                            span(root_id, "Execute"),
                            span(
                                child_id,
                                "model_server.run",
                                parentSpanId=root_id,
                                attributes=[{"key": "rows", "value": {"intValue": "4"}}],
                                links=[{"traceId": other_trace, "spanId": linked_id}],
                            ),
                        ],
                    }
                ],
            }
        ]
    }
    request = urllib.request.Request(
        f"{jaeger.otlp_http_endpoint}/v1/traces",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200

    spans = {s.name: s for s in jaeger.trace(trace_id, min_spans=2)}
    assert (spans["Execute"].span_id, spans["Execute"].parent_span_id) == (root_id, None)
    child = spans["model_server.run"]
    assert (child.span_id, child.parent_span_id, child.service) == (child_id, root_id, "batcher")
    assert child.attributes == {"rows": 4}
    assert child.links == (Link(other_trace, linked_id, {}),)


def test_trace_refuses_a_malformed_trace_id(jaeger):
    with pytest.raises(ValueError, match="32 lowercase hex digits"):
        jaeger.trace("not-a-trace-id")


def _address(hex_address: str) -> str:
    """A /proc/net address (each 32-bit word in host order, little-endian here) as text."""
    packed = b"".join(bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8))
    return socket.inet_ntop(socket.AF_INET if len(packed) == 4 else socket.AF_INET6, packed)


def _bound_sockets(pid: int) -> set[tuple[str, str, int]]:
    """(protocol, address, port) of every TCP socket in LISTEN and every UDP socket the process holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed while we looked
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    bound = set()
    for table in ("tcp", "tcp6", "udp", "udp6"):
        with open(f"/proc/{pid}/net/{table}") as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if inode in inodes and (table.startswith("udp") or state == "0A"):
                    address, port = local.split(":")
                    bound.add((table.rstrip("6"), _address(address), int(port, 16)))
    return bound


def test_jaeger_listens_on_loopback_only_and_only_on_its_ports(jaeger):
    bound = _bound_sockets(jaeger.process.pid)
    assert bound == {("tcp", "127.0.0.1", port) for port in jaeger.ports.values()}, jaeger.ports
