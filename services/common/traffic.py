"""Istio's traffic policy applied by our own services to their own hops, with
Envoy's semantics, so the YAML that drives the mesh in Kubernetes drives a
mesh on one machine the same way.

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

from __future__ import annotations

import dataclasses
import math
import pathlib
import random
import re

from services.common.config import field

HTTP_STATUS_OF_GRPC = {
    "OK": 200, "CANCELLED": 499, "UNKNOWN": 500, "INVALID_ARGUMENT": 400, "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "PERMISSION_DENIED": 403, "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 400, "ABORTED": 409, "OUT_OF_RANGE": 400, "UNIMPLEMENTED": 501, "INTERNAL": 500,
    "UNAVAILABLE": 503, "DATA_LOSS": 500, "UNAUTHENTICATED": 401,
}
GATEWAY_ERRORS = frozenset({502, 503, 504})
# Envoy's retry_on tokens that Istio accepts for gRPC and HTTP routes.
GRPC_RETRY_ON = {"cancelled": "CANCELLED", "deadline-exceeded": "DEADLINE_EXCEEDED", "internal": "INTERNAL",
                 "resource-exhausted": "RESOURCE_EXHAUSTED", "unavailable": "UNAVAILABLE"}
HTTP_RETRY_ON = {"5xx", "gateway-error", "reset", "reset-before-request", "connect-failure", "refused-stream",
                 "retriable-4xx", "retriable-status-codes", "retriable-headers", "envoy-ratelimited",
                 "http3-post-connect-failure"}
MAX_EJECTION_TIME_S = 300.0  # Envoy's max_ejection_time default
OVERPROVISIONING_PERCENT = 140  # Envoy's default overprovisioning factor, which Istio leaves as it is
BACKOFF_BASE_S = 0.025  # Envoy's default retry back-off base interval; the cap is 10x


class PolicyError(ValueError):
    """A VirtualService or DestinationRule that cannot be applied; names file and field."""


DURATION_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
DURATION_PART = r"(\d+(?:\.\d+)?)(h|ms|us|µs|ns|m|s)"


def parse_duration(value, where: str) -> float:
    """Istio durations, Go's grammar: '10s', '250ms', '1.5s', '1m30s', '1h' -> seconds."""
    text = str(value).strip()
    if not re.fullmatch(f"(?:{DURATION_PART})+", text):
        raise PolicyError(f"{where}: {value!r} is not a duration such as '250ms', '10s' or '1m'")
    return sum(float(number) * DURATION_UNITS[unit] for number, unit in re.findall(DURATION_PART, text))


# ---------------------------------------------------------------- VirtualService


@dataclasses.dataclass(frozen=True)
class HeaderMatch:
    name: str
    kind: str  # exact, prefix, regex
    value: str

    def matches(self, headers: dict[str, str]) -> bool:
        got = headers.get(self.name)
        if got is None:
            return False
        if self.kind == "exact":
            return got == self.value
        if self.kind == "prefix":
            return got.startswith(self.value)
        return re.fullmatch(self.value, got) is not None  # Envoy's regex matches the whole value


@dataclasses.dataclass(frozen=True)
class Destination:
    host: str
    subset: str
    weight: int  # as in force, relative to the route's others; a lone destination's is 100 whatever the file says


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
            if transport_failure and (token in ("5xx", "gateway-error", "reset", "reset-before-request",
                                                "connect-failure", "refused-stream")
                                      or token in ("502", "503", "504")):
                return True
        return False


@dataclasses.dataclass(frozen=True)
class Route:
    name: str
    matches: tuple[tuple[HeaderMatch, ...], ...]  # any one block of all-matching headers; empty: every call
    destinations: tuple[Destination, ...]
    retries: RetryPolicy
    timeout_s: float | None

    def applies(self, headers: dict[str, str]) -> bool:
        return not self.matches or any(all(h.matches(headers) for h in block) for block in self.matches)

    def pick(self, rng: random.Random) -> Destination:
        """One weighted pick; weights are relative, a weight of 0 is never picked."""
        total = sum(d.weight for d in self.destinations)
        point = rng.uniform(0, total)
        for destination in self.destinations:
            point -= destination.weight
            if point < 0 and destination.weight > 0:
                return destination
        return next(d for d in reversed(self.destinations) if d.weight > 0)


