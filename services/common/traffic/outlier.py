"""Envoy's outlier detection (consecutive errors, growing ejection time, max
ejection percent, the split of local-origin failures) and its configuration
from a DestinationRule's outlierDetection."""

from __future__ import annotations

import dataclasses
import math

from services.common.traffic import balancing, fields

HTTP_STATUS_OF_GRPC = {
    "OK": 200,
    "CANCELLED": 499,
    "UNKNOWN": 500,
    "INVALID_ARGUMENT": 400,
    "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "PERMISSION_DENIED": 403,
    "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 400,
    "ABORTED": 409,
    "OUT_OF_RANGE": 400,
    "UNIMPLEMENTED": 501,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DATA_LOSS": 500,
    "UNAUTHENTICATED": 401,
}
GATEWAY_ERRORS = frozenset({502, 503, 504})
MAX_EJECTION_TIME_S = 300.0  # Envoy's max_ejection_time default


@dataclasses.dataclass(frozen=True)
class OutlierPolicy:
    consecutive_5xx: int = 5  # 0 turns this check off
    consecutive_gateway: int = 0  # Istio's default: off
    interval_s: float = 10.0
    base_ejection_s: float = 30.0
    max_ejection_percent: float = 10.0
    # Envoy's split mode: failures that happen on our side of the call (a
    # connection that fails, a deadline that runs out while waiting) count on
    # their own counter instead of as 503/504 from the host.
    split_local_origin: bool = False
    consecutive_local_origin: int = 5
    # Envoy's panic threshold: below this share of healthy hosts, calls go to
    # every host, ejected or not. Istio's default 0 never panics.
    min_health_percent: float = 0.0


# Istio's OutlierDetection fields the batcher does not apply: refused, so a
# file never means one thing in the cluster and another here.
UNSUPPORTED_OUTLIER_FIELDS = {
    "consecutiveErrors": "deprecated by Istio; use consecutive5xxErrors or consecutiveGatewayErrors",
    "failurePercentageThreshold": "failure-percentage ejection is not implemented outside Kubernetes",
    "outlierDetectionHttpErrorCodes": "only Envoy's 5xx and gateway-error classes of gRPC statuses are implemented",
}
OUTLIER_FIELDS = (
    "consecutive5xxErrors",
    "consecutiveGatewayErrors",
    "splitExternalLocalOriginErrors",
    "consecutiveLocalOriginFailures",
    "interval",
    "baseEjectionTime",
    "maxEjectionPercent",
    "minHealthPercent",
)


def from_traffic_policy(policy, at: str) -> OutlierPolicy | None:
    """A trafficPolicy's outlierDetection; its other fields (connection pool,
    load balancer, TLS) are Envoy's business only."""
    policy = fields.mapping(policy or {}, at)
    for i, port in enumerate(fields.sequence(policy.get("portLevelSettings", []) or [], f"{at}.portLevelSettings")):
        if "outlierDetection" in fields.mapping(port, f"{at}.portLevelSettings[{i}]"):
            raise fields.PolicyError(
                f"{at}.portLevelSettings[{i}]: outlierDetection per port is not supported outside "
                "Kubernetes; set it in trafficPolicy.outlierDetection"
            )
    detection = policy.get("outlierDetection")
    return None if detection is None else parse(detection, f"{at}.outlierDetection")


