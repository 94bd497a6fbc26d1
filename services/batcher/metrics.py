"""The batcher's Prometheus metrics."""

import prometheus_client

QUEUE_LENGTH = prometheus_client.Gauge(
    "infermesh_batcher_queue_length", "Requests waiting, by model and tier.", ["model", "tier"]
)
QUEUE_WAIT = prometheus_client.Histogram(
    "infermesh_batcher_queue_wait_seconds",
    "Time from arrival to batch dispatch, by model and tier.",
    ["model", "tier"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
BATCH_ROWS = prometheus_client.Histogram(
    "infermesh_batcher_batch_size",
    "Rows per dispatched batch, by model.",
    ["model"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
REJECTIONS = prometheus_client.Counter(
    "infermesh_batcher_rejections_total",
    "Requests answered without running, by model, tier and reason "
    "(queue_full, would_miss_deadline, no_time_left, deadline, cancelled).",
    ["model", "tier", "reason"],
)
ABANDONED = prometheus_client.Counter(
    "infermesh_batcher_abandoned_batches_total",
    "Running batches cancelled because every request in them had been cancelled by its caller.",
)
BATCH_TIMEOUTS = prometheus_client.Counter(
    "infermesh_batcher_batch_timeouts_total",
    "Batches sent to a model server that ran out of time there (their requests answered DEADLINE_EXCEEDED): "
    "admission and the refusal for lack of time took the tier's batches to be shorter than this one was, "
    "by model and the batch's tier.",
    ["model", "tier"],
)
INFLIGHT = prometheus_client.Gauge("infermesh_batcher_inflight_batches", "Batches in flight, by replica.", ["replica"])
REPLICA_READY = prometheus_client.Gauge(
    "infermesh_batcher_replica_ready", "1 when the replica answered its last model poll.", ["replica"]
)
RETRIES = prometheus_client.Counter(
    "infermesh_batcher_retries_total",
    "Batches sent again to another replica after a retryable failure, by code.",
    ["code"],
)
TARGET_ROWS = prometheus_client.Gauge(
    "infermesh_batcher_target_batch_rows", "Rows the batch policy aimed for in the latest batch, by model.", ["model"]
)
EJECTIONS = prometheus_client.Counter(
    "infermesh_batcher_ejections_total",
    "Outlier-detection ejections of a model_server replica (traffic policy), by replica.",
    ["replica"],
)
UPSTREAM = prometheus_client.Counter(
    "infermesh_batcher_upstream_requests_total",
    "Batch RPCs to the model servers under a traffic policy, by subset and gRPC status code.",
    ["subset", "code"],
)
UPSTREAM_LATENCY = prometheus_client.Histogram(
    "infermesh_batcher_upstream_duration_seconds",
    "Time of one batch RPC to a model server, by subset.",
    ["subset"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
SUBSET_READY = prometheus_client.Gauge(
    "infermesh_batcher_subset_ready_replicas", "Replicas of a subset that are ready and not ejected.", ["subset"]
)
