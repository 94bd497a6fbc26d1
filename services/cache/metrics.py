"""The cache service's Prometheus metrics."""

import prometheus_client

LOOKUPS = prometheus_client.Counter(
    "infermesh_cache_lookups_total", "Cache lookups, by level and result (hit, miss, skipped, invalid).",
    ["level", "result"])
ERRORS = prometheus_client.Counter(
    "infermesh_cache_errors_total", "Failed Redis calls, by operation.", ["operation"])
STORED_BYTES = prometheus_client.Counter(
    "infermesh_cache_stored_bytes_total", "Bytes written to L1.")
BREAKER_OPEN = prometheus_client.Gauge(
    "infermesh_cache_breaker_open", "1 while Redis is being skipped after a failure.")
