"""The Kubernetes and Istio manifests, rendered by the real kustomize and
checked against the Kubernetes schemas, Istio's and the PrometheusRule's CRD schemas and CEL rules,
Istio's rules in code and our cross-resource rules (tools/manifests.py).
Each check is also shown to catch the mistake it exists for."""

import copy
import json
import os
import shutil
import subprocess

import pytest
import yaml

from services.common import traffic
from tools import manifests

OVERLAYS = sorted(p for p in manifests.OVERLAYS.iterdir() if p.is_dir())
POLICY = manifests.ROOT / "mesh" / "istio" / "model-server-traffic.yaml"


@pytest.fixture(scope="module")
def istio():
    return manifests.CrdSchemas()


@pytest.fixture(scope="module")
def production():
    """The overlay with the most replicas: a rule about pool sizes must bite there too."""
    return manifests.render(manifests.OVERLAYS / "production")


@pytest.mark.service
@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_every_overlay_passes_every_check(overlay, istio):
    docs = manifests.render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {
        "Deployment",
        "Service",
        "VirtualService",
        "DestinationRule",
        "PeerAuthentication",
        "RequestAuthentication",
        "AuthorizationPolicy",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "ConfigMap",
        "PrometheusRule",
    } <= kinds
    assert manifests.problems(docs, istio) == []


@pytest.mark.service
def test_the_base_and_the_istio_folder_render_on_their_own(istio):
    for path in (manifests.ROOT / "mesh" / "kubernetes" / "base", manifests.ROOT / "mesh" / "istio"):
        docs = manifests.render(path)
        assert docs and all(not istio.knows(d) or istio.problems(d) == [] for d in docs)


@pytest.mark.unit
def test_the_batcher_applies_the_same_model_server_policy_outside_kubernetes():
    services, rules = traffic.load_policy_files(POLICY)
    (service,), (rule,) = services, rules
    assert service.route({"x-user-tier": "vip"}).destinations[0].subset == "vip"
    assert {d.subset for d in service.route({"x-user-tier": "standard"}).destinations} == {"blue", "green"}
    # One local model server labelled for both pools serves VIP and standard traffic.
    assert set(rule.subset_of({"version": "blue", "pool": "vip"})) == {"blue", "vip"}
    assert rule.outlier.max_ejection_percent == 50  # one of a subset of two


def _find(docs, kind, name):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _container(docs, deployment):
    return _find(docs, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]


def _env(docs, deployment, name):
    return next(e for e in _container(docs, deployment)["env"] if e["name"] == name)


def _route(docs, host, name):
    return next(r for r in _find(docs, "VirtualService", host)["spec"]["http"] if r.get("name") == name)


def _dashboard(docs):
    config_map = _find(docs, "ConfigMap", "infermesh-grafana-dashboard")
    return config_map, json.loads(config_map["data"]["infermesh.json"])


def _tracing(docs):
    """The tracing settings' ConfigMap (its name carries kustomize's hash of the content)."""
    return next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("infermesh-tracing"))


def _break_dashboard(docs):
    config_map, dashboard = _dashboard(docs)
    dashboard["panels"][1]["targets"][0]["expr"] = "sum(rate(infermesh_router_answers_total[1m]))"
    config_map["data"]["infermesh.json"] = json.dumps(dashboard)


