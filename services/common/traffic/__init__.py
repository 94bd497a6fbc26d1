"""Istio's traffic policy applied by our own services to their own hops, with
Envoy's semantics, so the YAML that drives the mesh in Kubernetes drives a
mesh on one machine the same way. By concern: policy.py (the resources and
their files), balancing.py (weighted picks, panic mode), outlier.py (outlier
detection), retries.py (retries and back-off), fields.py (checked reading).

From a VirtualService: HTTP routes in order, first match wins (header exact /
prefix / regex); a route's destinations picked by weight, weights relative,
one pick per call; retries (attempts, perTryTimeout, retryOn) with Envoy's
fully jittered exponential backoff. From a DestinationRule: subsets by label
and Envoy's outlier detection with its panic threshold, per subset (a subset's
own outlierDetection replacing the rule's); fields of it that are not applied
here are refused by name.

How gRPC statuses count for outlier detection (Envoy maps them to HTTP):
UNKNOWN, INTERNAL, DATA_LOSS -> 500, UNIMPLEMENTED -> 501, UNAVAILABLE -> 503,
DEADLINE_EXCEEDED -> 504 are 5xx; of those, 503 and 504 (and 502) are also
gateway errors. RESOURCE_EXHAUSTED -> 429 and every 4xx-like status count as
successes for the detector: a busy or a caller's mistake is not an outlier.
A connection that fails counts as a 503, a deadline that runs out at the
caller as a 504, unless the DestinationRule sets splitExternalLocalOriginErrors:
then both count only towards consecutiveLocalOriginFailures (default 5).
"""

from services.common.traffic.balancing import OVERPROVISIONING_PERCENT
from services.common.traffic.fields import PolicyError, parse_duration
from services.common.traffic.outlier import (
    GATEWAY_ERRORS,
    HTTP_STATUS_OF_GRPC,
    MAX_EJECTION_TIME_S,
    OutlierDetector,
    OutlierPolicy,
)
from services.common.traffic.policy import (
    Destination,
    DestinationRule,
    HeaderMatch,
    PolicyFiles,
    Route,
    VirtualService,
    describe,
    load_policy_files,
    parse_destination_rule,
    parse_virtual_service,
)
from services.common.traffic.retries import (
    BACKOFF_BASE_S,
    GRPC_RETRY_ON,
    HTTP_RETRY_ON,
    ISTIO_DEFAULT_RETRIES,
    RetryPolicy,
    backoff_s,
)

__all__ = [
    "BACKOFF_BASE_S",
    "GATEWAY_ERRORS",
    "GRPC_RETRY_ON",
    "HTTP_RETRY_ON",
    "HTTP_STATUS_OF_GRPC",
    "ISTIO_DEFAULT_RETRIES",
    "MAX_EJECTION_TIME_S",
    "OVERPROVISIONING_PERCENT",
    "Destination",
    "DestinationRule",
    "HeaderMatch",
    "OutlierDetector",
    "OutlierPolicy",
    "PolicyError",
    "PolicyFiles",
    "RetryPolicy",
    "Route",
    "VirtualService",
    "backoff_s",
    "describe",
    "load_policy_files",
    "parse_destination_rule",
    "parse_duration",
    "parse_virtual_service",
]
