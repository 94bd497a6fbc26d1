"""Checks the Kubernetes and Istio manifests against upstream definitions and
against each other:  python -m tools.manifests [KUSTOMIZATION ...]

Each kustomization (default: every overlay in mesh/kubernetes/overlays) is
rendered by the real kustomize (bin/kustomize, built by `make setup`), then:

- Kubernetes resources are validated against the Kubernetes OpenAPI schemas
  (kubernetes-validate, strict: an unknown field is an error);
- Istio resources against the OpenAPI schemas of Istio's own CRDs (the
  istio.io/api Go module, fetched by `make setup`), and the PrometheusRule
  against the Prometheus Operator's CRD (its Go module, likewise), with unknown
  fields rejected as the API server's strict field validation does, and with the
  CRDs' x-kubernetes-validations CEL rules evaluated;
- the rules Istio checks in code rather than in its schemas (retry policies,
  weights, subset names, durations, header matches, unreachable routes);
- cross-resource rules: every route's host is a Service and every subset it
  names is defined and selects pods; Service ports name a protocol and reach
  a container port; probes ask for health services our servers register;
  every INFERMESH_* variable (env, or a ConfigMap's by envFrom) is a field of
  that service's config or a tracing setting, and every service receives the
  same tracing settings, each valid; each caller that the configuration
  (ConfigMaps included) wires up is allowed by the callee's AuthorizationPolicy; routes that carry bidirectional streams have no
  timeout; outlier detection can eject with the pool's fewest replicas;
  autoscalers read metrics that prometheus-adapter serves and our services
  export, and own the replica count of what they scale; the dashboard's queries and the
  alert rules name series, labels and label values that exist, and the Grafana data
  sources link exemplars to a provisioned tracing data source (tools/monitoring.py);
  every container of every Deployment requests CPU and memory, has a memory limit,
  readiness and liveness probes and a restricted security context; each pod's
  memory limit covers its service's byte budget plus that service's baseline;
  every Deployment has one PodDisruptionBudget that lets a pod go but not all;
  a stopped pod leaves its endpoints before it drains (preStop withdraws it and
  outwaits the readiness probe) and neither it nor its sidecar is cut off
  mid-drain (terminationGracePeriodSeconds, terminationDrainDuration, each
  service's drain grace from its args, environment or config default).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import pathlib
import re
import subprocess
import sys
import typing
import urllib.parse

import grpc
import yaml

from services.common.budget import HELD_COPIES
from services.common.serving import WITHDRAW_SIGNAL
from services.common.traffic import GRPC_RETRY_ON, HTTP_RETRY_ON, PolicyError, parse_duration
from tools import monitoring

ROOT = pathlib.Path(__file__).resolve().parent.parent
KUSTOMIZE = ROOT / "bin" / "kustomize"
ISTIO_CRDS = ROOT / "build" / "istio" / "customresourcedefinitions.gen.yaml"
PROMETHEUS_RULE_CRD = ROOT / "build" / "monitoring" / "monitoring.coreos.com_prometheusrules.yaml"
CRD_FILES = (ISTIO_CRDS, PROMETHEUS_RULE_CRD)
OVERLAYS = ROOT / "mesh" / "kubernetes" / "overlays"
ADAPTER_VALUES = ROOT / "mesh" / "kubernetes" / "monitoring" / "prometheus-adapter-values.yaml"
KUBERNETES_VERSION = "1.34"

SERVICES = {  # module -> (config class, env prefix)
    "router": ("services.router.config:RouterConfig", "INFERMESH_ROUTER_"),
    "batcher": ("services.batcher.config:BatcherConfig", "INFERMESH_BATCHER_"),
    "model_server": ("services.model_server.config:ModelServerConfig", "INFERMESH_MODEL_SERVER_"),
    "cache": ("services.cache.config:CacheConfig", "INFERMESH_CACHE_"),
}


class ManifestError(Exception):
    """The manifests could not be rendered or read (not a finding about their content)."""


# ---------------------------------------------------------------- rendering


def render(kustomization: pathlib.Path) -> list[dict]:
    """The resources `kustomize build` makes of a kustomization folder."""
    if not KUSTOMIZE.exists():
        raise ManifestError(f"{KUSTOMIZE} is missing: run `make setup`")
    done = subprocess.run([str(KUSTOMIZE), "build", str(kustomization)], capture_output=True, text=True)
    if done.returncode != 0:
        raise ManifestError(f"kustomize build {kustomization}: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def name_of(doc: dict) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


# ---------------------------------------------------------------- Kubernetes schemas


def kubernetes_problems(doc: dict) -> list[str]:
    """Strict validation against the Kubernetes OpenAPI schema of the doc's apiVersion and kind."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        return [f"{name_of(doc)}: {where}: {exc.message}"]
    return []


def is_kubernetes_kind(doc: dict) -> bool:
    group = doc.get("apiVersion", "").rpartition("/")[0]
    return "." not in group or group.endswith(".k8s.io")


# ---------------------------------------------------------------- CRD schemas (Istio's, the PrometheusRule)


class CrdSchemas:
    """The openAPIV3Schema of every served version of the CRDs our manifests use."""

    def __init__(self, crd_files: tuple[pathlib.Path, ...] = CRD_FILES):
        self._schemas: dict[tuple[str, str], dict] = {}
        self._groups: set[str] = set()
        for crd_file in crd_files:
            if not crd_file.exists():
                raise ManifestError(f"{crd_file} is missing: run `make setup` (it fetches the CRDs' Go modules)")
            for crd in yaml.safe_load_all(crd_file.read_text()):
                if not crd or crd.get("kind") != "CustomResourceDefinition":
                    continue
                group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
                self._groups.add(group)
                for version in crd["spec"]["versions"]:
                    if version.get("served"):
                        self._schemas[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]

    def knows(self, doc: dict) -> bool:
        """Whether the doc's API group is one of these CRDs' (any Istio group counts as Istio's)."""
        group = doc.get("apiVersion", "").split("/")[0]
        return group in self._groups or group.endswith("istio.io")

    def problems(self, doc: dict) -> list[str]:
        import jsonschema

        schema = self._schemas.get((doc.get("apiVersion"), doc.get("kind")))
        if schema is None:
            return [f"{name_of(doc)}: no CRD defines {doc.get('kind')} in {doc.get('apiVersion')}"]
        found = []
        spec_schema = schema["properties"]["spec"]
        validator = jsonschema.Draft7Validator(_strict(spec_schema), format_checker=None)
        for error in sorted(validator.iter_errors(doc.get("spec", {})), key=lambda e: list(e.path)):
            where = ".".join(str(p) for p in error.path) or "spec"
            found.append(
                f"{name_of(doc)}: spec.{where}: {error.message}"
                if error.path
                else f"{name_of(doc)}: spec: {error.message}"
            )
        found += [f"{name_of(doc)}: {p}" for p in _cel_problems(spec_schema, doc.get("spec", {}), "spec")]
        return found


