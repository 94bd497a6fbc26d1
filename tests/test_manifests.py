"""The Kubernetes and Istio manifests, rendered by the real kustomize and
checked against the Kubernetes schemas, Istio's CRD schemas and CEL rules,
Istio's rules in code and our cross-resource rules (tools/manifests.py).
Each check is also shown to catch the mistake it exists for."""

import copy
import json
import os
import shutil
import subprocess

import pytest

from services.common import traffic
from tools import manifests

OVERLAYS = sorted(p for p in manifests.OVERLAYS.iterdir() if p.is_dir())
POLICY = manifests.ROOT / "mesh" / "istio" / "model-server-traffic.yaml"


@pytest.fixture(scope="module")
def istio():
    return manifests.IstioSchemas()


@pytest.fixture(scope="module")
def production():
    """The overlay with the most replicas: a rule about pool sizes must bite there too."""
    return manifests.render(manifests.OVERLAYS / "production")


@pytest.mark.service
@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_every_overlay_passes_every_check(overlay, istio):
    docs = manifests.render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "VirtualService", "DestinationRule", "PeerAuthentication",
            "RequestAuthentication", "AuthorizationPolicy", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "ConfigMap"} <= kinds
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


def _break_dashboard(docs):
    config_map, dashboard = _dashboard(docs)
    dashboard["panels"][1]["targets"][0]["expr"] = "sum(rate(infermesh_router_answers_total[1m]))"
    config_map["data"]["infermesh.json"] = json.dumps(dashboard)


