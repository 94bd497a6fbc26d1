"""Prometheus helpers: the per-RPC metrics every service exports, and the HTTP endpoint."""

import prometheus_client

RPC_REQUESTS = prometheus_client.Counter(
    "infermesh_grpc_requests_total",
    "gRPC calls handled, by service, method and status code.",
    ["service", "method", "code"],
)
RPC_LATENCY = prometheus_client.Histogram(
    "infermesh_grpc_request_duration_seconds",
    "Time to handle a gRPC call, by service and method.",
    ["service", "method"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)


class Children(dict):
    """A labelled metric's children by their label values, as a dict that
    fills itself: `CHILDREN[a, b].inc()`. For the per-request paths, where
    prometheus_client's labels() (a lock and checks on every call) costs
    several times the increment; values must be few, as for labels()."""

    def __init__(self, metric):
        super().__init__()
        self.metric = metric

    def __missing__(self, values):
        child = self[values] = self.metric.labels(*(values if isinstance(values, tuple) else (values,)))
        return child


RPC_REQUESTS_BY = Children(RPC_REQUESTS)
RPC_LATENCY_BY = Children(RPC_LATENCY)


def start_metrics_server(host: str, port: int) -> int:
    """Serves /metrics on host:port (0 picks a free port); returns the bound port."""
    server, _thread = prometheus_client.start_http_server(port, addr=host)
    return server.server_address[1]


def scrape(url: str, timeout_s: float = 5.0) -> dict[tuple[str, tuple], float]:
    """Another service's /metrics as {(sample name, sorted label pairs): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=timeout_s).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


HELD_REQUEST_BYTES = prometheus_client.Gauge(
    "infermesh_held_request_bytes",
    "Bytes of the requests a service holds now (its byte budget counts them), by service.",
    ["service"],
)
BUDGET_BYTES = prometheus_client.Gauge(
    "infermesh_request_budget_bytes",
    "The byte budget of the requests a service holds at once, by service.",
    ["service"],
)
BUDGET_REFUSALS = prometheus_client.Counter(
    "infermesh_budget_refusals_total",
    "Requests refused because they would pass the service's byte budget.",
    ["service"],
)
