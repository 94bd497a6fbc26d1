"""A real Jaeger v2 for the tests: bin/jaeger (built by `make setup` from tools/jaeger)
with tools/jaeger/config.yaml, on free loopback ports, spans kept in memory; `trace()`
reads a trace back through the query API as the spans that were sent."""

import base64
import dataclasses
import json
import pathlib
import re
import time
import urllib.error
import urllib.request

import pytest

from services.launcher import jaeger as jaeger_process

ROOT = pathlib.Path(__file__).resolve().parent.parent
BINARY = ROOT / jaeger_process.BINARY
# OTLP's enums, by the numbers the query API's JSON gives them.
SPAN_KINDS = ("UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
STATUS_CODES = ("UNSET", "OK", "ERROR")
TRACE_ID = re.compile(r"[0-9a-f]{32}")


@dataclasses.dataclass(frozen=True)
class Link:
    """A span's link to another span (a batch span's to each request it carries)."""

    trace_id: str
    span_id: str
    attributes: dict[str, object]


@dataclasses.dataclass(frozen=True)
class Span:
    """One span as Jaeger stored it; ids are lowercase hex, `parent_span_id` None at a root."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    service: str
    name: str
    kind: str
    status: str
    attributes: dict[str, object]
    links: tuple[Link, ...]


def _value(any_value: dict) -> object:
    """An OTLP AnyValue (its JSON form) as a Python value."""
    if "stringValue" in any_value:
        return any_value["stringValue"]
    if "boolValue" in any_value:
        return any_value["boolValue"]
    if "intValue" in any_value:
        return int(any_value["intValue"])  # an int64 travels as a JSON string
    if "doubleValue" in any_value:
        return float(any_value["doubleValue"])
    if "bytesValue" in any_value:
        return base64.b64decode(any_value["bytesValue"])
    if "arrayValue" in any_value:
        return [_value(v) for v in any_value["arrayValue"].get("values", [])]
    if "kvlistValue" in any_value:
        return _attributes(any_value["kvlistValue"].get("values", []))
    return None


def _attributes(key_values: list[dict]) -> dict[str, object]:
    return {kv["key"]: _value(kv.get("value", {})) for kv in key_values}


def _spans(traces_data: dict) -> list[Span]:
    """The spans of an OTLP TracesData (JSON), each with its resource's service.name."""
    spans = []
    for resource_spans in traces_data.get("resourceSpans", []):
        resource = _attributes(resource_spans.get("resource", {}).get("attributes", []))
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                spans.append(
                    Span(
                        trace_id=span["traceId"],
                        span_id=span["spanId"],
                        parent_span_id=span.get("parentSpanId") or None,
                        service=str(resource.get("service.name", "")),
                        name=span.get("name", ""),
                        kind=SPAN_KINDS[span.get("kind", 0)],
                        status=STATUS_CODES[span.get("status", {}).get("code", 0)],
                        attributes=_attributes(span.get("attributes", [])),
                        links=tuple(
                            Link(link["traceId"], link["spanId"], _attributes(link.get("attributes", [])))
                            for link in span.get("links", [])
                        ),
                    )
                )
    return spans


class Jaeger(jaeger_process.Jaeger):
    """The launcher's Jaeger (services/launcher/jaeger.py) on free ports, and
    trace(): a trace read back through the query API as the spans that were sent."""

    def __init__(self):
        super().__init__(ROOT)

    def trace(self, trace_id_hex: str, timeout_s: float = 10.0, min_spans: int = 1) -> list[Span]:
        """The spans of a trace, polled for until at least `min_spans` of them are stored;
        exactly as received (raw, no adjustments), in no particular order."""
        if not TRACE_ID.fullmatch(trace_id_hex):
            raise ValueError(f"a trace id is 32 lowercase hex digits, got {trace_id_hex!r}")
        url = f"{self.query_url}/api/v3/traces/{trace_id_hex}?raw_traces=true"
        deadline = time.monotonic() + timeout_s
        spans: list[Span] = []
        while True:
            self._check_alive()
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    spans = _spans(json.load(response)["result"])
            except urllib.error.HTTPError as error:
                if error.code != 404:  # 404: nothing of the trace stored yet
                    raise
            if len(spans) >= min_spans:
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"trace {trace_id_hex}: {len(spans)} spans in Jaeger after {timeout_s:.0f} s, "
                    f"wanted at least {min_spans}: {[s.name for s in spans]}"
                )
            time.sleep(0.05)


@pytest.fixture(scope="session")
def jaeger():
    """One Jaeger for the session (a test reads only its own trace ids); fails, never
    skips, when bin/jaeger has not been built."""
    if not BINARY.exists():
        pytest.fail(f"{BINARY} is missing: run 'make setup' first")
    with Jaeger() as server:
        yield server
