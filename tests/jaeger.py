"""A real Jaeger v2 for the tests: bin/jaeger (built by `make setup` from tools/jaeger)
with tools/jaeger/config.yaml, on free loopback ports, spans kept in memory; `trace()`
reads a trace back through the query API as the spans that were sent."""

import base64
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BINARY = ROOT / "bin" / "jaeger"
CONFIG = ROOT / "tools" / "jaeger" / "config.yaml"
# The environment variable that sets each listener's port (tools/jaeger/config.yaml).
PORT_VARIABLES = {
    "otlp_grpc": "INFERMESH_JAEGER_OTLP_GRPC_PORT",
    "otlp_http": "INFERMESH_JAEGER_OTLP_HTTP_PORT",
    "query_http": "INFERMESH_JAEGER_QUERY_HTTP_PORT",
    "query_grpc": "INFERMESH_JAEGER_QUERY_GRPC_PORT",
    "health": "INFERMESH_JAEGER_HEALTH_PORT",
}
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


def _free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports (held together while chosen, so none repeats)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


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


class Jaeger:
    """`with Jaeger() as jaeger:` runs bin/jaeger until the block ends; spans sent to
    jaeger.otlp_grpc_endpoint ("127.0.0.1:port") or jaeger.otlp_http_endpoint
    ("http://127.0.0.1:port", traces at /v1/traces) come back from jaeger.trace()."""

    def __enter__(self):
        if not BINARY.exists():
            raise RuntimeError(f"{BINARY} is missing: run `make setup`")
        self._stack = contextlib.ExitStack()
        try:
            self._begin()
        except BaseException:  # a server that started must not outlive a failed start
            self._stack.close()
            raise
        return self

    def _begin(self) -> None:
        self.dir = pathlib.Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="jaeger-")))
        self.ports = dict(zip(PORT_VARIABLES, _free_ports(len(PORT_VARIABLES)), strict=True))
        self.otlp_grpc_endpoint = f"127.0.0.1:{self.ports['otlp_grpc']}"
        self.otlp_http_endpoint = f"http://127.0.0.1:{self.ports['otlp_http']}"
        self.query_url = f"http://127.0.0.1:{self.ports['query_http']}"
        self.log_path = self.dir / "jaeger.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed by the stack, after the process
        self._stack.callback(log.close)
        environment = os.environ | {PORT_VARIABLES[name]: str(port) for name, port in self.ports.items()}
        self.process = subprocess.Popen(
            [str(BINARY), "--config", str(CONFIG)], stdout=log, stderr=subprocess.STDOUT, cwd=self.dir, env=environment
        )
        self._stack.callback(self._stop)
        self._wait_ready()

    def _stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"jaeger exited with status {self.process.returncode}:\n{self.log_tail()}")

    def _wait_ready(self, timeout_s: float = 60.0) -> None:
        """Returns once the health check says every pipeline has started."""
        url = f"http://127.0.0.1:{self.ports['health']}/status"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:  # not listening yet, or 503 while it starts
                pass
            time.sleep(0.1)
        raise RuntimeError(f"jaeger was not ready within {timeout_s:.0f} s:\n{self.log_tail()}")

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

    def __exit__(self, *exc):
        self._stack.close()


@pytest.fixture(scope="session")
def jaeger():
    """One Jaeger for the session (a test reads only its own trace ids); fails, never
    skips, when bin/jaeger has not been built."""
    if not BINARY.exists():
        pytest.fail(f"{BINARY} is missing: run 'make setup' first")
    with Jaeger() as server:
        yield server