def _strict(schema):
    """A copy of a structural schema that rejects fields it does not declare
    (the API server's strict field validation) and reads Kubernetes' extensions."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable"):
        out.pop("nullable")
        if "type" in out:
            out["type"] = [out["type"], "null"]
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def _cel_program(rule: str):
    import celpy

    environment = celpy.Environment()
    return environment.program(environment.compile(rule), functions=_kubernetes_cel_functions())


@functools.cache
def _kubernetes_cel_functions() -> dict:
    """The URL library the API server adds to CEL (isURL, url and its getters;
    Istio's rules on jwksUri and Wasm URLs use them), after Go's url.ParseRequestURI."""
    import urllib.parse

    from celpy import CELEvalError, celtypes

    def parses(text) -> bool:
        text = str(text)
        if not text or any(c.isspace() or ord(c) < 0x20 for c in text):
            return False
        return text.startswith("/") or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", text) is not None

    def url(text):
        if not parses(text):
            raise CELEvalError(f"URL parse error during conversion from string: {text!r}")
        return celtypes.StringType(text)

    def part(name):
        return lambda value: celtypes.StringType(getattr(urllib.parse.urlsplit(str(value)), name) or "")

    return {
        "isURL": lambda text: celtypes.BoolType(parses(text)),
        "url": url,
        "getScheme": part("scheme"),
        "getHost": part("netloc"),
        "getHostname": part("hostname"),
        "getPort": lambda value: celtypes.StringType(str(urllib.parse.urlsplit(str(value)).port or "")),
        "getEscapedPath": part("path"),
        "getQuery": part("query"),
    }


def _cel_problems(schema: dict, value, where: str) -> list[str]:
    """Evaluates the x-kubernetes-validations rules of `schema` and of the
    schemas under it on `value`, as the API server does on create."""
    import celpy

    found = []
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:  # transition rules only apply to updates
            continue
        try:
            ok = _cel_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        except Exception as exc:  # noqa: BLE001 - celpy raises error types of its own for type mismatches
            found.append(f"{where}: CEL rule {rule['rule']!r} could not be evaluated: {exc}")
            continue
        if ok is not True and not (isinstance(ok, celpy.celtypes.BoolType) and bool(ok)):
            found.append(f"{where}: {rule.get('message') or 'fails ' + repr(rule['rule'])}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = properties.get(key) or (extra if isinstance(extra, dict) else None)
            if sub is not None:
                found += _cel_problems(sub, item, f"{where}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found += _cel_problems(schema["items"], item, f"{where}[{i}]")
    return found


# ---------------------------------------------------------------- Istio's rules in code

# Envoy's retry_on values that Istio accepts, besides HTTP status codes.
ISTIO_RETRY_ON = HTTP_RETRY_ON | set(GRPC_RETRY_ON)  # the tokens Istio accepts, as the local policy reads them
GRPC_STATUS_NAMES = {code.name for code in grpc.StatusCode}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~A-Za-z0-9]+$")
STRICT_HEADER_NAME = re.compile(r"^[-_A-Za-z0-9]+$")  # Istio's for headers it writes
# AuthorizationPolicy `when` keys (Istio's security.ValidateAttribute).
MAP_ATTRIBUTES = ("request.headers", "request.auth.claims", "experimental.")
PLAIN_ATTRIBUTES = {
    "source.ip",
    "remote.ip",
    "source.namespace",
    "source.serviceAccount",
    "source.principal",
    "source.trustDomain",
    "request.auth.principal",
    "request.auth.audiences",
    "request.auth.presenter",
    "destination.ip",
    "destination.port",
    "connection.sni",
}
HTTP_STATUS = (
    set(range(100, 104))
    | set(range(200, 209))
    | {226}
    | set(range(300, 309))
    | set(range(400, 419))
    | set(range(421, 427))
    | {428, 429, 431, 451}
    | set(range(500, 509))
    | {510, 511}
)


def _duration_problem(value, where: str) -> list[str]:
    if not isinstance(value, str):
        return [f"{where}: {value!r} is not a duration"]
    try:
        seconds = parse_duration(value, where)
    except PolicyError:
        return [f"{where}: {value!r} is not a duration"]
    if seconds < 1e-3:
        return [f"{where}: {value!r} is shorter than 1ms"]
    return []


def istio_code_problems(doc: dict) -> list[str]:
    kind, spec, name = doc.get("kind"), doc.get("spec") or {}, name_of(doc)
    found: list[str] = []
    if kind == "VirtualService":
        if not spec.get("hosts"):
            found.append(f"{name}: spec.hosts: a VirtualService needs at least one host")
        catch_all = None
        for i, http in enumerate(spec.get("http") or []):
            at = f"{name}: spec.http[{i}]"
            if catch_all is not None:
                found.append(f"{at}: unreachable, route {catch_all} before it has no match")
            if not http.get("match"):
                catch_all = http.get("name", i)
            for j, match in enumerate(http.get("match") or []):
                for header, rule in (match.get("headers") or {}).items():
                    if not HEADER_NAME.match(header) or header != header.lower():
                        found.append(f"{at}.match[{j}].headers: {header!r} is not a lower-case header name")
                    if isinstance(rule, dict) and rule.get("prefix") == "":
                        found.append(f"{at}.match[{j}].headers.{header}: an empty prefix matches nothing")
                    if isinstance(rule, dict) and "regex" in rule:
                        if len(rule["regex"]) > 1024:
                            found.append(f"{at}.match[{j}].headers.{header}: regex longer than 1024")
                        try:
                            re.compile(rule["regex"])
                        except re.error as exc:
                            found.append(f"{at}.match[{j}].headers.{header}: regex {rule['regex']!r}: {exc}")
            destinations = http.get("route") or []
            if not destinations and not http.get("redirect") and not http.get("directResponse"):
                found.append(f"{at}: an HTTP route needs a destination")
            for j, item in enumerate(destinations):
                destination = item.get("destination") or {}
                if destination.get("host") in (None, "", "*"):
                    found.append(f"{at}.route[{j}]: invalid destination host {destination.get('host')!r}")
                if "subset" in destination and not DNS_LABEL.match(str(destination["subset"])):
                    found.append(f"{at}.route[{j}]: subset name {destination['subset']!r} is not a DNS-1123 label")
                weight = item.get("weight", 0)  # relative to the route's others: any integer >= 0
                if not isinstance(weight, int) or isinstance(weight, bool) or weight < 0:
                    found.append(f"{at}.route[{j}]: weight {weight!r} must be an integer >= 0")
            if len(destinations) > 1 and sum(int(d.get("weight", 0)) for d in destinations) == 0:
                found.append(f"{at}: total destination weight = 0")
            if "timeout" in http:
                found += _duration_problem(http["timeout"], f"{at}.timeout")
            retries = http.get("retries")
            if retries is not None:
                attempts = retries.get("attempts", 0)
                if attempts < 0:
                    found.append(f"{at}.retries.attempts: cannot be negative, got {attempts}")
                if attempts == 0 and any(k in retries for k in ("perTryTimeout", "retryOn", "retryRemoteLocalities")):
                    found.append(f"{at}.retries: a retry policy with attempts 0 (retries off) must say nothing else")
                if "perTryTimeout" in retries:
                    found += _duration_problem(retries["perTryTimeout"], f"{at}.retries.perTryTimeout")
                for token in str(retries.get("retryOn", "")).split(",") if retries.get("retryOn") else []:
                    if token not in ISTIO_RETRY_ON and not (token.isdigit() and int(token) in HTTP_STATUS):
                        found.append(f"{at}.retries.retryOn: {token!r} is not a valid retryOn policy")
            abort = (http.get("fault") or {}).get("abort") or {}
            if "grpcStatus" in abort and abort["grpcStatus"] not in GRPC_STATUS_NAMES:
                found.append(f"{at}.fault.abort.grpcStatus: {abort['grpcStatus']!r} is not a gRPC status name")
            percentage = (abort.get("percentage") or {}).get("value")
            if percentage is not None and not 0 <= percentage <= 100:
                found.append(f"{at}.fault.abort.percentage: {percentage} is not 0..100")
    elif kind == "DestinationRule":
        for i, subset in enumerate(spec.get("subsets") or []):
            if not DNS_LABEL.match(str(subset.get("name", ""))):
                found.append(f"{name}: spec.subsets[{i}].name {subset.get('name')!r} is not a DNS-1123 label")
        policy = spec.get("trafficPolicy")
        if policy is not None:
            if not policy:
                found.append(f"{name}: spec.trafficPolicy must have at least one field")
            pool = policy.get("connectionPool")
            if pool is not None and not (pool.get("http") or pool.get("tcp")):
                found.append(f"{name}: spec.trafficPolicy.connectionPool must have at least one field")
            for key, value in {**(pool or {}).get("http", {}), **(pool or {}).get("tcp", {})}.items():
                if isinstance(value, int) and value < 0:
                    found.append(f"{name}: connectionPool {key} must be non-negative, got {value}")
                if key in ("connectTimeout", "idleTimeout", "maxConnectionDuration"):
                    found += _duration_problem(value, f"{name}: connectionPool.{key}")
            outlier = policy.get("outlierDetection")
            if outlier is not None:
                for key in ("interval", "baseEjectionTime"):
                    if key in outlier:
                        found += _duration_problem(outlier[key], f"{name}: outlierDetection.{key}")
                for key in ("maxEjectionPercent", "minHealthPercent"):
                    if key in outlier and not 0 <= outlier[key] <= 100:
                        found.append(f"{name}: outlierDetection.{key} must be 0..100, got {outlier[key]}")
                if outlier.get("consecutiveLocalOriginFailures") and not outlier.get("splitExternalLocalOriginErrors"):
                    found.append(
                        f"{name}: outlierDetection.consecutiveLocalOriginFailures needs splitExternalLocalOriginErrors"
                    )
    elif kind == "RequestAuthentication":
        for i, rule in enumerate(spec.get("jwtRules") or []):
            at = f"{name}: spec.jwtRules[{i}]"
            if not rule.get("issuer") and not rule.get("jwksUri"):
                found.append(f"{at}: issuer or jwksUri must be non-empty string")
            if rule.get("jwksUri") and urllib.parse.urlsplit(rule["jwksUri"]).scheme not in ("http", "https"):
                found.append(f"{at}.jwksUri: URI scheme of {rule['jwksUri']!r} is not supported")
            if any(not audience for audience in rule.get("audiences") or []):
                found.append(f"{at}.audiences: audience must be non-empty string")
            if any(not (location or {}).get("name") for location in rule.get("fromHeaders") or []):
                found.append(f"{at}.fromHeaders: location header name must be non-empty string")
            for output in rule.get("outputClaimToHeaders") or []:
                if not output.get("claim") or not output.get("header"):
                    found.append(f"{at}.outputClaimToHeaders: header and claim value must be non-empty string")
                elif not STRICT_HEADER_NAME.match(output["header"]):
                    found.append(
                        f"{at}.outputClaimToHeaders: header name {output['header']} is not a valid header name"
                    )
    elif kind == "AuthorizationPolicy":
        if spec.get("action") == "DENY" and spec.get("rules") is None:
            found.append(f"{name}: DENY action without `rules` is meaningless as it will never be triggered")
        for i, rule in enumerate(spec.get("rules") or []):
            for condition in rule.get("when") or []:
                key = condition.get("key", "")
                if not (condition.get("values") or condition.get("notValues")):
                    found.append(
                        f"{name}: spec.rules[{i}]: at least one of `values` or `notValues` must be set for key {key}"
                    )
                if key.startswith(MAP_ATTRIBUTES):
                    if not re.match(r"^[^\[]+\[.+\]$", key):
                        found.append(f"{name}: spec.rules[{i}]: bad key ({key}): should have format a[b]")
                elif key not in PLAIN_ATTRIBUTES:
                    found.append(f"{name}: spec.rules[{i}]: unknown attribute: {key}")
            if spec.get("action") == "DENY" and not any(
                (t.get("operation") or {}).get("ports") or (t.get("operation") or {}).get("notPorts")
                for t in rule.get("to") or []
            ):
                # Istio warns: HTTP attributes alone in a DENY rule deny every TCP connection in its scope.
                found.append(
                    f"{name}: spec.rules[{i}]: a DENY rule of HTTP attributes without ports denies all "
                    "TCP traffic in its scope; name the ports"
                )
            for source in (s.get("source", {}) for s in rule.get("from") or []):
                for principal in source.get("principals", []):
                    if principal != "*" and not re.match(r"^[^/]+/ns/[^/]+/sa/[^/]+$", principal):
                        found.append(
                            f"{name}: spec.rules[{i}]: principal {principal!r} is not "
                            "<trust domain>/ns/<namespace>/sa/<service account>"
                        )
            for operation in (t.get("operation", {}) for t in rule.get("to") or []):
                for port in operation.get("ports", []):
                    if not str(port).isdigit() or not 0 < int(port) <= 65535:
                        found.append(f"{name}: spec.rules[{i}]: port {port!r} is not 1..65535")
    return found


# ---------------------------------------------------------------- across resources


@dataclasses.dataclass
class Workload:
    """A Deployment as the mesh sees it: labels of its pods, their containers."""

    doc: dict

    @property
    def name(self) -> str:
        return self.doc["metadata"]["name"]

    @property
    def labels(self) -> dict:
        return self.doc["spec"]["template"]["metadata"].get("labels", {})

    @property
    def pod(self) -> dict:
        return self.doc["spec"]["template"]["spec"]

    @property
    def containers(self) -> list[dict]:
        return self.pod.get("containers", [])

    @property
    def service_account(self) -> str:
        return self.pod.get("serviceAccountName", "default")

    def selected_by(self, selector: dict) -> bool:
        return bool(selector) and all(self.labels.get(k) == v for k, v in selector.items())

    def port_names(self) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for c in self.containers for p in c.get("ports", []) if "name" in p}

    def service_module(self, container: dict) -> str | None:
        """Which of our services a container runs (python -m services.<name>)."""
        argv = [*container.get("command", []), *container.get("args", [])]
        for i, arg in enumerate(argv[:-1]):
            if arg == "-m" and argv[i + 1].startswith("services."):
                return argv[i + 1].split(".")[1]
        return None


@functools.cache
def health_services(module: str) -> frozenset[str]:
    """The grpc.health.v1 service names a service of ours registers ("" is the whole server)."""
    server = importlib.import_module(f"services.{module}.server")
    return frozenset({"", *(getattr(server, n) for n in ("SERVICE_NAME", "OIP_SERVICE_NAME") if hasattr(server, n))})


@functools.cache
def streams_bidirectionally(module: str) -> bool:
    """Whether the gRPC service a module serves has a bidirectional-streaming method."""
    from google.protobuf import descriptor_pool

    server = importlib.import_module(f"services.{module}.server")
    service = descriptor_pool.Default().FindServiceByName(server.SERVICE_NAME)
    return any(m.client_streaming and m.server_streaming for m in service.methods)


@functools.cache
def config_fields(module: str) -> frozenset[str]:
    path, cls = SERVICES[module][0].split(":")
    return frozenset(f.name for f in dataclasses.fields(getattr(importlib.import_module(path), cls)))


# What every service reads besides its own INFERMESH_<SERVICE>_* settings: the
# tracing settings (TracingConfig, services/common/tracing.py: INFERMESH_ + field).
TRACING_SETTINGS = ("INFERMESH_OTLP_ENDPOINT", "INFERMESH_TRACE_RATIO", "INFERMESH_CALLER_TRACES_PER_S")


def environment(container: dict, config_maps: dict[str, dict]) -> tuple[dict[str, str | None], list[str]]:
    """The variables a container starts with, as the kubelet sets them: envFrom's
    ConfigMaps (with their prefix), then env, which wins over them; a value from
    a ConfigMap's key is read, one from a Secret or the downward API is None.
    Second, what cannot be resolved: a ConfigMap or key that is not among `config_maps`."""
    values: dict[str, str | None] = {}
    unresolved = []
    for source in container.get("envFrom", []):
        reference = source.get("configMapRef")
        if reference is None:
            continue  # a Secret's keys are the cluster's to know
        config_map = config_maps.get(reference["name"])
        if config_map is None:
            if not reference.get("optional"):
                unresolved.append(f"envFrom names ConfigMap {reference['name']!r}, which does not exist")
            continue
        for key, value in (config_map.get("data") or {}).items():
            values[source.get("prefix", "") + key] = str(value)
    for env in container.get("env", []):
        if env.get("value") is not None:
            values[env["name"]] = str(env["value"])
            continue
        key_reference = (env.get("valueFrom") or {}).get("configMapKeyRef")
        if key_reference is None:
            values[env["name"]] = None if "valueFrom" in env else ""
            continue
        data = (config_maps.get(key_reference["name"]) or {}).get("data") or {}
        if key_reference["key"] in data:
            values[env["name"]] = str(data[key_reference["key"]])
        elif not key_reference.get("optional"):
            unresolved.append(
                f"{env['name']} reads key {key_reference['key']!r} of ConfigMap {key_reference['name']!r}, "
                "which does not exist"
            )
    return values, unresolved


def tracing_problems(module: str, container: dict, values: dict[str, str | None]) -> list[str]:
    """A container of ours receives every tracing setting, each a value its service accepts."""
    name = container["name"]
    found = [
        f"container {name} receives no {setting}: services.{module} would fall back to its own default "
        "(envFrom the infermesh-tracing ConfigMap, as every service does)"
        for setting in TRACING_SETTINGS
        if setting not in values
    ]
    endpoint = values.get("INFERMESH_OTLP_ENDPOINT")
    if endpoint:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            found.append(f"container {name}: INFERMESH_OTLP_ENDPOINT {endpoint!r} is not host:port")
    for setting, low, high in (("INFERMESH_TRACE_RATIO", 0.0, 1.0), ("INFERMESH_CALLER_TRACES_PER_S", 0.0, None)):
        value = values.get(setting)
        if value is None:
            continue
        number = _seconds(value)
        if number is None or number < low or (high is not None and number > high):
            bound = f"within {low:g}..{high:g}" if high is not None else f">= {low:g}"
            found.append(f"container {name}: {setting} {value!r} is not a number {bound}")
    return found


QUANTITY = re.compile(r"^([0-9.]+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
QUANTITY_UNITS = {
    None: 1,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


def quantity_bytes(value) -> int | None:
    """A Kubernetes memory quantity (1Gi, 512Mi, 1e9 as 1000000000) in bytes; None when not one."""
    match = QUANTITY.match(str(value))
    return int(float(match.group(1)) * QUANTITY_UNITS[match.group(2)]) if match else None


def memory_problems(module: str, container: dict) -> list[str]:
    """The container's memory limit must cover what its service may take with
    its byte budget full (baseline + copies x budget), with its config built
    from the container's environment as the service would build it (the
    downward API's limits.memory read as the limit itself)."""
    from services.common.config import _parse

    limit = quantity_bytes((container.get("resources") or {}).get("limits", {}).get("memory", ""))
    if limit is None:
        return [
            f"container {container['name']} has no memory limit: services.{module}'s byte budget would bound "
            "nothing the kernel enforces"
        ]
    path, cls_name = SERVICES[module][0].split(":")
    cls = getattr(importlib.import_module(path), cls_name)
    prefix = SERVICES[module][1]
    hints = typing.get_type_hints(cls)
    fields = {}
    for env in container.get("env", []):
        name = env["name"][len(prefix) :].lower() if env["name"].startswith(prefix) else None
        if name not in hints:
            continue
        if "value" in env:
            fields[name] = _parse(hints[name], str(env["value"]))
        elif ((env.get("valueFrom") or {}).get("resourceFieldRef") or {}).get("resource") == "limits.memory":
            fields[name] = limit
    try:
        config = cls(**fields)
    except (TypeError, ValueError) as exc:
        return [f"services.{module}'s config from container {container['name']}'s environment is refused: {exc}"]
    if config.memory_needed_bytes > limit:
        return [
            f"container {container['name']}'s memory limit {limit} bytes is below what services.{module} may "
            f"take: baseline {config.baseline_bytes} + its byte budget {config.budget_bytes} x "
            f"{HELD_COPIES} copies = {config.memory_needed_bytes} bytes"
        ]
    return []


# Stopping a pod (docs/kubernetes.md, Rollouts and drains): the preStop hook withdraws
# the service and waits while callers learn it; SIGTERM then starts the drain.
ENDPOINT_PROPAGATION_S = 3.0  # a not-ready endpoint reaching every caller's sidecar (istiod's push) and kube-proxy
SHUTDOWN_MARGIN_S = 5.0  # after the drain: closing clients, and the kubelet's own latency
ISTIO_TERMINATION_DRAIN_S = 5.0  # pilot-agent's terminationDrainDuration when a pod sets none
KUBERNETES_GRACE_S = 30  # terminationGracePeriodSeconds when a pod sets none
WITHDRAW_KILL = re.compile(
    rf"\bkill\s+(?:-s\s+)?-?(?:SIG)?({WITHDRAW_SIGNAL.name.removeprefix('SIG')}|"
    rf"{int(WITHDRAW_SIGNAL)})\s+1\b"
)
SLEEP = re.compile(r"\bsleep\s+([0-9]+(?:\.[0-9]+)?)\b")


def drain_grace(module: str, container: dict) -> tuple[float | None, str]:
    """The drain grace a container's service runs with and where it comes from:
    its args (--drain-grace-s), else its environment, else its config's default."""
    path, cls_name = SERVICES[module][0].split(":")
    field = next(
        f for f in dataclasses.fields(getattr(importlib.import_module(path), cls_name)) if f.name == "drain_grace_s"
    )
    args = [*container.get("command", []), *container.get("args", [])]
    for i, arg in enumerate(args):
        if arg == "--drain-grace-s" and i + 1 < len(args):
            return _seconds(args[i + 1]), "args --drain-grace-s"
        if arg.startswith("--drain-grace-s="):
            return _seconds(arg.partition("=")[2]), "args --drain-grace-s"
    variable = f"{SERVICES[module][1]}DRAIN_GRACE_S"
    for env in container.get("env", []):
        if env["name"] == variable:
            return _seconds(env.get("value")), f"env {variable}"
    return float(field.default), f"services.{module}'s default drain_grace_s"


def _seconds(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def pre_stop(container: dict) -> tuple[float, bool]:
    """How long a container's preStop hook holds off SIGTERM (0 without one) and
    whether it withdraws the service first (WITHDRAW_SIGNAL to the process)."""
    hook = (container.get("lifecycle") or {}).get("preStop") or {}
    if "sleep" in hook:
        return float(hook["sleep"].get("seconds", 0)), False
    command = " ".join(str(part) for part in (hook.get("exec") or {}).get("command", []))
    return sum(float(s) for s in SLEEP.findall(command)), WITHDRAW_KILL.search(command) is not None


def sidecar_drain(pod_template: dict) -> tuple[float | None, str]:
    """How long the pod's Istio sidecar carries connections after its SIGTERM
    (None: no sidecar, or it waits for zero connections instead of a time)."""
    metadata = pod_template.get("metadata", {})
    annotations, labels = metadata.get("annotations") or {}, metadata.get("labels") or {}
    if "false" in (annotations.get("sidecar.istio.io/inject"), labels.get("sidecar.istio.io/inject")):
        return None, "no sidecar"
    config = json.loads(annotations.get("proxy.istio.io/config") or "{}")
    if str((config.get("proxyMetadata") or {}).get("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "")).lower() == "true":
        return None, "EXIT_ON_ZERO_ACTIVE_CONNECTIONS"
    if "terminationDrainDuration" not in config:
        return ISTIO_TERMINATION_DRAIN_S, "Istio's default terminationDrainDuration"
    return parse_duration(
        config["terminationDrainDuration"], "terminationDrainDuration"
    ), f"proxy.istio.io/config terminationDrainDuration {config['terminationDrainDuration']}"


def drain_problems(workload: Workload) -> list[str]:
    """A stopped pod leaves its endpoints before it drains and is not killed
    while draining: preStop withdraws the service (readiness fails) and waits
    longer than the readiness probe takes to see it plus callers to learn it;
    the grace period covers preStop + drain grace + margin; the sidecar,
    stopped at once (its SIGTERM does not wait for the app's preStop), carries
    connections through preStop + drain grace and exits within the grace."""
    found = []
    pod = workload.doc["spec"]["template"]
    grace = pod["spec"].get("terminationGracePeriodSeconds", KUBERNETES_GRACE_S)
    try:
        sidecar_s, sidecar_from = sidecar_drain(pod)
    except (json.JSONDecodeError, PolicyError) as exc:
        return [f"Deployment/{workload.name}: proxy.istio.io/config: {exc}"]
    at = f"Deployment/{workload.name}"
    for container in workload.containers:
        module = workload.service_module(container)
        if module not in SERVICES:
            continue
        name = container["name"]
        drain_s, drain_from = drain_grace(module, container)
        if drain_s is None:
            found.append(f"{at}: container {name}'s drain grace ({drain_from}) is not a number of seconds")
            continue
        delay_s, withdraws = pre_stop(container)
        if not withdraws:
            found.append(
                f"{at}: container {name}'s lifecycle.preStop does not withdraw services.{module} "
                f"(kill -{WITHDRAW_SIGNAL.name.removeprefix('SIG')} 1): its readiness stays true until "
                "SIGTERM, so callers learn of the stop only once it drains"
            )
        probe = container.get("readinessProbe") or {}
        if "grpc" not in probe:
            found.append(
                f"{at}: container {name}'s readinessProbe is no gRPC health probe: it cannot see the "
                "withdrawal's NOT_SERVING"
            )
        else:
            period, threshold = probe.get("periodSeconds", 10), probe.get("failureThreshold", 3)
            seen_s = period * threshold + ENDPOINT_PROPAGATION_S
            if seen_s > delay_s:
                found.append(
                    f"{at}: container {name}'s readinessProbe periodSeconds {period} x failureThreshold "
                    f"{threshold} + {ENDPOINT_PROPAGATION_S:g} s for callers to learn it = {seen_s:g} s is "
                    f"longer than lifecycle.preStop's delay {delay_s:g} s: the pod still takes calls when "
                    "SIGTERM starts its drain"
                )
        needed_s = delay_s + drain_s + SHUTDOWN_MARGIN_S
        if grace < needed_s:
            found.append(
                f"{at}: terminationGracePeriodSeconds {grace} is below container {name}'s preStop "
                f"{delay_s:g} s + drain grace {drain_s:g} s ({drain_from}) + margin "
                f"{SHUTDOWN_MARGIN_S:g} s = {needed_s:g} s: the drain would be killed"
            )
        if sidecar_s is not None and sidecar_s < delay_s + drain_s:
            found.append(
                f"{at}: the sidecar's drain {sidecar_s:g} s ({sidecar_from}) is shorter than container "
                f"{name}'s preStop {delay_s:g} s + drain grace {drain_s:g} s ({drain_from}) = "
                f"{delay_s + drain_s:g} s: its sidecar would stop carrying its calls mid-drain"
            )
    if sidecar_s is not None and sidecar_s >= grace:
        found.append(
            f"{at}: the sidecar's drain {sidecar_s:g} s ({sidecar_from}) is not within "
            f"terminationGracePeriodSeconds {grace}: it would be killed, not exit"
        )
    return found


def workload_problems(workload: Workload) -> list[str]:
    """What every container of every Deployment has, ours or not: CPU and memory
    requests and a memory limit (our services' limit is checked against their
    budget by memory_problems), readiness and liveness probes, and a restricted
    security context: not root, no privilege escalation, no capabilities, a
    read-only root filesystem, the runtime's seccomp profile."""
    at = f"Deployment/{workload.name}"
    pod_security = workload.pod.get("securityContext") or {}
    found = []
    for container in workload.containers:
        name = container["name"]
        security = container.get("securityContext") or {}
        resources = container.get("resources") or {}
        missing = [f"requests.{r}" for r in ("cpu", "memory") if r not in (resources.get("requests") or {})]
        if workload.service_module(container) not in SERVICES and "memory" not in (resources.get("limits") or {}):
            missing.append("limits.memory")
        if missing:
            found.append(f"{at}: container {name} sets no {', '.join(missing)}: the scheduler cannot place it fairly")
        for probe in ("readinessProbe", "livenessProbe"):
            if probe not in container:
                found.append(f"{at}: container {name} has no {probe}")
        effective = {**pod_security, **security}  # the container's own settings win over the pod's
        if effective.get("runAsNonRoot") is not True:
            found.append(f"{at}: container {name} may run as root (set runAsNonRoot: true)")
        if (effective.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{at}: container {name} runs without a seccomp profile (seccompProfile RuntimeDefault)")
        if security.get("privileged"):
            found.append(f"{at}: container {name} is privileged")
        if security.get("allowPrivilegeEscalation") is not False:
            found.append(f"{at}: container {name} may gain privileges (set allowPrivilegeEscalation: false)")
        if security.get("readOnlyRootFilesystem") is not True:
            found.append(f"{at}: container {name} may write its root filesystem (set readOnlyRootFilesystem: true)")
        if "ALL" not in ((security.get("capabilities") or {}).get("drop") or []):
            found.append(f"{at}: container {name} keeps Linux capabilities (drop: [ALL])")
    return found


def disruption_budgets(workload: Workload, budgets: list[dict], replicas: int) -> list[str]:
    """Exactly one PodDisruptionBudget selects the Deployment's pods, and at its
    fewest replicas it lets one be evicted (a node drain would hang otherwise)
    while keeping one serving where there are two or more."""
    at = f"Deployment/{workload.name}"
    mine = [b for b in budgets if workload.selected_by(b["spec"].get("selector", {}).get("matchLabels", {}))]
    if not mine:
        return [
            f"{at}: no PodDisruptionBudget selects its pods ({workload.labels}): a node drain may evict "
            "every replica at once"
        ]
    if len(mine) > 1:
        return [
            f"{at}: {len(mine)} PodDisruptionBudgets select its pods ({', '.join(map(name_of, mine))}): "
            "the eviction API refuses to evict such pods"
        ]
    (budget,) = mine
    spec = budget["spec"]
    if "maxUnavailable" in spec:
        field, value = "maxUnavailable", spec["maxUnavailable"]
        allowed = _budget_count(value, replicas)
    else:
        field, value = "minAvailable", spec.get("minAvailable", 1)
        allowed = replicas - _budget_count(value, replicas)
    if allowed < 1:
        return [
            f"{name_of(budget)}: {field} {value} with {at}'s {replicas} replica(s) allows no eviction: a "
            "node drain would wait forever"
        ]
    if replicas >= 2 and allowed >= replicas:
        return [f"{name_of(budget)}: {field} {value} with {at}'s {replicas} replicas lets every one be evicted at once"]
    return []


def fewest_replicas(workload: Workload, autoscalers: list[dict]) -> int:
    """The replica count a Deployment may run with: its autoscaler's minReplicas, else spec.replicas."""
    hpa = next((h for h in autoscalers if h["spec"]["scaleTargetRef"]["name"] == workload.name), None)
    return hpa["spec"].get("minReplicas", 1) if hpa else workload.doc["spec"].get("replicas", 1)


def stopping_problems(docs: list[dict]) -> list[str]:
    """Disruption budgets and stop timings of every Deployment among `docs`."""
    workloads = [Workload(d) for d in docs if d["kind"] == "Deployment"]
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    autoscalers = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    return [
        problem
        for w in workloads
        for problem in disruption_budgets(w, budgets, fewest_replicas(w, autoscalers)) + drain_problems(w)
    ]


def _budget_count(value, replicas: int) -> int:
    """A PDB's count of pods: an integer, or a percentage of replicas rounded up as Kubernetes does."""
    if isinstance(value, str) and value.endswith("%"):
        return -(-int(value[:-1]) * replicas // 100)
    return int(value)


def _short_host(host: str, namespace: str) -> str:
    """A VirtualService host as a Service name in the rules' namespace."""
    for suffix in (f".{namespace}.svc.cluster.local", f".{namespace}.svc", f".{namespace}"):
        if host.endswith(suffix):
            return host[: -len(suffix)]
    return host


def cross_problems(docs: list[dict], adapter_values: pathlib.Path = ADAPTER_VALUES) -> list[str]:
    found: list[str] = []
    by_kind: dict[str, list[dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    workloads = [Workload(d) for d in by_kind.get("Deployment", [])]
    services = {d["metadata"]["name"]: d for d in by_kind.get("Service", [])}
    accounts = {d["metadata"]["name"] for d in by_kind.get("ServiceAccount", [])}
    rules = {
        _short_host(d["spec"]["host"], d["metadata"].get("namespace", "")): d
        for d in by_kind.get("DestinationRule", [])
    }
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] not in ("Namespace",)}
    if len(namespaces) != 1 or None in namespaces:
        found.append(f"resources are spread over namespaces {sorted(map(str, namespaces))}; expected one")
    namespace = next(iter(namespaces - {None}), "")
    for ns in by_kind.get("Namespace", []):
        labels = ns["metadata"].get("labels", {})
        if labels.get("istio-injection") != "enabled" and "istio.io/rev" not in labels:
            found.append(f"{name_of(ns)}: no istio-injection=enabled label: pods would run without sidecars")

    def backing(service: dict) -> list[Workload]:
        return [w for w in workloads if w.selected_by(service["spec"].get("selector", {}))]

    def replicas(workload: Workload) -> int:
        return fewest_replicas(workload, by_kind.get("HorizontalPodAutoscaler", []))

    # Services: protocol-named ports that reach a container port of every pod behind them.
    for name, service in services.items():
        behind = backing(service)
        if not behind:
            found.append(f"Service/{name}: its selector {service['spec'].get('selector')} matches no Deployment")
        for port in service["spec"].get("ports", []):
            protocol = port.get("appProtocol") or port.get("name", "").split("-")[0]
            if protocol not in (
                "grpc",
                "http",
                "http2",
                "tcp",
                "tls",
                "https",
                "grpc-web",
                "mongo",
                "mysql",
                "redis",
                "udp",
            ):
                found.append(
                    f"Service/{name}: port {port.get('name')!r} names no protocol for Istio "
                    "(name it grpc-..., http-..., tcp-... or set appProtocol)"
                )
            target = port.get("targetPort", port["port"])
            for workload in behind:
                if isinstance(target, str) and target not in workload.port_names():
                    found.append(
                        f"Service/{name}: targetPort {target!r} is no container port of Deployment/{workload.name}"
                    )

    # Containers: probes, environment, service accounts.
    config_maps = {d["metadata"]["name"]: d for d in by_kind.get("ConfigMap", [])}
    tracing: dict[str, tuple[str | None, ...]] = {}
    for workload in workloads:
        if workload.service_account not in accounts:
            found.append(f"Deployment/{workload.name}: service account {workload.service_account!r} is not defined")
        for container in workload.containers:
            module = workload.service_module(container)
            ports = {p["containerPort"] for p in container.get("ports", [])}
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container.get(kind, {}).get("grpc")
                if probe is None:
                    continue
                if probe["port"] not in ports:
                    found.append(f"Deployment/{workload.name}: {kind} asks port {probe['port']}, not a container port")
                if module and probe.get("service", "") not in health_services(module):
                    found.append(
                        f"Deployment/{workload.name}: {kind} asks health of {probe.get('service')!r}; "
                        f"services.{module} registers {sorted(health_services(module))}"
                    )
            values, unresolved = environment(container, config_maps)
            found += [f"Deployment/{workload.name}: container {container['name']}: {p}" for p in unresolved]
            if module in SERVICES:
                prefix = SERVICES[module][1]
                for variable in values:
                    if variable.startswith(prefix):
                        if variable[len(prefix) :].lower() not in config_fields(module):
                            found.append(
                                f"Deployment/{workload.name}: {variable} sets no field of services.{module}'s "
                                f"config (fields: {', '.join(sorted(config_fields(module)))})"
                            )
                    elif variable.startswith("INFERMESH_") and variable not in TRACING_SETTINGS:
                        found.append(
                            f"Deployment/{workload.name}: {variable} is read by no service "
                            f"(services.{module} reads {prefix}* and {', '.join(TRACING_SETTINGS)})"
                        )
                found += [f"Deployment/{workload.name}: {p}" for p in tracing_problems(module, container, values)]
                tracing[f"Deployment/{workload.name}"] = tuple(values.get(s) for s in TRACING_SETTINGS)
    # One collector and one sampling policy for the whole mesh: a trace's spans
    # come from every service it passes through.
    if len(set(tracing.values())) > 1:
        found.append(
            "the services receive different tracing settings ("
            + "; ".join(f"{w}: {dict(zip(TRACING_SETTINGS, v, strict=True))}" for w, v in sorted(tracing.items()))
            + "): give them all the one infermesh-tracing ConfigMap"
        )

    # Every workload: requests, limits, probes, a restricted security context.
    for workload in workloads:
        found += workload_problems(workload)

    # Memory: each pod's limit covers its service's byte budget and baseline.
    for workload in workloads:
        for container in workload.containers:
            module = workload.service_module(container)
            if module in SERVICES:
                found += [f"Deployment/{workload.name}: {p}" for p in memory_problems(module, container)]

    # Who calls whom: a host:port in a container's environment (its ConfigMaps'
    # too) is a call that the callee's AuthorizationPolicy must allow from the
    # caller's service account.
    policies = by_kind.get("AuthorizationPolicy", [])
    for workload in workloads:
        for container in workload.containers:
            for variable, value in environment(container, config_maps)[0].items():
                for address, port in re.findall(r"(?:[a-z]+://)?([a-z0-9.-]+):(\d+)", value or ""):
                    host = _short_host(address, namespace)
                    callee = services.get(host)
                    if callee is None:
                        continue
                    target_port = next(
                        (p.get("targetPort", p["port"]) for p in callee["spec"]["ports"] if p["port"] == int(port)),
                        None,
                    )
                    if target_port is None:
                        found.append(
                            f"Deployment/{workload.name}: {variable} names port {port} that "
                            f"Service/{host} does not expose"
                        )
                        continue
                    for pod in backing(callee):
                        container_port = pod.port_names().get(target_port, target_port)
                        if not _allowed(policies, pod, workload.service_account, namespace, container_port):
                            found.append(
                                f"Deployment/{workload.name} calls Service/{host} ({variable}), but no "
                                f"AuthorizationPolicy allows service account {workload.service_account!r} "
                                f"to reach Deployment/{pod.name} on port {container_port}"
                            )
    for policy in policies:
        selector = policy["spec"].get("selector", {}).get("matchLabels", {})
        if selector and not any(w.selected_by(selector) for w in workloads):
            found.append(f"{name_of(policy)}: its selector {selector} matches no Deployment")
        for rule in policy["spec"].get("rules", []):
            for source in (s.get("source", {}) for s in rule.get("from", [])):
                for principal in source.get("principals", []):
                    parts = principal.split("/")
                    if len(parts) == 5 and (parts[2] != namespace or parts[4] not in accounts):
                        found.append(
                            f"{name_of(policy)}: principal {principal!r} is no service account of "
                            f"namespace {namespace!r}"
                        )

    # Identity the mesh writes: a header a RequestAuthentication fills from verified
    # JWTs is one the workload trusts, so a copy that arrives without a JWT is refused.
    for authentication in by_kind.get("RequestAuthentication", []):
        selector = authentication["spec"].get("selector", {}).get("matchLabels", {})
        selected = [w for w in workloads if w.selected_by(selector)] if selector else workloads
        if selector and not selected:
            found.append(f"{name_of(authentication)}: its selector {selector} matches no Deployment")
        for rule in authentication["spec"].get("jwtRules", []):
            for output in rule.get("outputClaimToHeaders", []):
                header = output.get("header", "").lower()
                for workload in selected:
                    if not _refuses_unverified(policies, workload, header):
                        found.append(
                            f"{name_of(authentication)} writes {header} for Deployment/{workload.name} from "
                            "verified JWTs, but no DENY AuthorizationPolicy refuses a request that carries "
                            'it without one (notRequestPrincipals ["*"], when request.headers['
                            f"{header}] present)"
                        )

        for workload in selected:
            # It judges callers by identity, so x-forwarded-client-cert must be its
            # sidecar's alone: Istio's default (APPEND_FORWARD) keeps a caller's copy.
            proxy = workload.doc["spec"]["template"]["metadata"].get("annotations", {}).get("proxy.istio.io/config")
            try:
                forwarded = ((json.loads(proxy) if proxy else {}).get("proxyHeaders") or {}).get("forwardedClientCert")
            except json.JSONDecodeError:
                found.append(f"Deployment/{workload.name}: proxy.istio.io/config is not JSON")
                continue
            if forwarded not in ("SANITIZE_SET", "SANITIZE"):
                found.append(
                    f"Deployment/{workload.name} authenticates callers ({name_of(authentication)}) but its "
                    f"sidecar forwards x-forwarded-client-cert as {forwarded or 'APPEND_FORWARD'}, keeping "
                    "a copy the caller sent: set proxyHeaders.forwardedClientCert SANITIZE_SET in "
                    "proxy.istio.io/config"
                )

    # Routes: hosts, subsets, timeouts on streams; outlier detection that can act.
    for service in by_kind.get("VirtualService", []):
        for host in service["spec"].get("hosts", []):
            if _short_host(host, namespace) not in services:
                found.append(f"{name_of(service)}: host {host!r} is no Service of the namespace")
        for i, http in enumerate(service["spec"].get("http", [])):
            route_name = http.get("name", i)
            for item in http.get("route", []):
                host = _short_host(item["destination"]["host"], namespace)
                subset = item["destination"].get("subset")
                if host not in services:
                    found.append(f"{name_of(service)} route {route_name}: destination {host!r} is no Service")
                    continue
                behind = backing(services[host])
                streaming = any(
                    streams_bidirectionally(m)
                    for w in behind
                    for c in w.containers
                    if (m := w.service_module(c)) in SERVICES
                )
                if streaming and "timeout" in http:
                    found.append(
                        f"{name_of(service)} route {route_name}: {host} carries bidirectional streams; "
                        f"a route timeout ({http['timeout']}) would cut every stream at that age"
                    )
                if subset is None:
                    continue
                rule = rules.get(host)
                labels = next(
                    (
                        s.get("labels", {})
                        for s in (rule or {}).get("spec", {}).get("subsets", [])
                        if s["name"] == subset
                    ),
                    None,
                )
                if labels is None:
                    found.append(
                        f"{name_of(service)} route {route_name}: subset {subset!r} of {host} is defined by "
                        "no DestinationRule"
                    )
                elif not any(w.selected_by(labels) for w in behind):
                    found.append(
                        f"{name_of(service)} route {route_name}: subset {subset!r} ({labels}) selects no "
                        f"pod behind Service/{host}"
                    )
    for host, rule in rules.items():
        if host not in services:
            found.append(f"{name_of(rule)}: host {host!r} is no Service of the namespace")
            continue
        outlier = (rule["spec"].get("trafficPolicy") or {}).get("outlierDetection")
        if not outlier:
            continue
        percent = outlier.get("maxEjectionPercent", 10)  # Istio's default
        pools = [("every replica", backing(services[host]))] + [
            (f"subset {s['name']}", [w for w in backing(services[host]) if w.selected_by(s.get("labels", {}))])
            for s in rule["spec"].get("subsets", [])
        ]
        for label, pool in pools:
            count = sum(replicas(w) for w in pool)
            # Envoy ejects a host only while (ejected + 1) / hosts <= maxEjectionPercent.
            # (A pool of one has nowhere else to send its traffic: nothing to check.)
            if count >= 2 and 100.0 / count > percent:
                found.append(
                    f"{name_of(rule)}: with {count} replica(s) in {label}, maxEjectionPercent {percent} "
                    f"ejects nothing (Envoy needs (ejected + 1) / hosts <= {percent}%)"
                )

    # Scaling and disruption.
    served = _adapter_metrics(adapter_values)
    for hpa in by_kind.get("HorizontalPodAutoscaler", []):
        target = hpa["spec"]["scaleTargetRef"]
        scaled = next((w for w in workloads if target["kind"] == "Deployment" and w.name == target["name"]), None)
        if scaled is None:
            found.append(f"{name_of(hpa)}: scales {target['kind']}/{target['name']}, which does not exist")
        elif "replicas" in scaled.doc["spec"]:
            found.append(
                f"{name_of(scaled.doc)}: sets spec.replicas though {name_of(hpa)} scales it "
                "(every apply would reset the autoscaler's count)"
            )
        for metric in hpa["spec"].get("metrics", []):
            if metric["type"] == "Pods":
                wanted = metric["pods"]["metric"]["name"]
                if wanted not in served:
                    found.append(
                        f"{name_of(hpa)}: Pods metric {wanted!r} is not served by prometheus-adapter "
                        f"({adapter_values.name} serves {sorted(served)})"
                    )
                elif served[wanted] not in monitoring.exported():
                    found.append(
                        f"{name_of(hpa)}: prometheus-adapter builds {wanted!r} from {served[wanted]!r}, "
                        "which no service of ours exports"
                    )
        if hpa["spec"].get("minReplicas", 1) > hpa["spec"]["maxReplicas"]:
            found.append(f"{name_of(hpa)}: minReplicas is above maxReplicas")
        down = (hpa["spec"].get("behavior") or {}).get("scaleDown") or {}
        if down.get("stabilizationWindowSeconds", 300) < 60:
            found.append(f"{name_of(hpa)}: a scale-down window under 60 s lets the replica count flap")
    for pdb in by_kind.get("PodDisruptionBudget", []):
        selector = pdb["spec"].get("selector", {}).get("matchLabels", {})
        if not any(w.selected_by(selector) for w in workloads):
            found.append(f"{name_of(pdb)}: its selector {selector} matches no Deployment")
    # Stopping a pod: one budget per Deployment; out of its endpoints before it drains,
    # and neither it nor its sidecar killed while draining.
    found += stopping_problems(docs)

    # The dashboard and the alerts ask for series, labels and label values that exist.
    for config_map in by_kind.get("ConfigMap", []):
        if config_map["metadata"].get("labels", {}).get("grafana_dashboard"):
            for key, text in config_map.get("data", {}).items():
                found += [f"{name_of(config_map)} {key}: {p}" for p in monitoring.dashboard_problems(json.loads(text))]
    provisioning = [
        (config_map, key, yaml.safe_load(text))
        for config_map in by_kind.get("ConfigMap", [])
        if config_map["metadata"].get("labels", {}).get("grafana_datasource")
        for key, text in config_map.get("data", {}).items()
    ]
    if provisioning:
        where = ", ".join(sorted({f"{name_of(c)} {k}" for c, k, _ in provisioning}))
        found += [f"{where}: {p}" for p in monitoring.datasource_problems([doc for _, _, doc in provisioning])]
    for rule in by_kind.get("PrometheusRule", []):
        found += [f"{name_of(rule)}: {p}" for p in monitoring.rule_problems(rule)]
    return found


def _allowed(policies: list[dict], pod: Workload, account: str, namespace: str, port: int) -> bool:
    """Whether Istio's ALLOW policies let `account` reach `pod` on `port` (no
    ALLOW policy selecting the pod means everything is allowed)."""
    applicable = [
        p
        for p in policies
        if p["spec"].get("action", "ALLOW") == "ALLOW"
        and pod.selected_by(p["spec"].get("selector", {}).get("matchLabels", {}))
    ]
    if not applicable:
        return True
    for policy in applicable:
        for rule in policy["spec"].get("rules", []):
            sources = [s.get("source", {}) for s in rule.get("from", [])]
            operations = [t.get("operation", {}) for t in rule.get("to", [])]
            source_ok = not sources or any(
                any(p in ("*", f"cluster.local/ns/{namespace}/sa/{account}") for p in s.get("principals", ["*"]))
                for s in sources
            )
            port_ok = not operations or any(str(port) in map(str, o.get("ports", [port])) for o in operations)
            if source_ok and port_ok:
                return True
    return False


def _refuses_unverified(policies: list[dict], pod: Workload, header: str) -> bool:
    """Whether a DENY policy selecting `pod` refuses every request that carries
    `header` (any value) without a verified JWT, on whatever port."""
    for policy in policies:
        if policy["spec"].get("action") != "DENY":
            continue
        selector = policy["spec"].get("selector", {}).get("matchLabels", {})
        if selector and not pod.selected_by(selector):
            continue
        for rule in policy["spec"].get("rules") or []:
            sources = [s.get("source", {}) for s in rule.get("from") or []]
            unverified = bool(sources) and all(
                s.keys() == {"notRequestPrincipals"} and "*" in s["notRequestPrincipals"] for s in sources
            )
            ports = {str(p) for t in rule.get("to") or [] for p in (t.get("operation") or {}).get("ports", [])}
            carried = [
                c
                for c in rule.get("when") or []
                if c.get("key", "").lower() == f"request.headers[{header}]" and "*" in (c.get("values") or [])
            ]
            others = [c for c in rule.get("when") or [] if c not in carried]
            if unverified and carried and not others and _serves_only(pod, ports):
                return True
    return False


def _serves_only(pod: Workload, ports: set[str]) -> bool:
    """Whether `ports` (none: every port) covers each gRPC port of the pod's services."""
    if not ports:
        return True
    grpc_ports = {
        str(p["containerPort"])
        for c in pod.containers
        for p in c.get("ports", [])
        if p.get("name", "").startswith("grpc")
    }
    return grpc_ports <= ports


def _adapter_metrics(values: pathlib.Path) -> dict[str, str]:
    """prometheus-adapter's custom metrics: the name it serves -> the series it reads."""
    doc = yaml.safe_load(values.read_text()) or {}
    served = {}
    for rule in (doc.get("rules") or {}).get("custom", []):
        series = re.match(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"]).group(1)
        served[(rule.get("name") or {}).get("as", series)] = series
    return served


# ---------------------------------------------------------------- all together


def problems(docs: list[dict], crds: CrdSchemas) -> list[str]:
    found = []
    for doc in docs:
        if crds.knows(doc):
            found += crds.problems(doc)
            found += istio_code_problems(doc)
        elif is_kubernetes_kind(doc):
            found += kubernetes_problems(doc)
        else:
            found.append(f"{name_of(doc)}: no schema to check {doc.get('apiVersion')} against")
    return found + cross_problems(docs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "kustomizations", nargs="*", type=pathlib.Path, default=sorted(p for p in OVERLAYS.iterdir() if p.is_dir())
    )
    args = parser.parse_args(argv)
    try:
        crds = CrdSchemas()
        failed = 0
        for path in args.kustomizations:
            docs = render(path)
            found = problems(docs, crds)
            failed += bool(found)
            print(f"{path}: {len(docs)} resources, " + (f"{len(found)} problem(s)" if found else "all valid"))
            for problem in found:
                print(f"  - {problem}")
    except ManifestError as exc:
        print(f"manifests: {exc}", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