MISTAKES = {
    "unknown Kubernetes field": (
        lambda d: _container(d, "router")["readinessProbe"].update(grpcService="x"),
        "Additional properties are not allowed ('grpcService'"),
    "wrong Kubernetes type": (
        lambda d: _find(d, "Deployment", "batcher")["spec"].update(replicas="two"),
        "Deployment/batcher: spec.replicas: 'two' is not of type 'integer'"),
    "unknown Istio field": (
        lambda d: _route(d, "model-server", "blue-green").update(retry={"attempts": 1}),
        "VirtualService/model-server: spec.http.1: Additional properties are not allowed ('retry'"),
    "duration under 1ms (Istio's CEL rule and code)": (
        lambda d: _find(d, "DestinationRule", "model-server")["spec"]["trafficPolicy"]["outlierDetection"].update(
            interval="0s"),
        "outlierDetection.interval: '0s' is shorter than 1ms"),
    "retryOn token Envoy does not know": (
        lambda d: _route(d, "model-server", "blue-green")["retries"].update(retryOn="unavailable,timeout"),
        "'timeout' is not a valid retryOn policy"),
    "retry policy with retries off": (
        lambda d: _route(d, "cache", "lookups")["retries"].update(retryOn="connect-failure"),
        "a retry policy with attempts 0 (retries off) must say nothing else"),
    "route to an undefined subset": (
        lambda d: _route(d, "model-server", "vip")["route"][0]["destination"].update(subset="gold"),
        "subset 'gold' of model-server is defined by no DestinationRule"),
    "route unreachable after a catch-all": (
        lambda d: _find(d, "VirtualService", "model-server")["spec"]["http"].reverse(),
        "unreachable, route blue-green before it has no match"),
    "timeout on a route of bidirectional streams": (
        lambda d: _route(d, "batcher", "request-streams").update(timeout="30s"),
        "batcher carries bidirectional streams; a route timeout (30s) would cut every stream"),
    "Istio's default maxEjectionPercent with two replicas a subset": (
        lambda d: _find(d, "DestinationRule", "model-server")["spec"]["trafficPolicy"]["outlierDetection"].pop(
            "maxEjectionPercent"),
        "maxEjectionPercent 10 ejects nothing"),
    "caller the AuthorizationPolicy does not allow": (
        lambda d: _find(d, "AuthorizationPolicy", "model-server")["spec"]["rules"][0]["from"][0]["source"].update(
            principals=["cluster.local/ns/infermesh/sa/infermesh-router"]),
        "no AuthorizationPolicy allows service account 'infermesh-batcher' to reach Deployment/model-server-blue"),
    "principal of another namespace": (
        lambda d: _find(d, "AuthorizationPolicy", "cache")["spec"]["rules"][0]["from"][0]["source"].update(
            principals=["cluster.local/ns/default/sa/infermesh-router"]),
        "principal 'cluster.local/ns/default/sa/infermesh-router' is no service account of namespace 'infermesh'"),
    "environment variable that sets nothing": (
        lambda d: _env(d, "batcher", "INFERMESH_BATCHER_MAX_INFLIGHT_BATCHES_PER_REPLICA").update(
            name="INFERMESH_BATCHER_MAX_INFLIGHT"),
        "INFERMESH_BATCHER_MAX_INFLIGHT sets no field of services.batcher's config"),
    "probe of a health service nobody registers": (
        lambda d: _container(d, "cache")["livenessProbe"]["grpc"].update(service="infermesh.cache.Cache"),
        "livenessProbe asks health of 'infermesh.cache.Cache'"),
    "Service port with no protocol for Istio": (
        lambda d: _find(d, "Service", "batcher")["spec"]["ports"][0].update(name="batcher", appProtocol=None),
        "Service/batcher: port 'batcher' names no protocol"),
    "Service port that reaches no container port": (
        lambda d: _find(d, "Service", "cache")["spec"]["ports"][0].update(targetPort="gprc"),
        "targetPort 'gprc' is no container port"),
    "autoscaler metric prometheus-adapter does not serve": (
        lambda d: _find(d, "HorizontalPodAutoscaler", "model-server-blue")["spec"]["metrics"][0]["pods"]["metric"]
        .update(name="infermesh_queue_length"),
        "Pods metric 'infermesh_queue_length' is not served by prometheus-adapter"),
    "replica count an autoscaler owns": (
        lambda d: _find(d, "Deployment", "router")["spec"].update(replicas=2),
        "Deployment/router: sets spec.replicas though HorizontalPodAutoscaler/router scales it"),
    "scale-down window that flaps": (
        lambda d: _find(d, "HorizontalPodAutoscaler", "router")["spec"]["behavior"]["scaleDown"].update(
            stabilizationWindowSeconds=0),
        "a scale-down window under 60 s lets the replica count flap"),
    "a tenant header a caller can send without a JWT": (
        lambda d: d.remove(_find(d, "AuthorizationPolicy", "router-identity-headers")),
        "RequestAuthentication/router writes x-infermesh-jwt-tenant for Deployment/router from verified JWTs, but "
        "no DENY AuthorizationPolicy refuses a request that carries it without one"),
    "a DENY rule that refuses only callers with a JWT": (
        lambda d: _find(d, "AuthorizationPolicy", "router-identity-headers")["spec"]["rules"][0]["from"][0].update(
            source={"requestPrincipals": ["*"]}),
        "no DENY AuthorizationPolicy refuses a request that carries it without one"),
    "a DENY rule on another port than the router's": (
        lambda d: _find(d, "AuthorizationPolicy", "router-identity-headers")["spec"]["rules"][0]["to"][0].update(
            operation={"ports": ["8002"]}),
        "no DENY AuthorizationPolicy refuses a request that carries it without one"),
    "a DENY rule of HTTP attributes without ports": (
        lambda d: _find(d, "AuthorizationPolicy", "router-identity-headers")["spec"]["rules"][0].pop("to"),
        "a DENY rule of HTTP attributes without ports denies all TCP traffic"),
    "a condition on an attribute Istio does not know": (
        lambda d: _find(d, "AuthorizationPolicy", "router-identity-headers")["spec"]["rules"][0]["when"][0].update(
            key="request.header[x-infermesh-jwt-tenant]"),
        "unknown attribute: request.header[x-infermesh-jwt-tenant]"),
    "a client-sent x-forwarded-client-cert kept by the router's sidecar": (
        lambda d: _find(d, "Deployment", "router")["spec"]["template"]["metadata"]["annotations"].update({
            "proxy.istio.io/config": '{"holdApplicationUntilProxyStarts": true, "terminationDrainDuration": "15s"}'}),
        "Deployment/router authenticates callers (RequestAuthentication/router) but its sidecar forwards "
        "x-forwarded-client-cert as APPEND_FORWARD"),
    "a JWKS URI of a scheme Istio cannot fetch": (
        lambda d: _find(d, "RequestAuthentication", "router")["spec"]["jwtRules"][0].update(
            jwksUri="ftp://issuer.example/keys"),
        "URI scheme of 'ftp://issuer.example/keys' is not supported"),
    "a claim copied to a header Istio refuses to write": (
        lambda d: _find(d, "RequestAuthentication", "router")["spec"]["jwtRules"][0]["outputClaimToHeaders"][0].update(
            header="x-infermesh:tenant"),
        "header name x-infermesh:tenant is not a valid header name"),
    "pod memory limit below its service's budget and baseline": (
        lambda d: (_container(d, "batcher")["resources"]["limits"].update(memory="512Mi"),
                   _container(d, "batcher")["env"].append(
                       {"name": "INFERMESH_BATCHER_REQUEST_BUDGET_BYTES", "value": str(192 << 20)})),
        "Deployment/batcher: services.batcher's config from container batcher's environment is refused"),
    "explicit byte budget the pod's limit does not cover": (
        lambda d: _container(d, "router")["env"].extend([
            {"name": "INFERMESH_ROUTER_MEMORY_LIMIT_BYTES", "value": str(4 << 30)},
            {"name": "INFERMESH_ROUTER_REQUEST_BUDGET_BYTES", "value": str(512 << 20)}]),
        "Deployment/router: container router's memory limit 1073741824 bytes is below what services.router may take"),
    "pod with no memory limit": (
        lambda d: _container(d, "cache")["resources"].pop("limits"),
        "Deployment/cache: container cache has no memory limit"),
    "dashboard query of a metric we do not export": (
        _break_dashboard, "infermesh_router_answers_total is not a series our services export"),
}