MISTAKES = {
    "unknown Kubernetes field": (
        lambda d: _container(d, "router")["readinessProbe"].update(grpcService="x"),
        "Additional properties are not allowed ('grpcService'",
    ),
    "wrong Kubernetes type": (
        lambda d: _find(d, "Deployment", "batcher")["spec"].update(replicas="two"),
        "Deployment/batcher: spec.replicas: 'two' is not of type 'integer'",
    ),
    "unknown Istio field": (
        lambda d: _route(d, "model-server", "blue-green").update(retry={"attempts": 1}),
        "VirtualService/model-server: spec.http.1: Additional properties are not allowed ('retry'",
    ),
    "duration under 1ms (Istio's CEL rule and code)": (
        lambda d: _find(d, "DestinationRule", "model-server")["spec"]["trafficPolicy"]["outlierDetection"].update(
            interval="0s"
        ),
        "outlierDetection.interval: '0s' is shorter than 1ms",
    ),
    "retryOn token Envoy does not know": (
        lambda d: _route(d, "model-server", "blue-green")["retries"].update(retryOn="unavailable,timeout"),
        "'timeout' is not a valid retryOn policy",
    ),
    "retry policy with retries off": (
        lambda d: _route(d, "cache", "lookups")["retries"].update(retryOn="connect-failure"),
        "a retry policy with attempts 0 (retries off) must say nothing else",
    ),
    "route to an undefined subset": (
        lambda d: _route(d, "model-server", "vip")["route"][0]["destination"].update(subset="gold"),
        "subset 'gold' of model-server is defined by no DestinationRule",
    ),
    "route unreachable after a catch-all": (
        lambda d: _find(d, "VirtualService", "model-server")["spec"]["http"].reverse(),
        "unreachable, route blue-green before it has no match",
    ),
    "timeout on a route of bidirectional streams": (
        lambda d: _route(d, "batcher", "request-streams").update(timeout="30s"),
        "batcher carries bidirectional streams; a route timeout (30s) would cut every stream",
    ),
    "Istio's default maxEjectionPercent with two replicas a subset": (
        lambda d: _find(d, "DestinationRule", "model-server")["spec"]["trafficPolicy"]["outlierDetection"].pop(
            "maxEjectionPercent"
        ),
        "maxEjectionPercent 10 ejects nothing",
    ),
    "caller the AuthorizationPolicy does not allow": (
        lambda d: _find(d, "AuthorizationPolicy", "model-server")["spec"]["rules"][0]["from"][0]["source"].update(
            principals=["cluster.local/ns/infermesh/sa/infermesh-router"]
        ),
        "no AuthorizationPolicy allows service account 'infermesh-batcher' to reach Deployment/model-server-blue",
    ),
    "principal of another namespace": (
        lambda d: _find(d, "AuthorizationPolicy", "cache")["spec"]["rules"][0]["from"][0]["source"].update(
            principals=["cluster.local/ns/default/sa/infermesh-router"]
        ),
        "principal 'cluster.local/ns/default/sa/infermesh-router' is no service account of namespace 'infermesh'",
    ),
    "environment variable that sets nothing": (
        lambda d: _env(d, "batcher", "INFERMESH_BATCHER_MAX_INFLIGHT_BATCHES_PER_REPLICA").update(
            name="INFERMESH_BATCHER_MAX_INFLIGHT"
        ),
        "INFERMESH_BATCHER_MAX_INFLIGHT sets no field of services.batcher's config",
    ),
    "probe of a health service nobody registers": (
        lambda d: _container(d, "cache")["livenessProbe"]["grpc"].update(service="infermesh.cache.Cache"),
        "livenessProbe asks health of 'infermesh.cache.Cache'",
    ),
    "Service port with no protocol for Istio": (
        lambda d: _find(d, "Service", "batcher")["spec"]["ports"][0].update(name="batcher", appProtocol=None),
        "Service/batcher: port 'batcher' names no protocol",
    ),
    "Service port that reaches no container port": (
        lambda d: _find(d, "Service", "cache")["spec"]["ports"][0].update(targetPort="gprc"),
        "targetPort 'gprc' is no container port",
    ),
    "autoscaler metric prometheus-adapter does not serve": (
        lambda d: _find(d, "HorizontalPodAutoscaler", "model-server-blue")["spec"]["metrics"][0]["pods"][
            "metric"
        ].update(name="infermesh_queue_length"),
        "Pods metric 'infermesh_queue_length' is not served by prometheus-adapter",
    ),
    "replica count an autoscaler owns": (
        lambda d: _find(d, "Deployment", "router")["spec"].update(replicas=2),
        "Deployment/router: sets spec.replicas though HorizontalPodAutoscaler/router scales it",
    ),
    "scale-down window that flaps": (
        lambda d: _find(d, "HorizontalPodAutoscaler", "router")["spec"]["behavior"]["scaleDown"].update(
            stabilizationWindowSeconds=0
        ),
        "a scale-down window under 60 s lets the replica count flap",
    ),
    "a tenant header a caller can send without a JWT": (
        lambda d: d.remove(_find(d, "AuthorizationPolicy", "router-identity-headers")),
        "RequestAuthentication/router writes x-infermesh-jwt-tenant for Deployment/router from verified JWTs, but "
        "no DENY AuthorizationPolicy refuses a request that carries it without one",
    ),
    "a DENY rule that refuses only callers with a JWT": (
        lambda d: _find(d, "AuthorizationPolicy", "router-identity-headers")["spec"]["rules"][0]["from"][0].update(
            source={"requestPrincipals": ["*"]}
        ),
        "no DENY AuthorizationPolicy refuses a request that carries it without one",
    ),
    "a DENY rule on another port than the router's": (
        lambda d: _find(d, "AuthorizationPolicy", "router-identity-headers")["spec"]["rules"][0]["to"][0].update(
            operation={"ports": ["8002"]}
        ),
        "no DENY AuthorizationPolicy refuses a request that carries it without one",
    ),
    "a DENY rule of HTTP attributes without ports": (
        lambda d: _find(d, "AuthorizationPolicy", "router-identity-headers")["spec"]["rules"][0].pop("to"),
        "a DENY rule of HTTP attributes without ports denies all TCP traffic",
    ),
    "a condition on an attribute Istio does not know": (
        lambda d: _find(d, "AuthorizationPolicy", "router-identity-headers")["spec"]["rules"][0]["when"][0].update(
            key="request.header[x-infermesh-jwt-tenant]"
        ),
        "unknown attribute: request.header[x-infermesh-jwt-tenant]",
    ),
    "a client-sent x-forwarded-client-cert kept by the router's sidecar": (
        lambda d: _find(d, "Deployment", "router")["spec"]["template"]["metadata"]["annotations"].update(
            {"proxy.istio.io/config": '{"holdApplicationUntilProxyStarts": true, "terminationDrainDuration": "15s"}'}
        ),
        "Deployment/router authenticates callers (RequestAuthentication/router) but its sidecar forwards "
        "x-forwarded-client-cert as APPEND_FORWARD",
    ),
    "a JWKS URI of a scheme Istio cannot fetch": (
        lambda d: _find(d, "RequestAuthentication", "router")["spec"]["jwtRules"][0].update(
            jwksUri="ftp://issuer.example/keys"
        ),
        "URI scheme of 'ftp://issuer.example/keys' is not supported",
    ),
    "a claim copied to a header Istio refuses to write": (
        lambda d: _find(d, "RequestAuthentication", "router")["spec"]["jwtRules"][0]["outputClaimToHeaders"][0].update(
            header="x-infermesh:tenant"
        ),
        "header name x-infermesh:tenant is not a valid header name",
    ),
    "pod memory limit below its service's budget and baseline": (
        lambda d: (
            _container(d, "batcher")["resources"]["limits"].update(memory="512Mi"),
            _container(d, "batcher")["env"].append(
                {"name": "INFERMESH_BATCHER_REQUEST_BUDGET_BYTES", "value": str(192 << 20)}
            ),
        ),
        "Deployment/batcher: services.batcher's config from container batcher's environment is refused",
    ),
    "explicit byte budget the pod's limit does not cover": (
        lambda d: _container(d, "router")["env"].extend(
            [
                {"name": "INFERMESH_ROUTER_MEMORY_LIMIT_BYTES", "value": str(4 << 30)},
                {"name": "INFERMESH_ROUTER_REQUEST_BUDGET_BYTES", "value": str(512 << 20)},
            ]
        ),
        "Deployment/router: container router's memory limit 1073741824 bytes is below what services.router may take",
    ),
    "pod with no memory limit": (
        lambda d: _container(d, "cache")["resources"].pop("limits"),
        "Deployment/cache: container cache has no memory limit",
    ),
    "a container with no CPU request": (
        lambda d: _container(d, "batcher")["resources"]["requests"].pop("cpu"),
        "Deployment/batcher: container batcher sets no requests.cpu",
    ),
    "a container without a liveness probe": (
        lambda d: _container(d, "cache").pop("livenessProbe"),
        "Deployment/cache: container cache has no livenessProbe",
    ),
    "a pod that may run as root": (
        lambda d: _find(d, "Deployment", "router")["spec"]["template"]["spec"]["securityContext"].pop("runAsNonRoot"),
        "Deployment/router: container router may run as root",
    ),
    "a container that overrides the pod's runAsNonRoot": (
        lambda d: _container(d, "batcher")["securityContext"].update(runAsNonRoot=False),
        "Deployment/batcher: container batcher may run as root",
    ),
    "a pod without a seccomp profile": (
        lambda d: _find(d, "Deployment", "cache")["spec"]["template"]["spec"]["securityContext"].pop("seccompProfile"),
        "Deployment/cache: container cache runs without a seccomp profile",
    ),
    "a container that may gain privileges": (
        lambda d: _container(d, "model-server-vip")["securityContext"].pop("allowPrivilegeEscalation"),
        "Deployment/model-server-vip: container model-server may gain privileges",
    ),
    "a writable root filesystem": (
        lambda d: _container(d, "router")["securityContext"].update(readOnlyRootFilesystem=False),
        "Deployment/router: container router may write its root filesystem",
    ),
    "capabilities kept": (
        lambda d: _container(d, "cache")["securityContext"]["capabilities"].update(drop=["NET_RAW"]),
        "Deployment/cache: container cache keeps Linux capabilities",
    ),
    "a privileged container": (
        lambda d: _container(d, "batcher")["securityContext"].update(privileged=True),
        "Deployment/batcher: container batcher is privileged",
    ),
    "a model-server pool without a disruption budget": (
        lambda d: d.remove(_find(d, "PodDisruptionBudget", "model-server-green")),
        "Deployment/model-server-green: no PodDisruptionBudget selects its pods",
    ),
    "a budget that, at production's three routers, lets none go": (
        lambda d: _find(d, "PodDisruptionBudget", "router")["spec"].update(maxUnavailable=None, minAvailable=3),
        "PodDisruptionBudget/router: minAvailable 3 with Deployment/router's 3 replica(s) allows no eviction",
    ),
    "a service Deployment without the tracing settings": (
        lambda d: _container(d, "batcher").pop("envFrom"),
        "Deployment/batcher: container batcher receives no INFERMESH_OTLP_ENDPOINT",
    ),
    "tracing settings from a ConfigMap that does not exist": (
        lambda d: _container(d, "router")["envFrom"][0]["configMapRef"].update(name="infermesh-tracin"),
        "Deployment/router: container router: envFrom names ConfigMap 'infermesh-tracin', which does not exist",
    ),
    "a trace ratio outside 0..1": (
        lambda d: _tracing(d)["data"].update(INFERMESH_TRACE_RATIO="1.5"),
        "container router: INFERMESH_TRACE_RATIO '1.5' is not a number within 0..1",
    ),
    "an OTLP endpoint that is no host:port": (
        lambda d: _tracing(d)["data"].update(INFERMESH_OTLP_ENDPOINT="otel-collector.observability"),
        "INFERMESH_OTLP_ENDPOINT 'otel-collector.observability' is not host:port",
    ),
    "one service tracing to a collector of its own": (
        lambda d: _container(d, "cache")["env"].append(
            {"name": "INFERMESH_OTLP_ENDPOINT", "value": "collector.example:4317"}
        ),
        "the services receive different tracing settings",
    ),
    "a misspelt shared setting": (
        lambda d: _container(d, "cache")["env"].append({"name": "INFERMESH_OTLP_ENDPIONT", "value": "x:4317"}),
        "Deployment/cache: INFERMESH_OTLP_ENDPIONT is read by no service",
    ),
    "an exemplar link by another label than the router's": (
        lambda d: _find(d, "ConfigMap", "infermesh-grafana-datasources")["data"].update(
            {
                "infermesh-prometheus.yaml": _find(d, "ConfigMap", "infermesh-grafana-datasources")["data"][
                    "infermesh-prometheus.yaml"
                ].replace("- name: trace_id", "- name: traceID")
            }
        ),
        "ConfigMap/infermesh-grafana-datasources infermesh-jaeger.yaml, ConfigMap/infermesh-grafana-datasources "
        "infermesh-prometheus.yaml: data source 'infermesh Prometheus': no exemplarTraceIdDestinations entry for "
        "the label 'trace_id'",
    ),
    "dashboard query of a metric we do not export": (
        _break_dashboard,
        "infermesh_router_answers_total is not a series our services export",
    ),
    "alert on a label value no service emits": (
        lambda d: _find(d, "PrometheusRule", "infermesh")["spec"]["groups"][0]["rules"][0].update(
            expr='sum(rate(infermesh_router_requests_total{code="UNKNOWN"}[5m])) > 0'
        ),
        "PrometheusRule/infermesh: infermesh-router/InfermeshErrorRatioHigh: infermesh_router_requests_total"
        "{code=\"UNKNOWN\"}: code is never 'UNKNOWN'",
    ),
}