def parse(detection, at: str) -> OutlierPolicy:
    fields.mapping(detection, at)
    unsupported = sorted(set(detection) & set(UNSUPPORTED_OUTLIER_FIELDS))
    if unsupported:
        raise fields.PolicyError(
            f"{at}: not supported outside Kubernetes: "
            + "; ".join(f"'{key}' ({UNSUPPORTED_OUTLIER_FIELDS[key]})" for key in unsupported)
        )
    unknown = sorted(set(detection) - set(OUTLIER_FIELDS))
    if unknown:
        raise fields.PolicyError(f"{at}: unknown field(s) {unknown}; Istio's are {sorted(OUTLIER_FIELDS)}")
    percents = {}
    for key, default in (("maxEjectionPercent", 10), ("minHealthPercent", 0)):
        value = detection.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 100:
            raise fields.PolicyError(f"{at}: field '{key}' must be an integer 0..100, got {value!r}")
        percents[key] = float(value)
    counts = {}
    for key in ("consecutive5xxErrors", "consecutiveGatewayErrors"):
        value = detection.get(key, 5 if key == "consecutive5xxErrors" else 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise fields.PolicyError(f"{at}: field '{key}' must be an integer >= 0, got {value!r}")
        counts[key] = value
    split = detection.get("splitExternalLocalOriginErrors", False)
    local = detection.get("consecutiveLocalOriginFailures", 5)
    if not isinstance(split, bool):
        raise fields.PolicyError(f"{at}: field 'splitExternalLocalOriginErrors' must be true or false, got {split!r}")
    if not isinstance(local, int) or isinstance(local, bool) or local < 0:
        raise fields.PolicyError(f"{at}: field 'consecutiveLocalOriginFailures' must be an integer >= 0, got {local!r}")
    if "consecutiveLocalOriginFailures" in detection and local and not split:
        raise fields.PolicyError(
            f"{at}: 'consecutiveLocalOriginFailures' needs 'splitExternalLocalOriginErrors: true' "
            "(Istio refuses it otherwise)"
        )
    return OutlierPolicy(
        consecutive_5xx=counts["consecutive5xxErrors"],
        consecutive_gateway=counts["consecutiveGatewayErrors"],
        interval_s=fields.parse_duration(detection.get("interval", "10s"), f"{at}.interval"),
        base_ejection_s=fields.parse_duration(detection.get("baseEjectionTime", "30s"), f"{at}.baseEjectionTime"),
        max_ejection_percent=percents["maxEjectionPercent"],
        split_local_origin=split,
        consecutive_local_origin=local,
        min_health_percent=percents["minHealthPercent"],
    )


@dataclasses.dataclass
class _Host:
    consecutive_5xx: int = 0
    consecutive_gateway: int = 0
    consecutive_local: int = 0  # split mode only
    ejections: int = 0  # the ejection-time multiplier
    ejected_at: float | None = None


class OutlierDetector:
    """Envoy's consecutive-error ejection for one pool of hosts.

    - A 5xx (and a gateway error) bumps its counters; any other answer resets
      both. Reaching a threshold makes the host an outlier at once.
    - An outlier is ejected only while (ejected + 1) / hosts <= maxEjectionPercent:
      with Istio's default of 10%, a pool of fewer than ten hosts ejects nothing.
    - Ejection lasts base x multiplier, at most 300 s (or base, if longer).
      Each ejection raises the multiplier while base x multiplier is below
      that maximum + base, so it stops one step past the maximum (11 for a
      base of 30 s) and a flapping host does not pile up ejections it must
      then work off. Checks run every `interval`: they bring back hosts whose
      time is up, and lower by one the multiplier of hosts that are in service.
    - A host that comes back starts with every error streak at 0: failures of
      calls still in flight when it was ejected do not count towards the next
      ejection."""

    def __init__(self, policy: OutlierPolicy, hosts: list[str]):
        self.policy = policy
        self._hosts = {h: _Host() for h in hosts}
        self._last_check: float | None = None

    def set_hosts(self, hosts: list[str]) -> None:
        self._hosts = {h: self._hosts.get(h, _Host()) for h in hosts}

    def is_ejected(self, host: str, now: float | None = None) -> bool:
        """Whether the host is out; given `now`, the interval checks due by then run first."""
        if now is not None:
            self.check(now)
        state = self._hosts.get(host)
        return state is not None and state.ejected_at is not None

    def routable(self, hosts: list[str], now: float) -> list[str]:
        """Of `hosts` (the subset's hosts in service discovery: the ready
        ones), those a call may go to: the ones not ejected, unless the subset
        is in Envoy's panic mode (balancing.in_panic), when it is all of them."""
        self.check(now)
        healthy = [h for h in hosts if not self.is_ejected(h)]
        if not hosts or len(healthy) == len(hosts):
            return healthy
        return list(hosts) if balancing.in_panic(len(hosts), len(healthy), self.policy.min_health_percent) else healthy

    def ejected(self) -> list[str]:
        return sorted(h for h, s in self._hosts.items() if s.ejected_at is not None)

    def record(self, host: str, grpc_code: str, now: float, local_origin: bool = False) -> bool:
        """Counts one outcome of a call to `host`; returns whether it got ejected
        now. `local_origin`: the failure happened on the caller's side (the
        connection failed, or the caller's deadline ran out) rather than being
        an answer the host sent. Envoy maps such a failure to 503/504 unless the
        policy splits them out, when they count on their own counter; any
        answer from the host resets that counter."""
        state = self._hosts.get(host)
        if state is None:
            return False
        self.check(now)
        policy = self.policy
        if local_origin and policy.split_local_origin:
            state.consecutive_local += 1
            if (
                state.ejected_at is None
                and policy.consecutive_local_origin
                and state.consecutive_local >= policy.consecutive_local_origin
            ):
                state.consecutive_local = 0
                return self._eject(state, now)
            return False
        if not local_origin:
            state.consecutive_local = 0
        status = HTTP_STATUS_OF_GRPC.get(grpc_code, 500)
        if status < 500:
            state.consecutive_5xx = state.consecutive_gateway = 0
            return False
        state.consecutive_5xx += 1
        state.consecutive_gateway = state.consecutive_gateway + 1 if status in GATEWAY_ERRORS else 0
        if state.ejected_at is not None:
            return False
        if (policy.consecutive_5xx and state.consecutive_5xx >= policy.consecutive_5xx) or (
            policy.consecutive_gateway and state.consecutive_gateway >= policy.consecutive_gateway
        ):
            state.consecutive_5xx = state.consecutive_gateway = 0
            return self._eject(state, now)
        return False

    def _eject(self, state: _Host, now: float) -> bool:
        ejected = sum(1 for s in self._hosts.values() if s.ejected_at is not None)
        if 100.0 * (ejected + 1) / len(self._hosts) > self.policy.max_ejection_percent:
            return False
        base = self.policy.base_ejection_s
        if state.ejections * base < self._max_ejection_s() + base:
            state.ejections += 1
        state.ejected_at = now
        return True

    def _max_ejection_s(self) -> float:
        return max(MAX_EJECTION_TIME_S, self.policy.base_ejection_s)

    def ejection_s(self, host: str) -> float:
        """How long the host's current (or next) ejection lasts."""
        state = self._hosts[host]
        return min(self.policy.base_ejection_s * max(state.ejections, 1), self._max_ejection_s())

    def check(self, now: float) -> None:
        """The interval timer: runs every check due by `now`."""
        if self._last_check is None:
            self._last_check = now
            return
        due = math.floor((now - self._last_check) / self.policy.interval_s)
        for _ in range(due):
            self._last_check += self.policy.interval_s
            self._check_at(self._last_check)

    def _check_at(self, at: float) -> None:
        for host, state in self._hosts.items():
            if state.ejected_at is not None:
                if at - state.ejected_at >= self.ejection_s(host):
                    state.ejected_at = None  # back in service; the multiplier stays until it proves healthy
                    state.consecutive_5xx = state.consecutive_gateway = state.consecutive_local = 0
            elif state.ejections:
                state.ejections -= 1  # in service at this check: the next ejection is shorter
