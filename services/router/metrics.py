"""The router's Prometheus metrics."""

import prometheus_client

from services.common.metrics import Children

REQUESTS = prometheus_client.Counter(
    "infermesh_router_requests_total",
    "Inference requests answered, by model, tier and gRPC status code.",
    ["model", "tier", "code"],
)
LATENCY = prometheus_client.Histogram(
    "infermesh_router_request_duration_seconds",
    "Time to answer an inference request, by model, tier and gRPC status code (a refusal's time is its own).",
    ["model", "tier", "code"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
CACHE = prometheus_client.Counter(
    "infermesh_router_cache_lookups_total",
    "Requests by what the cache did for them: near_hit (router memory), hit, miss, error, bypassed (asked or "
    "automatic) or shared (an identical request was already running; single-flight).",
    ["result"],
)
CACHE_BYPASS = prometheus_client.Gauge(
    "infermesh_router_cache_bypassed",
    "1 while a model's cache lookups are bypassed for a near-zero hit rate.",
    ["model"],
)
CACHE_ERRORS = prometheus_client.Counter(
    "infermesh_router_cache_errors_total",
    "Cache calls that failed or timed out; the request went on uncached.",
    ["operation"],
)
SHED = prometheus_client.Counter(
    "infermesh_router_shed_total",
    "Requests the router refused by itself while the batcher's queue for their tier was full, by tier.",
    ["tier"],
)
BREAKER_STATE = prometheus_client.Gauge(
    "infermesh_router_breaker_state", "A model's circuit breaker: 0 closed, 1 open, 2 half-open.", ["model"]
)
BREAKER_TRANSITIONS = prometheus_client.Counter(
    "infermesh_router_breaker_transitions_total",
    "Circuit breaker state changes, by model and new state.",
    ["model", "state"],
)
DEGRADED = prometheus_client.Counter(
    "infermesh_router_degraded_total",
    "Requests answered in place of a failing model, by model and source (cache, fallback).",
    ["model", "source"],
)
AUTH_REFUSALS = prometheus_client.Counter(
    "infermesh_router_auth_refusals_total",
    "Calls refused for who they are from: unauthenticated (missing or unknown credentials), tier_denied (a tier "
    "beyond the tenant's), rate_limited (over the tenant's rate).",
    ["reason"],
)
TENANT_REQUESTS = prometheus_client.Counter(
    "infermesh_router_tenant_requests_total",
    "Inference requests answered, by tenant (the first 50 of the registry by name, the rest as 'other') and gRPC "
    "status code.",
    ["tenant", "code"],
)
RETRIES = prometheus_client.Counter(
    "infermesh_router_batcher_retries_total",
    "Requests sent to the batcher a second time because the stream they went on ended or broke before their "
    "answer (a batcher restarted or drained), by outcome: ok, or failed.",
    ["outcome"],
)

# The per-request ones, by label values without labels()' lock (services.common.metrics.Children).
REQUESTS_BY = Children(REQUESTS)
LATENCY_BY = Children(LATENCY)
CACHE_BY = Children(CACHE)
BREAKER_STATE_BY = Children(BREAKER_STATE)
TENANT_REQUESTS_BY = Children(TENANT_REQUESTS)