@dataclasses.dataclass(frozen=True)
class VirtualService:
    name: str
    hosts: tuple[str, ...]
    routes: tuple[Route, ...]

    def route(self, headers: dict[str, str]) -> Route | None:
        """Routes in order; the first that matches wins."""
        return next((r for r in self.routes if r.applies(headers)), None)


def _require(doc, key: str, kind, where: str):
    return field(doc, key, kind, where, PolicyError)


def _mapping(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise PolicyError(f"{where}: expected a mapping, got {value!r}")
    return value


def _sequence(value, where: str) -> list:
    if not isinstance(value, list):
        raise PolicyError(f"{where}: expected a list, got {value!r}")
    return value


def _resource(doc, kind: str, where: str) -> tuple[str, dict]:
    """A Kubernetes resource of `kind`: its metadata.name and its spec."""
    _mapping(doc, where)
    if doc.get("kind") != kind:
        raise PolicyError(f"{where}: kind is {doc.get('kind')!r}, expected {kind}")
    name = _require(_require(doc, "metadata", dict, where), "name", str, f"{where}: metadata")
    return name, _require(doc, "spec", dict, where)


def parse_virtual_service(doc: dict, where: str) -> VirtualService:
    name, spec = _resource(doc, "VirtualService", where)
    hosts = tuple(_require(spec, "hosts", list, f"{where}: spec"))
    routes = []
    for i, http in enumerate(_require(spec, "http", list, f"{where}: spec")):
        at = f"{where}: spec.http[{i}]"
        _mapping(http, at)
        blocks = []
        for j, match in enumerate(_sequence(http.get("match", []) or [], f"{at}.match")):
            _mapping(match, f"{at}.match[{j}]")
            headers = []
            for header, rule in _mapping(match.get("headers") or {}, f"{at}.match[{j}].headers").items():
                if not isinstance(rule, dict) or len(rule) != 1 or next(iter(rule)) not in ("exact", "prefix", "regex"):
                    raise PolicyError(f"{at}.match[{j}].headers.{header}: expected one of exact, prefix, regex; got {rule!r}")
                (kind, value), = rule.items()
                if kind == "regex":
                    try:
                        re.compile(value)
                    except re.error as exc:
                        raise PolicyError(f"{at}.match[{j}].headers.{header}.regex {value!r}: {exc}") from None
                headers.append(HeaderMatch(header.lower(), kind, str(value)))
            unknown = set(match) - {"headers", "name"}
            if unknown:
                raise PolicyError(f"{at}.match[{j}]: we apply header matches only; unsupported {sorted(unknown)}")
            blocks.append(tuple(headers))
        destinations = []
        items = _require(http, "route", list, at)
        for j, item in enumerate(items):
            dest = _require(item, "destination", dict, f"{at}.route[{j}]")
            weight = item.get("weight", 0)  # Istio's default: an omitted weight is 0
            if not isinstance(weight, int) or isinstance(weight, bool) or weight < 0:
                raise PolicyError(f"{at}.route[{j}]: field 'weight' must be an integer >= 0, got {weight!r}")
            if len(items) == 1:
                weight = 100  # a lone destination takes all traffic, whatever its weight says
            destinations.append(Destination(_require(dest, "host", str, f"{at}.route[{j}].destination"),
                                            dest.get("subset", ""), weight))
        if not any(d.weight for d in destinations):  # only a route of several can get here, as in Istio
            raise PolicyError(f"{at}: the weights of its destinations add up to 0 (an omitted weight is 0)")
        routes.append(Route(http.get("name", f"http[{i}]"), tuple(blocks), tuple(destinations),
                            _retries(http.get("retries"), f"{at}.retries"),
                            parse_duration(http["timeout"], f"{at}.timeout") if "timeout" in http else None))
    return VirtualService(name, hosts, tuple(routes))


# What Istio programs when a route says nothing about retries.
ISTIO_DEFAULT_RETRIES = RetryPolicy(2, None, frozenset(
    {"connect-failure", "refused-stream", "unavailable", "cancelled", "retriable-status-codes"}))


def _retries(doc, where: str) -> RetryPolicy:
    if doc is None:
        return ISTIO_DEFAULT_RETRIES
    _mapping(doc, where)
    attempts = _require(doc, "attempts", int, where)
    if attempts < 0:
        raise PolicyError(f"{where}: field 'attempts' must be >= 0, got {attempts}")
    # Without retryOn, Istio retries on its default conditions.
    tokens = frozenset(t.strip() for t in str(doc["retryOn"]).split(",") if t.strip()) if "retryOn" in doc \
        else ISTIO_DEFAULT_RETRIES.retry_on
    unknown = sorted(t for t in tokens if t not in GRPC_RETRY_ON and t not in HTTP_RETRY_ON
                     and not (t.isdigit() and 100 <= int(t) <= 599))
    if unknown:
        raise PolicyError(f"{where}: retryOn has unknown condition(s) {unknown}; gRPC ones are {sorted(GRPC_RETRY_ON)}")
    per_try = parse_duration(doc["perTryTimeout"], f"{where}.perTryTimeout") if "perTryTimeout" in doc else None
    return RetryPolicy(attempts, per_try, tokens)


def backoff_s(retry: int, rng: random.Random, base_s: float = BACKOFF_BASE_S) -> float:
    """Envoy's fully jittered exponential back-off before retry number `retry`
    (1 for the first): uniform in [0, (2^retry - 1) x base], capped at 10 x base."""
    return rng.uniform(0, min((2 ** retry - 1) * base_s, 10 * base_s))


# ---------------------------------------------------------------- DestinationRule


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
OUTLIER_FIELDS = ("consecutive5xxErrors", "consecutiveGatewayErrors", "splitExternalLocalOriginErrors",
                  "consecutiveLocalOriginFailures", "interval", "baseEjectionTime", "maxEjectionPercent",
                  "minHealthPercent")


@dataclasses.dataclass(frozen=True)
class DestinationRule:
    name: str
    host: str
    subsets: dict[str, dict[str, str]]  # subset name -> labels
    outlier: OutlierPolicy | None  # the rule's own, for the host and every subset without one of its own
    subset_outliers: dict[str, OutlierPolicy] = dataclasses.field(default_factory=dict)

    def subset_of(self, labels: dict[str, str]) -> list[str]:
        """The subsets whose labels all appear in `labels`."""
        return [name for name, want in self.subsets.items() if all(labels.get(k) == v for k, v in want.items())]

    def outlier_for(self, subset: str) -> OutlierPolicy | None:
        """A subset's trafficPolicy.outlierDetection replaces the rule's as a
        whole (Istio merges a subset's policy field by field of trafficPolicy,
        not within outlierDetection); "" is the host without a subset."""
        return self.subset_outliers.get(subset, self.outlier)


def parse_destination_rule(doc: dict, where: str) -> DestinationRule:
    name, spec = _resource(doc, "DestinationRule", where)
    subsets, subset_outliers = {}, {}
    for i, subset in enumerate(_sequence(spec.get("subsets", []) or [], f"{where}: spec.subsets")):
        at = f"{where}: spec.subsets[{i}]"
        subset_name = _require(subset, "name", str, at)
        subsets[subset_name] = {str(k): str(v) for k, v in _require(subset, "labels", dict, at).items()}
        outlier = _traffic_policy_outlier(subset.get("trafficPolicy"), f"{at}.trafficPolicy")
        if outlier is not None:
            subset_outliers[subset_name] = outlier
    outlier = _traffic_policy_outlier(spec.get("trafficPolicy"), f"{where}: spec.trafficPolicy")
    return DestinationRule(name, _require(spec, "host", str, f"{where}: spec"), subsets, outlier, subset_outliers)


def _traffic_policy_outlier(policy, at: str) -> OutlierPolicy | None:
    """A trafficPolicy's outlierDetection; its other fields (connection pool,
    load balancer, TLS) are Envoy's business only."""
    policy = _mapping(policy or {}, at)
    for i, port in enumerate(_sequence(policy.get("portLevelSettings", []) or [], f"{at}.portLevelSettings")):
        if "outlierDetection" in _mapping(port, f"{at}.portLevelSettings[{i}]"):
            raise PolicyError(f"{at}.portLevelSettings[{i}]: outlierDetection per port is not supported outside "
                              "Kubernetes; set it in trafficPolicy.outlierDetection")
    detection = policy.get("outlierDetection")
    return None if detection is None else _outlier(detection, f"{at}.outlierDetection")


def _outlier(detection, at: str) -> OutlierPolicy:
    _mapping(detection, at)
    unsupported = sorted(set(detection) & set(UNSUPPORTED_OUTLIER_FIELDS))
    if unsupported:
        raise PolicyError(f"{at}: not supported outside Kubernetes: "
                          + "; ".join(f"'{key}' ({UNSUPPORTED_OUTLIER_FIELDS[key]})" for key in unsupported))
    unknown = sorted(set(detection) - set(OUTLIER_FIELDS))
    if unknown:
        raise PolicyError(f"{at}: unknown field(s) {unknown}; Istio's are {sorted(OUTLIER_FIELDS)}")
    percents = {}
    for key, default in (("maxEjectionPercent", 10), ("minHealthPercent", 0)):
        value = detection.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 100:
            raise PolicyError(f"{at}: field '{key}' must be an integer 0..100, got {value!r}")
        percents[key] = float(value)
    counts = {}
    for key in ("consecutive5xxErrors", "consecutiveGatewayErrors"):
        value = detection.get(key, 5 if key == "consecutive5xxErrors" else 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PolicyError(f"{at}: field '{key}' must be an integer >= 0, got {value!r}")
        counts[key] = value
    split = detection.get("splitExternalLocalOriginErrors", False)
    local = detection.get("consecutiveLocalOriginFailures", 5)
    if not isinstance(split, bool):
        raise PolicyError(f"{at}: field 'splitExternalLocalOriginErrors' must be true or false, got {split!r}")
    if not isinstance(local, int) or isinstance(local, bool) or local < 0:
        raise PolicyError(f"{at}: field 'consecutiveLocalOriginFailures' must be an integer >= 0, got {local!r}")
    if "consecutiveLocalOriginFailures" in detection and local and not split:
        raise PolicyError(f"{at}: 'consecutiveLocalOriginFailures' needs 'splitExternalLocalOriginErrors: true' "
                          "(Istio refuses it otherwise)")
    return OutlierPolicy(
        consecutive_5xx=counts["consecutive5xxErrors"], consecutive_gateway=counts["consecutiveGatewayErrors"],
        interval_s=parse_duration(detection.get("interval", "10s"), f"{at}.interval"),
        base_ejection_s=parse_duration(detection.get("baseEjectionTime", "30s"), f"{at}.baseEjectionTime"),
        max_ejection_percent=percents["maxEjectionPercent"], split_local_origin=split,
        consecutive_local_origin=local, min_health_percent=percents["minHealthPercent"])


# ---------------------------------------------------------------- outlier detection


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
        is in Envoy's panic mode, when it is all of them. Envoy panics when
        the healthy share is below minHealthPercent and the subset's
        availability (that share x Envoy's overprovisioning factor of 1.4,
        capped at 100%) is below 100%."""
        self.check(now)
        healthy = [h for h in hosts if not self.is_ejected(h)]
        if not hosts or len(healthy) == len(hosts):
            return healthy
        availability = min(100, OVERPROVISIONING_PERCENT * len(healthy) // len(hosts))
        panic = availability < 100 and 100.0 * len(healthy) / len(hosts) < self.policy.min_health_percent
        return list(hosts) if panic else healthy

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
            if (state.ejected_at is None and policy.consecutive_local_origin
                    and state.consecutive_local >= policy.consecutive_local_origin):
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
        if ((policy.consecutive_5xx and state.consecutive_5xx >= policy.consecutive_5xx)
                or (policy.consecutive_gateway and state.consecutive_gateway >= policy.consecutive_gateway)):
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


# ---------------------------------------------------------------- files


def load_policy_files(*paths: pathlib.Path) -> tuple[list[VirtualService], list[DestinationRule]]:
    """Every VirtualService and DestinationRule in the YAML files (multi-document
    files allowed; other kinds are skipped)."""
    import yaml

    services, rules = [], []
    for path in paths:
        try:
            documents = list(yaml.safe_load_all(path.read_text()))
        except (OSError, yaml.YAMLError) as exc:
            raise PolicyError(f"{path}: cannot read it as YAML: {exc}") from None
        for i, doc in enumerate(d for d in documents if d):
            where = f"{path} (document {i + 1})"
            _mapping(doc, where)
            if doc.get("kind") == "VirtualService":
                services.append(parse_virtual_service(doc, where))
            elif doc.get("kind") == "DestinationRule":
                rules.append(parse_destination_rule(doc, where))
    by_host = {r.host: r for r in rules}
    for service in services:
        for route in service.routes:
            for destination in route.destinations:
                rule = by_host.get(destination.host)
                if destination.subset and (rule is None or destination.subset not in rule.subsets):
                    raise PolicyError(f"VirtualService {service.name} route {route.name} names subset "
                                      f"{destination.subset!r} of {destination.host}, which no DestinationRule defines")
    return services, rules


class PolicyFiles:
    """The VirtualService and DestinationRule for one host, read from YAML files
    and read again when a file changes. A change that does not parse is logged
    and the last good policy stays in force: traffic never stops for a typo."""

    def __init__(self, paths: list[pathlib.Path], host: str, log=None):
        self._paths = [pathlib.Path(p) for p in paths]
        self._host = host
        self._log = log
        self._stamp: tuple = ()
        self.service: VirtualService | None = None
        self.rule: DestinationRule | None = None
        self.reload(strict=True)

    def _files_stamp(self) -> tuple:
        return tuple((p, p.stat().st_mtime_ns, p.stat().st_size) if p.exists() else (p, 0, 0) for p in self._paths)

    def reload(self, strict: bool = False) -> bool:
        """Reads the files if they changed; returns whether the policy changed."""
        stamp = self._files_stamp()
        if stamp == self._stamp:
            return False
        try:
            services, rules = load_policy_files(*self._paths)
            service = next((s for s in services if self._host in s.hosts), None)
            rule = next((r for r in rules if r.host == self._host), None)
            if service is None:
                raise PolicyError(f"no VirtualService in {[str(p) for p in self._paths]} lists host {self._host!r}")
        except Exception as exc:  # a typo of any shape keeps the last good policy
            if strict:
                raise exc if isinstance(exc, PolicyError) else PolicyError(f"{type(exc).__name__}: {exc}") from exc
            if self._log is not None:
                self._log.error("traffic policy not reloaded, the previous one stays in force: %s", exc)
            self._stamp = stamp
            return False
        self._stamp, self.service, self.rule = stamp, service, rule
        if self._log is not None:
            self._log.info("traffic policy for %s: %s", self._host, describe(service))
        return True


def describe(service: VirtualService) -> str:
    return "; ".join(f"{r.name}: " + ", ".join(f"{d.subset or d.host}={d.weight}" for d in r.destinations)
                     for r in service.routes)
