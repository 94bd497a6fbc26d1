"""The cache service's Prometheus metrics."""

import prometheus_client

LOOKUPS = prometheus_client.Counter(
    "infermesh_cache_lookups_total",
    "Cache lookups by the level that answered (l1, l2; 'all' for misses), tier and result.",
    ["level", "tier", "result"],
)
SKIPPED = prometheus_client.Counter(
    "infermesh_cache_l1_skipped_total", "L1 lookups skipped while the Redis breaker was open."
)
INVALID = prometheus_client.Counter(
    "infermesh_cache_invalid_values_total",
    "Stored values that did not decode (foreign or corrupt), by level.",
    ["level"],
)
ERRORS = prometheus_client.Counter(
    "infermesh_cache_errors_total", "Failed Redis and L2 calls and unstorable results, by operation.", ["operation"]
)
STORED_BYTES = prometheus_client.Counter("infermesh_cache_stored_bytes_total", "Bytes written, by level.", ["level"])
L2_BYTES = prometheus_client.Gauge(
    "infermesh_cache_l2_bytes", "Bytes L2's entries take now (keys, values, LMDB's per-entry overhead)."
)
L2_RATIO = prometheus_client.Gauge(
    "infermesh_cache_l2_compression_ratio", "Stored bytes / raw tensor bytes of the last L2 write batch."
)
BREAKER_OPEN = prometheus_client.Gauge(
    "infermesh_cache_breaker_open", "1 while Redis is being skipped after a failure."
)
PURGES = prometheus_client.Counter("infermesh_cache_purges_total", "Purge calls, by result.", ["result"])
DROPPED_STORES = prometheus_client.Counter(
    "infermesh_cache_dropped_stores_total", "Results not written because too many writes were queued."
)
STALE_STORES = prometheus_client.Counter(
    "infermesh_cache_stale_stores_total",
    "Results not written because the model was purged between their lookup and their store.",
)
