"""Retries as Istio programs Envoy: attempts, perTryTimeout, retryOn, and the
fully jittered exponential back-off between tries."""

from __future__ import annotations

import dataclasses
import random

from services.common.traffic import fields

# Envoy's retry_on tokens that Istio accepts for gRPC and HTTP routes.
GRPC_RETRY_ON = {
    "cancelled": "CANCELLED",
    "deadline-exceeded": "DEADLINE_EXCEEDED",
    "internal": "INTERNAL",
    "resource-exhausted": "RESOURCE_EXHAUSTED",
    "unavailable": "UNAVAILABLE",
}
HTTP_RETRY_ON = {
    "5xx",
    "gateway-error",
    "reset",
    "reset-before-request",
    "connect-failure",
    "refused-stream",
    "retriable-4xx",
    "retriable-status-codes",
    "retriable-headers",
    "envoy-ratelimited",
    "http3-post-connect-failure",
}
BACKOFF_BASE_S = 0.025  # Envoy's default retry back-off base interval; the cap is 10x


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 0
    per_try_timeout_s: float | None = None
    retry_on: frozenset[str] = frozenset()

    def retries(self, grpc_code: str, transport_failure: bool = False) -> bool:
        """Whether a failure is retried under retryOn. The gRPC tokens match the
        status the server sent. Envoy's HTTP tokens (5xx, gateway-error, reset,
        connect-failure, refused-stream, 502/503/504) see only the HTTP layer,
        where a gRPC error is a 200: here they match a failed connection or a
        lost stream (`transport_failure`), which a gRPC client sees as UNAVAILABLE."""
        for token in self.retry_on:
            if GRPC_RETRY_ON.get(token) == grpc_code:
                return True
            if transport_failure and (
                token in ("5xx", "gateway-error", "reset", "reset-before-request", "connect-failure", "refused-stream")
                or token in ("502", "503", "504")
            ):
                return True
        return False


# What Istio programs when a route says nothing about retries.
ISTIO_DEFAULT_RETRIES = RetryPolicy(
    2, None, frozenset({"connect-failure", "refused-stream", "unavailable", "cancelled", "retriable-status-codes"})
)


def parse_retries(doc, where: str) -> RetryPolicy:
    if doc is None:
        return ISTIO_DEFAULT_RETRIES
    fields.mapping(doc, where)
    attempts = fields.require(doc, "attempts", int, where)
    if attempts < 0:
        raise fields.PolicyError(f"{where}: field 'attempts' must be >= 0, got {attempts}")
    # Without retryOn, Istio retries on its default conditions.
    tokens = (
        frozenset(t.strip() for t in str(doc["retryOn"]).split(",") if t.strip())
        if "retryOn" in doc
        else ISTIO_DEFAULT_RETRIES.retry_on
    )
    unknown = sorted(
        t
        for t in tokens
        if t not in GRPC_RETRY_ON and t not in HTTP_RETRY_ON and not (t.isdigit() and 100 <= int(t) <= 599)
    )
    if unknown:
        raise fields.PolicyError(
            f"{where}: retryOn has unknown condition(s) {unknown}; gRPC ones are {sorted(GRPC_RETRY_ON)}"
        )
    per_try = fields.parse_duration(doc["perTryTimeout"], f"{where}.perTryTimeout") if "perTryTimeout" in doc else None
    return RetryPolicy(attempts, per_try, tokens)


def backoff_s(retry: int, rng: random.Random, base_s: float = BACKOFF_BASE_S) -> float:
    """Envoy's fully jittered exponential back-off before retry number `retry`
    (1 for the first): uniform in [0, (2^retry - 1) x base], capped at 10 x base."""
    return rng.uniform(0, min((2**retry - 1) * base_s, 10 * base_s))
