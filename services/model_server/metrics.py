"""The model server's Prometheus metrics."""

import contextlib
import time

import prometheus_client

INFERENCE_LATENCY = prometheus_client.Histogram(
    "infermesh_model_inference_duration_seconds",
    "Time to run one batch on the model, by model and version.",
    ["model", "version"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
BATCH_ROWS = prometheus_client.Histogram(
    "infermesh_model_batch_rows",
    "Rows per executed batch, by model.",
    ["model"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
PADDING = prometheus_client.Histogram(
    "infermesh_model_padding_fraction",
    "Share of the token positions of a batch that are padding (texts padded to the longest), by model.",
    ["model"], buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9))
BATCHES = prometheus_client.Counter(
    "infermesh_model_batches_total", "Batches executed, by model and outcome.", ["model", "outcome"]
)


@contextlib.contextmanager
def track(model: str, rows: int):
    """Times one batch; the body calls record(version) once it knows the version."""
    started = time.perf_counter()
    version = {"v": ""}
    try:
        yield lambda v: version.__setitem__("v", v)
    except BaseException:
        BATCHES.labels(model, "error").inc()
        raise
    BATCHES.labels(model, "ok").inc()
    BATCH_ROWS.labels(model).observe(rows)
    INFERENCE_LATENCY.labels(model, version["v"]).observe(time.perf_counter() - started)