@pytest.mark.service
@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_check_catches_its_mistake(mistake, production, istio):
    docs = copy.deepcopy(production)
    break_it, expected = MISTAKES[mistake]
    break_it(docs)
    for doc in docs:  # appProtocol=None above means "without one"
        if doc["kind"] == "Service":
            for port in doc["spec"]["ports"]:
                if port.get("appProtocol", "") is None:
                    del port["appProtocol"]
    found = manifests.problems(docs, istio)
    assert any(expected in p for p in found), "\n".join(found)


@pytest.mark.service
def test_a_namespace_given_by_an_overlay_must_carry_its_principals_along(istio, tmp_path):
    overlay = tmp_path / "elsewhere"
    overlay.mkdir()
    base = os.path.relpath(manifests.OVERLAYS / "dev", overlay)  # kustomize takes relative paths only
    (overlay / "kustomization.yaml").write_text(f"resources:\n- {base}\nnamespace: serving\n")
    found = manifests.problems(manifests.render(overlay), istio)
    assert any("principal 'cluster.local/ns/infermesh/sa/infermesh-batcher' is no service account of namespace "
               "'serving'" in p for p in found), found


@pytest.mark.service
def test_a_release_goes_to_green_alone_then_to_blue_and_the_vip_pool(tmp_path):
    """Each pool has an image name of its own, so the blue-green steps of
    docs/kubernetes.md move one pool at a time; the other services keep theirs."""
    shutil.copytree(manifests.ROOT / "mesh", tmp_path / "mesh")  # edited in place, as docs/kubernetes.md does
    overlay = tmp_path / "mesh" / "kubernetes" / "overlays" / "production"

    def images():
        docs = manifests.render(overlay)
        return {d["metadata"]["name"]: _container(docs, d["metadata"]["name"])["image"]
                for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] != "redis"}

    def set_image(*pairs):
        subprocess.run([str(manifests.KUSTOMIZE), "edit", "set", "image", *pairs], cwd=overlay, check=True)

    set_image(*(f"{name}=registry.example/infermesh:1.0" for name in
                ("infermesh", "infermesh-model-server-blue", "infermesh-model-server-green",
                 "infermesh-model-server-vip")))
    assert set(images().values()) == {"registry.example/infermesh:1.0"}
    set_image("infermesh-model-server-green=registry.example/infermesh:1.1")  # the canary
    assert images() == {"router": "registry.example/infermesh:1.0", "batcher": "registry.example/infermesh:1.0",
                        "cache": "registry.example/infermesh:1.0",
                        "model-server-blue": "registry.example/infermesh:1.0",
                        "model-server-green": "registry.example/infermesh:1.1",
                        "model-server-vip": "registry.example/infermesh:1.0"}
    set_image("infermesh-model-server-blue=registry.example/infermesh:1.1",
              "infermesh-model-server-vip=registry.example/infermesh:1.1")  # promoted
    assert {name: image for name, image in images().items() if name.startswith("model-server")} == {
        f"model-server-{pool}": "registry.example/infermesh:1.1" for pool in ("blue", "green", "vip")}


@pytest.mark.service
def test_each_sidecar_carries_connections_until_its_service_has_drained(production):
    """Istio's sidecar stops 5 s after SIGTERM unless told otherwise; our services
    drain for up to their drain grace (10 s, the cache 5 s), within the pod's grace."""
    drain_grace_s = {"router": 10, "batcher": 10, "cache": 5}
    for deployment in (d for d in production if d["kind"] == "Deployment" and d["metadata"]["name"] != "redis"):
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]
        config = json.loads(pod["metadata"]["annotations"]["proxy.istio.io/config"])
        sidecar_s = traffic.parse_duration(config["terminationDrainDuration"], name)
        assert drain_grace_s.get(name, 10) < sidecar_s < pod["spec"]["terminationGracePeriodSeconds"], name


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
            mount = max((m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")),
                        key=lambda m: len(m["mountPath"]))
            volume = next(v for v in router["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
            max_bytes = int(env["INFERMESH_ROUTER_FAILURE_SAMPLES_MAX_BYTES"])
            assert 2 * max_bytes <= _quantity_bytes(volume["emptyDir"]["sizeLimit"]), router["metadata"]["name"]


def _quantity_bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}
    for unit, factor in units.items():
        if quantity.endswith(unit):
            return int(quantity[:-len(unit)]) * factor
    return int(quantity)


@pytest.mark.service
def test_the_namespace_is_strict_mutual_tls_and_the_router_verifies_jwts(production):
    """One PeerAuthentication for the whole namespace (no selector) in STRICT mode, the
    per-service ALLOW policies kept, and the router's sidecar checking end users' JWTs."""
    (peer,) = [d for d in production if d["kind"] == "PeerAuthentication"]
    assert peer["spec"] == {"mtls": {"mode": "STRICT"}} and peer["metadata"]["namespace"] == "infermesh"
    allowed = {d["metadata"]["name"] for d in production
               if d["kind"] == "AuthorizationPolicy" and d["spec"].get("action") == "ALLOW"}
    assert {"model-server", "batcher", "cache"} <= allowed
    (authentication,) = [d for d in production if d["kind"] == "RequestAuthentication"]
    assert authentication["spec"]["selector"] == {"matchLabels": {"app": "router"}}
