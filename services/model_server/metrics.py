"""The model server's Prometheus metrics."""

import contextlib
import time

import prometheus_client

from services.common.latency import size_class

INFERENCE_LATENCY = prometheus_client.Histogram(
    "infermesh_model_inference_duration_seconds",
    "Time to run one batch on the model, by model, version and batch size (rounded up to a power of two).",
    ["model", "version", "batch"],
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
    ["model"],
    buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
)
QUEUED = prometheus_client.Gauge(
    "infermesh_model_queued_batches",
    "Batches waiting for a free session instance, by model and version: the model server's own queue, "
    "which the Kubernetes autoscaler reads (mesh/kubernetes).",
    ["model", "version"],
)
SLICED = prometheus_client.Counter(
    "infermesh_model_sliced_batches_total",
    "Batches run in slices (--slice-ms) because batches of a higher tier came lately, by model.",
    ["model"],
)
LENT = prometheus_client.Counter(
    "infermesh_model_lent_batches_total",
    "Standard batches run on an instance reserved for VIP, lent while no VIP batch came lately, by model.",
    ["model"],
)
STEPPED_ASIDE = prometheus_client.Counter(
    "infermesh_model_stepped_aside_total",
    "Times a sliced batch let a waiting batch of a higher tier run between two of its slices, by model.",
    ["model"],
)
SHED = prometheus_client.Counter(
    "infermesh_model_shed_batches_total",
    "Batches refused with RESOURCE_EXHAUSTED because they would have waited past their deadline, by model.",
    ["model"],
)
LATE = prometheus_client.Counter(
    "infermesh_model_late_batches_total",
    "Batches with a deadline that were let run and finished after it: the latency estimates behind "
    "the deadline checks were too optimistic, by model.",
    ["model"],
)
BATCHES = prometheus_client.Counter(
    "infermesh_model_batches_total", "Batches executed, by model and outcome.", ["model", "outcome"]
)
VERSIONS = prometheus_client.Gauge(
    "infermesh_model_versions",
    "Loaded model versions: 1 per version in its state (serving, unready, standby).",
    ["model", "version", "state"],
)
MEMORY = prometheus_client.Gauge(
    "infermesh_model_memory_bytes",
    "Resident memory the process grew by while loading and warming up a version (approximate).",
    ["model", "version"],
)
LOADS = prometheus_client.Counter(
    "infermesh_model_loads_total",
    "Model loads (RPC, poll or startup), by model and outcome: ok, config, file, session, warmup, verification, "
    "error (unexpected: the log has the traceback).",
    ["model", "outcome"],
)
SWAP_SECONDS = prometheus_client.Histogram(
    "infermesh_model_swap_duration_seconds",
    "From a load request to traffic on the model's new versions, by model.",
    ["model"],
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
PROBES = prometheus_client.Counter(
    "infermesh_model_probes_total",
    "Periodic correctness probes, by model, version and outcome (pass, fail).",
    ["model", "version", "outcome"],
)
GPU_UTILIZATION = prometheus_client.Gauge(
    "infermesh_gpu_utilization_ratio", "GPU busy share over NVML's last sample period, by device.", ["device"]
)
GPU_MEMORY = prometheus_client.Gauge(
    "infermesh_gpu_memory_used_bytes", "GPU memory in use, by device (NVML).", ["device"]
)


def batch_label(rows: int) -> str:
    """The batch size as a label with few values (its size class)."""
    return str(size_class(rows))


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
    INFERENCE_LATENCY.labels(model, version["v"], batch_label(rows)).observe(time.perf_counter() - started)