@pytest.mark.service
@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_check_catches_its_mistake(mistake, production, istio):
    _assert_caught(production, *MISTAKES[mistake], istio)


def _assert_caught(rendered, break_it, expected, istio):
    docs = copy.deepcopy(rendered)
    break_it(docs)
    for doc in docs:  # appProtocol=None above means "without one"
        if doc["kind"] == "Service":
            for port in doc["spec"]["ports"]:
                if port.get("appProtocol", "") is None:
                    del port["appProtocol"]
        if doc["kind"] == "PodDisruptionBudget" and doc["spec"].get("maxUnavailable", "") is None:
            del doc["spec"]["maxUnavailable"]
    found = manifests.problems(docs, istio)
    assert any(expected in p for p in found), "\n".join(found)


@pytest.fixture(scope="module")
def dev():
    return manifests.render(manifests.OVERLAYS / "dev")


@pytest.mark.service
def test_the_dev_overlay_runs_a_jaeger_that_every_service_traces_to(dev):
    """Jaeger v2 at the release of the Go module v1.75.0, OTLP/gRPC in, traces in
    memory, the UI on 16686; it passes the rules every workload does (the overlay's
    own check above), its Service names each port's protocol."""
    deployment = _find(dev, "Deployment", "jaeger")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "jaegertracing/jaeger:2.12.0"
    assert manifests.workload_problems(manifests.Workload(deployment)) == []
    assert {(p["name"], p["port"], p.get("appProtocol")) for p in _find(dev, "Service", "jaeger")["spec"]["ports"]} == {
        ("grpc-otlp", 4317, "grpc"),
        ("http-query", 16686, "http"),
    }
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    config_map = _find(dev, "ConfigMap", volume["configMap"]["name"])
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert container["args"] == ["--config=/etc/jaeger/config.yaml"]
    assert config["receivers"] == {"otlp": {"protocols": {"grpc": {"endpoint": "0.0.0.0:4317"}}}}
    assert config["extensions"]["jaeger_query"]["http"]["endpoint"] == "0.0.0.0:16686"
    assert config["extensions"]["jaeger_storage"]["backends"]["memory"]["memory"]["max_traces"] > 0
    health = config["extensions"]["healthcheckv2"]["http"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {
            "path": health["status"]["path"],
            "port": int(health["endpoint"].rpartition(":")[2]),
        }
    assert _env_of(dev, "router")["INFERMESH_OTLP_ENDPOINT"] == "jaeger:4317"


@pytest.mark.service
@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_grafana_loads_a_prometheus_whose_trace_id_exemplars_open_jaeger(overlay):
    """The data sources are a ConfigMap Grafana's datasource sidecar loads; the
    exemplar link names the router's label, trace_id; in the dev overlay the Jaeger
    data source is its Jaeger's query port, elsewhere the documented placeholder."""
    docs = manifests.render(overlay)
    config_map = _find(docs, "ConfigMap", "infermesh-grafana-datasources")
    assert config_map["metadata"]["labels"]["grafana_datasource"] == "1"
    by_uid = {d["uid"]: d for text in config_map["data"].values() for d in yaml.safe_load(text)["datasources"]}
    (link,) = by_uid["infermesh-prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert link == {"name": "trace_id", "datasourceUid": "infermesh-jaeger", "urlDisplayLabel": "Trace in Jaeger"}
    jaeger = by_uid["infermesh-jaeger"]
    assert jaeger["type"] == "jaeger"
    if overlay.name == "dev":
        host, _, port = jaeger["url"].removeprefix("http://").partition(":")
        assert host == "jaeger.infermesh.svc.cluster.local"
        assert int(port) in {p["port"] for p in _find(docs, "Service", "jaeger")["spec"]["ports"]}
    else:
        assert jaeger["url"] == "http://jaeger-query.observability.svc.cluster.local:16686"


def _env_of(docs, deployment):
    config_maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    return manifests.environment(_container(docs, deployment), config_maps)[0]


def _jaeger_policy_without(account):
    def change(docs):
        source = _find(docs, "AuthorizationPolicy", "jaeger")["spec"]["rules"][0]["from"][0]["source"]
        source["principals"].remove(f"cluster.local/ns/infermesh/sa/{account}")

    return change


JAEGER_MISTAKES = {
    "Jaeger without a memory limit": (
        lambda d: _container(d, "jaeger")["resources"].pop("limits"),
        "Deployment/jaeger: container jaeger sets no limits.memory",
    ),
    "Jaeger without a readiness probe": (
        lambda d: _container(d, "jaeger").pop("readinessProbe"),
        "Deployment/jaeger: container jaeger has no readinessProbe",
    ),
    "Jaeger as root": (
        lambda d: _find(d, "Deployment", "jaeger")["spec"]["template"]["spec"]["securityContext"].pop("runAsNonRoot"),
        "Deployment/jaeger: container jaeger may run as root",
    ),
    "Jaeger writing its root filesystem": (
        lambda d: _container(d, "jaeger")["securityContext"].pop("readOnlyRootFilesystem"),
        "Deployment/jaeger: container jaeger may write its root filesystem",
    ),
    "Jaeger without a disruption budget": (
        lambda d: d.remove(_find(d, "PodDisruptionBudget", "jaeger")),
        "Deployment/jaeger: no PodDisruptionBudget selects its pods",
    ),
    "Jaeger's Service port without a protocol": (
        lambda d: _find(d, "Service", "jaeger")["spec"]["ports"][0].update(name="otlp", appProtocol=None),
        "Service/jaeger: port 'otlp' names no protocol",
    ),
    "a service whose spans Jaeger's policy refuses": (
        _jaeger_policy_without("infermesh-model-server"),
        "Deployment/model-server-blue calls Service/jaeger (INFERMESH_OTLP_ENDPOINT), but no AuthorizationPolicy "
        "allows service account 'infermesh-model-server' to reach Deployment/jaeger on port 4317",
    ),
    "an endpoint on a port Jaeger's Service does not expose": (
        lambda d: _tracing(d)["data"].update(INFERMESH_OTLP_ENDPOINT="jaeger:4318"),
        "Deployment/router: INFERMESH_OTLP_ENDPOINT names port 4318 that Service/jaeger does not expose",
    ),
    "Jaeger in a namespace of its own": (
        lambda d: _find(d, "Deployment", "jaeger")["metadata"].update(namespace="observability"),
        "resources are spread over namespaces",
    ),
}


@pytest.mark.service
@pytest.mark.parametrize("mistake", JAEGER_MISTAKES)
def test_the_dev_overlays_jaeger_is_held_to_the_same_rules(mistake, dev, istio):
    _assert_caught(dev, *JAEGER_MISTAKES[mistake], istio)


@pytest.mark.service
def test_a_namespace_given_by_an_overlay_must_carry_its_principals_along(istio, tmp_path):
    overlay = tmp_path / "elsewhere"
    overlay.mkdir()
    base = os.path.relpath(manifests.OVERLAYS / "dev", overlay)  # kustomize takes relative paths only
    (overlay / "kustomization.yaml").write_text(f"resources:\n- {base}\nnamespace: serving\n")
    found = manifests.problems(manifests.render(overlay), istio)
    assert any(
        "principal 'cluster.local/ns/infermesh/sa/infermesh-batcher' is no service account of namespace 'serving'" in p
        for p in found
    ), found


@pytest.mark.service
def test_a_release_goes_to_green_alone_then_to_blue_and_the_vip_pool(tmp_path):
    """Each pool has an image name of its own, so the blue-green steps of
    docs/kubernetes.md move one pool at a time; the other services keep theirs."""
    shutil.copytree(manifests.ROOT / "mesh", tmp_path / "mesh")  # edited in place, as docs/kubernetes.md does
    overlay = tmp_path / "mesh" / "kubernetes" / "overlays" / "production"

    def images():
        docs = manifests.render(overlay)
        return {
            d["metadata"]["name"]: _container(docs, d["metadata"]["name"])["image"]
            for d in docs
            if d["kind"] == "Deployment" and d["metadata"]["name"] != "redis"
        }

    def set_image(*pairs):
        subprocess.run([str(manifests.KUSTOMIZE), "edit", "set", "image", *pairs], cwd=overlay, check=True)

    set_image(
        *(
            f"{name}=registry.example/infermesh:1.0"
            for name in (
                "infermesh",
                "infermesh-model-server-blue",
                "infermesh-model-server-green",
                "infermesh-model-server-vip",
            )
        )
    )
    assert set(images().values()) == {"registry.example/infermesh:1.0"}
    set_image("infermesh-model-server-green=registry.example/infermesh:1.1")  # the canary
    assert images() == {
        "router": "registry.example/infermesh:1.0",
        "batcher": "registry.example/infermesh:1.0",
        "cache": "registry.example/infermesh:1.0",
        "model-server-blue": "registry.example/infermesh:1.0",
        "model-server-green": "registry.example/infermesh:1.1",
        "model-server-vip": "registry.example/infermesh:1.0",
    }
    set_image(
        "infermesh-model-server-blue=registry.example/infermesh:1.1",
        "infermesh-model-server-vip=registry.example/infermesh:1.1",
    )  # promoted
    assert {name: image for name, image in images().items() if name.startswith("model-server")} == {
        f"model-server-{pool}": "registry.example/infermesh:1.1" for pool in ("blue", "green", "vip")
    }


@pytest.mark.service
@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_a_router_that_keeps_failure_samples_keeps_them_redacted(overlay):
    """Callers' texts stay out of a pod's disk: wherever a router is given a
    samples path, its content is set to redacted, not left to a default."""
    docs = manifests.render(overlay)
    routers = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].startswith("router")]
    assert routers
    for router in routers:
        for container in router["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            path = env.get("INFERMESH_ROUTER_FAILURE_SAMPLES_PATH")
            if not path:
                continue
            assert env.get("INFERMESH_ROUTER_FAILURE_SAMPLES_CONTENT") == "redacted", router["metadata"]["name"]
            # The file and its rotated copy fit the volume they are written to.
            mount = max(
                (m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")),
                key=lambda m: len(m["mountPath"]),
            )
            volume = next(v for v in router["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
            max_bytes = int(env["INFERMESH_ROUTER_FAILURE_SAMPLES_MAX_BYTES"])
            assert 2 * max_bytes <= _quantity_bytes(volume["emptyDir"]["sizeLimit"]), router["metadata"]["name"]


@pytest.mark.service
@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_every_service_deployment_receives_the_tracing_settings(overlay):
    """All four services read the one tracing ConfigMap: tracing off in the base,
    the overlay's collector, 1% of new traces, 100 caller-sampled traces a second."""
    docs = manifests.render(overlay)
    config_maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    expected = {
        "dev": "jaeger:4317",
        "production": "otel-collector.observability.svc.cluster.local:4317",
    }
    received = {}
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            if manifests.Workload(deployment).service_module(container) in manifests.SERVICES:
                values, unresolved = manifests.environment(container, config_maps)
                assert unresolved == []
                received[deployment["metadata"]["name"]] = {s: values.get(s) for s in manifests.TRACING_SETTINGS}
    assert set(received) == {
        "router",
        "batcher",
        "cache",
        "model-server-blue",
        "model-server-green",
        "model-server-vip",
    }
    for name, values in received.items():
        assert values == {
            "INFERMESH_OTLP_ENDPOINT": expected[overlay.name],
            "INFERMESH_TRACE_RATIO": "0.01",
            "INFERMESH_CALLER_TRACES_PER_S": "100",
        }, name


@pytest.mark.service
def test_tracing_is_off_in_the_base():
    docs = manifests.render(manifests.ROOT / "mesh" / "kubernetes" / "base")
    assert _tracing(docs)["data"] == {
        "INFERMESH_OTLP_ENDPOINT": "",
        "INFERMESH_TRACE_RATIO": "0.01",
        "INFERMESH_CALLER_TRACES_PER_S": "100",
    }


@pytest.mark.unit
def test_a_containers_environment_is_read_as_the_kubelet_sets_it():
    config_maps = {"settings": {"data": {"A": "1", "B": "2"}}}
    container = {
        "envFrom": [{"configMapRef": {"name": "settings"}}, {"configMapRef": {"name": "settings"}, "prefix": "X_"}],
        "env": [
            {"name": "B", "value": "3"},  # env wins over envFrom
            {"name": "C", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "A"}}},
            {"name": "D", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        ],
    }
    assert manifests.environment(container, config_maps) == (
        {"A": "1", "B": "3", "X_A": "1", "X_B": "2", "C": "1", "D": None},
        [],
    )
    missing = {
        "envFrom": [{"configMapRef": {"name": "gone"}}, {"configMapRef": {"name": "maybe", "optional": True}}],
        "env": [{"name": "E", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "Z"}}}],
    }
    assert manifests.environment(missing, config_maps)[1] == [
        "envFrom names ConfigMap 'gone', which does not exist",
        "E reads key 'Z' of ConfigMap 'settings', which does not exist",
    ]


def _quantity_bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}
    for unit, factor in units.items():
        if quantity.endswith(unit):
            return int(quantity[: -len(unit)]) * factor
    return int(quantity)


