"""The policy itself: VirtualServices (routes in order, first match wins, on
header exact / prefix / regex; weighted destinations; retries; timeouts) and
DestinationRules (subsets by label, outlier detection per subset), read from
YAML files and re-read when they change."""

from __future__ import annotations

import dataclasses
import pathlib
import random
import re

from services.common.traffic import balancing, fields, retries
from services.common.traffic.fields import PolicyError
from services.common.traffic.outlier import OutlierPolicy, from_traffic_policy
from services.common.traffic.retries import RetryPolicy


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
        return balancing.pick(self.destinations, rng)


@dataclasses.dataclass(frozen=True)
class VirtualService:
    name: str
    hosts: tuple[str, ...]
    routes: tuple[Route, ...]

    def route(self, headers: dict[str, str]) -> Route | None:
        """Routes in order; the first that matches wins."""
        return next((r for r in self.routes if r.applies(headers)), None)


def parse_virtual_service(doc: dict, where: str) -> VirtualService:
    name, spec = fields.resource(doc, "VirtualService", where)
    hosts = tuple(fields.require(spec, "hosts", list, f"{where}: spec"))
    routes = []
    for i, http in enumerate(fields.require(spec, "http", list, f"{where}: spec")):
        at = f"{where}: spec.http[{i}]"
        fields.mapping(http, at)
        blocks = []
        for j, match in enumerate(fields.sequence(http.get("match", []) or [], f"{at}.match")):
            fields.mapping(match, f"{at}.match[{j}]")
            headers = []
            for header, rule in fields.mapping(match.get("headers") or {}, f"{at}.match[{j}].headers").items():
                if not isinstance(rule, dict) or len(rule) != 1 or next(iter(rule)) not in ("exact", "prefix", "regex"):
                    raise PolicyError(
                        f"{at}.match[{j}].headers.{header}: expected one of exact, prefix, regex; got {rule!r}"
                    )
                ((kind, value),) = rule.items()
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
        items = fields.require(http, "route", list, at)
        for j, item in enumerate(items):
            dest = fields.require(item, "destination", dict, f"{at}.route[{j}]")
            weight = item.get("weight", 0)  # Istio's default: an omitted weight is 0
            if not isinstance(weight, int) or isinstance(weight, bool) or weight < 0:
                raise PolicyError(f"{at}.route[{j}]: field 'weight' must be an integer >= 0, got {weight!r}")
            if len(items) == 1:
                weight = 100  # a lone destination takes all traffic, whatever its weight says
            destinations.append(
                Destination(
                    fields.require(dest, "host", str, f"{at}.route[{j}].destination"), dest.get("subset", ""), weight
                )
            )
        if not any(d.weight for d in destinations):  # only a route of several can get here, as in Istio
            raise PolicyError(f"{at}: the weights of its destinations add up to 0 (an omitted weight is 0)")
        routes.append(
            Route(
                http.get("name", f"http[{i}]"),
                tuple(blocks),
                tuple(destinations),
                retries.parse_retries(http.get("retries"), f"{at}.retries"),
                fields.parse_duration(http["timeout"], f"{at}.timeout") if "timeout" in http else None,
            )
        )
    return VirtualService(name, hosts, tuple(routes))


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
    name, spec = fields.resource(doc, "DestinationRule", where)
    subsets, subset_outliers = {}, {}
    for i, subset in enumerate(fields.sequence(spec.get("subsets", []) or [], f"{where}: spec.subsets")):
        at = f"{where}: spec.subsets[{i}]"
        subset_name = fields.require(subset, "name", str, at)
        subsets[subset_name] = {str(k): str(v) for k, v in fields.require(subset, "labels", dict, at).items()}
        outlier = from_traffic_policy(subset.get("trafficPolicy"), f"{at}.trafficPolicy")
        if outlier is not None:
            subset_outliers[subset_name] = outlier
    outlier = from_traffic_policy(spec.get("trafficPolicy"), f"{where}: spec.trafficPolicy")
    return DestinationRule(name, fields.require(spec, "host", str, f"{where}: spec"), subsets, outlier, subset_outliers)


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
            fields.mapping(doc, where)
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
                    raise PolicyError(
                        f"VirtualService {service.name} route {route.name} names subset "
                        f"{destination.subset!r} of {destination.host}, which no DestinationRule defines"
                    )
    return services, rules


class PolicyFiles:
    """The VirtualService and DestinationRule for one host, read from YAML files
    and read again when a file changes. A change that does not parse is logged
    and the last good policy stays in force: traffic never stops for a typo."""

    def __init__(self, paths: list[pathlib.Path], host: str, log=None):
        self._paths = [pathlib.Path(p) for p in paths]
        self._host = host
        self._log = log
        self._stamp: tuple | None = None  # of the files last read; None: not read yet
        self.service: VirtualService  # set by the first reload, which raises without one
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
    return "; ".join(
        f"{r.name}: " + ", ".join(f"{d.subset or d.host}={d.weight}" for d in r.destinations) for r in service.routes
    )