@pytest.mark.service
def test_the_namespace_is_strict_mutual_tls_and_the_router_verifies_jwts(production):
    """One PeerAuthentication for the whole namespace (no selector) in STRICT mode, the
    per-service ALLOW policies kept, and the router's sidecar checking end users' JWTs."""
    (peer,) = [d for d in production if d["kind"] == "PeerAuthentication"]
    assert peer["spec"] == {"mtls": {"mode": "STRICT"}} and peer["metadata"]["namespace"] == "infermesh"
    allowed = {
        d["metadata"]["name"]
        for d in production
        if d["kind"] == "AuthorizationPolicy" and d["spec"].get("action") == "ALLOW"
    }
    assert {"model-server", "batcher", "cache"} <= allowed
    (authentication,) = [d for d in production if d["kind"] == "RequestAuthentication"]
    assert authentication["spec"]["selector"] == {"matchLabels": {"app": "router"}}


# ---------------------------------------------------------------- stopping a pod (unit: no kustomize)

BASE = manifests.ROOT / "mesh" / "kubernetes" / "base"


def _base():
    """Every resource of the base as written: a unit test starts no kustomize, and
    the rules about stopping a pod read only what each Deployment's file says."""
    return [
        d for path in sorted(BASE.rglob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d and "kind" in d
    ]


def _proxy_config(docs, deployment, **changes):
    annotations = _find(docs, "Deployment", deployment)["spec"]["template"]["metadata"]["annotations"]
    config = {**json.loads(annotations["proxy.istio.io/config"]), **changes}
    annotations["proxy.istio.io/config"] = json.dumps({k: v for k, v in config.items() if v is not None})


def _set_env(docs, deployment, name, value):
    env = _container(docs, deployment)["env"]
    env[:] = [e for e in env if e["name"] != name] + ([{"name": name, "value": value}] if value is not None else [])


def _default_drain_grace_s(module):
    import dataclasses
    import importlib

    path, cls = manifests.SERVICES[module][0].split(":")
    return next(
        f.default for f in dataclasses.fields(getattr(importlib.import_module(path), cls)) if f.name == "drain_grace_s"
    )


@pytest.mark.unit
def test_every_shipped_deployment_has_a_budget_and_stops_in_order():
    docs = _base()
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert deployments == {"router", "batcher", "cache", "model-server", "redis"}
    assert manifests.stopping_problems(docs) == []
    for name in deployments - {"redis"}:  # each of our services: the hook withdraws, then waits
        assert manifests.pre_stop(_container(docs, name)) == (8.0, True), name


STOPPING_MISTAKES = {
    "a Deployment without a budget": (
        lambda d: d.remove(_find(d, "PodDisruptionBudget", "cache")),
        "Deployment/cache: no PodDisruptionBudget selects its pods",
    ),
    "a budget that selects other pods": (
        lambda d: _find(d, "PodDisruptionBudget", "router")["spec"]["selector"].update(matchLabels={"app": "routers"}),
        "Deployment/router: no PodDisruptionBudget selects its pods",
    ),
    "two budgets for one Deployment": (
        lambda d: d.append(
            {**copy.deepcopy(_find(d, "PodDisruptionBudget", "batcher")), "metadata": {"name": "batcher-again"}}
        ),
        "Deployment/batcher: 2 PodDisruptionBudgets select its pods",
    ),
    "a budget that lets no pod go": (
        lambda d: _find(d, "PodDisruptionBudget", "router")["spec"].update(maxUnavailable=0),
        "PodDisruptionBudget/router: maxUnavailable 0 with Deployment/router's 2 replica(s) allows no eviction",
    ),
    "a budget that keeps every replica of the autoscaler's fewest": (
        lambda d: (
            _find(d, "PodDisruptionBudget", "batcher")["spec"].pop("maxUnavailable"),
            _find(d, "PodDisruptionBudget", "batcher")["spec"].update(minAvailable="100%"),
        ),
        "PodDisruptionBudget/batcher: minAvailable 100% with Deployment/batcher's 2 replica(s) allows no eviction",
    ),
    "a budget that lets every pod go": (
        lambda d: _find(d, "PodDisruptionBudget", "model-server")["spec"].update(maxUnavailable="100%"),
        "PodDisruptionBudget/model-server: maxUnavailable 100% with Deployment/model-server's 2 replicas lets "
        "every one be evicted at once",
    ),
    "a grace period shorter than preStop + drain + margin": (
        lambda d: _find(d, "Deployment", "cache")["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=15),
        "Deployment/cache: terminationGracePeriodSeconds 15 is below container cache's preStop 8 s + drain grace 5 s "
        "(env INFERMESH_CACHE_DRAIN_GRACE_S) + margin 5 s = 18 s",
    ),
    "a longer drain grace in the environment the grace period does not follow": (
        lambda d: _set_env(d, "router", "INFERMESH_ROUTER_DRAIN_GRACE_S", "20"),
        "Deployment/router: terminationGracePeriodSeconds 30 is below container router's preStop 8 s + drain grace "
        "20 s (env INFERMESH_ROUTER_DRAIN_GRACE_S) + margin 5 s = 33 s",
    ),
    "a drain grace in the args, which win over the environment": (
        lambda d: _container(d, "batcher")["args"].extend(["--drain-grace-s", "25"]),
        "Deployment/batcher: terminationGracePeriodSeconds 30 is below container batcher's preStop 8 s + drain grace "
        "25 s (args --drain-grace-s) + margin 5 s = 38 s",
    ),
    "no drain grace given: the config's default counts": (
        lambda d: (
            _set_env(d, "model-server", "INFERMESH_MODEL_SERVER_DRAIN_GRACE_S", None),
            _find(d, "Deployment", "model-server")["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=20),
        ),
        f"Deployment/model-server: terminationGracePeriodSeconds 20 is below container model-server's preStop 8 s + "
        f"drain grace {_default_drain_grace_s('model_server'):g} s (services.model_server's default drain_grace_s)",
    ),
    "a drain grace that is no number": (
        lambda d: _set_env(d, "cache", "INFERMESH_CACHE_DRAIN_GRACE_S", "5s"),
        "Deployment/cache: container cache's drain grace (env INFERMESH_CACHE_DRAIN_GRACE_S) is not a number",
    ),
    "a preStop hook that only sleeps": (
        lambda d: _container(d, "router")["lifecycle"]["preStop"]["exec"].update(command=["sh", "-c", "sleep 8"]),
        "Deployment/router: container router's lifecycle.preStop does not withdraw services.router (kill -USR1 1)",
    ),
    "no preStop hook: readiness cannot fail before the drain": (
        lambda d: _container(d, "batcher").pop("lifecycle"),
        "Deployment/batcher: container batcher's readinessProbe periodSeconds 2 x failureThreshold 2 + 3 s for "
        "callers to learn it = 7 s is longer than lifecycle.preStop's delay 0 s",
    ),
    "a readiness probe too slow for the preStop delay": (
        lambda d: _container(d, "cache")["readinessProbe"].update(periodSeconds=5),
        "Deployment/cache: container cache's readinessProbe periodSeconds 5 x failureThreshold 2 + 3 s for callers to "
        "learn it = 13 s is longer than lifecycle.preStop's delay 8 s",
    ),
    "a readiness probe left to Kubernetes' defaults": (
        lambda d: [
            _container(d, "model-server")["readinessProbe"].pop(k) for k in ("periodSeconds", "failureThreshold")
        ],
        "Deployment/model-server: container model-server's readinessProbe periodSeconds 10 x failureThreshold 3",
    ),
    "a readiness probe that cannot see NOT_SERVING": (
        lambda d: _container(d, "router").update(readinessProbe={"tcpSocket": {"port": 8001}, "periodSeconds": 2}),
        "Deployment/router: container router's readinessProbe is no gRPC health probe",
    ),
    "a sidecar that stops carrying calls before preStop + drain are over": (
        lambda d: _proxy_config(d, "router", terminationDrainDuration="15s"),
        "Deployment/router: the sidecar's drain 15 s (proxy.istio.io/config terminationDrainDuration 15s) is shorter "
        "than container router's preStop 8 s + drain grace 10 s (env INFERMESH_ROUTER_DRAIN_GRACE_S) = 18 s",
    ),
    "a sidecar left to Istio's default drain": (
        lambda d: _proxy_config(d, "cache", terminationDrainDuration=None),
        "Deployment/cache: the sidecar's drain 5 s (Istio's default terminationDrainDuration) is shorter than "
        "container cache's preStop 8 s + drain grace 5 s",
    ),
    "a sidecar drain the grace period cuts short": (
        lambda d: _proxy_config(d, "model-server", terminationDrainDuration="60s"),
        "Deployment/model-server: the sidecar's drain 60 s (proxy.istio.io/config terminationDrainDuration 60s) is "
        "not within terminationGracePeriodSeconds 45",
    ),
}


@pytest.mark.unit
@pytest.mark.parametrize("mistake", STOPPING_MISTAKES)
def test_each_stopping_rule_catches_its_mistake(mistake):
    docs = _base()
    break_it, expected = STOPPING_MISTAKES[mistake]
    break_it(docs)
    found = manifests.stopping_problems(docs)
    assert any(expected in p for p in found), "\n".join(found)


@pytest.mark.unit
def test_a_pod_without_a_sidecar_or_one_that_waits_for_its_connections_has_no_drain_duration_to_check():
    docs = _base()
    _proxy_config(docs, "cache", terminationDrainDuration="1s")
    assert any("the sidecar's drain 1 s" in p for p in manifests.stopping_problems(docs))
    _proxy_config(docs, "cache", proxyMetadata={"EXIT_ON_ZERO_ACTIVE_CONNECTIONS": "true"})
    assert manifests.stopping_problems(docs) == []
    _proxy_config(docs, "cache", proxyMetadata=None)
    _find(docs, "Deployment", "cache")["spec"]["template"]["metadata"]["annotations"]["sidecar.istio.io/inject"] = (
        "false"
    )
    assert manifests.stopping_problems(docs) == []
