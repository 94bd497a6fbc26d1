"""The manifests and meshctl --apply against a real Kubernetes API server
(tests/kube.py) with Istio's CRDs and the PrometheusRule's: every rendered
overlay is accepted by a server-side dry run with strict field validation (the
server's own schemas, defaulting and CEL rules), and meshctl patches the live
VirtualService."""

import contextlib
import copy
import shutil
import subprocess
import sys

import prometheus_client
import pytest
import yaml

from services.meshctl import core
from services.meshctl.core import MeshctlError
from services.meshctl.live import Cluster, weight_patch
from tests.kube import KubeAPI
from tools import manifests

POLICY = manifests.ROOT / "mesh" / "istio" / "model-server-traffic.yaml"
OVERLAYS = sorted(p for p in manifests.OVERLAYS.iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def kube():
    with KubeAPI() as api:
        yield api


def _resource(api, doc):
    return api.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])


@pytest.mark.e2e
@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_the_api_server_accepts_every_resource_of_every_overlay(kube, overlay):
    api = kube.client()
    docs = manifests.render(overlay)
    for namespace in (d for d in docs if d["kind"] == "Namespace"):
        if not any(n.metadata.name == namespace["metadata"]["name"] for n in _resource(api, namespace).get().items):
            _resource(api, namespace).create(body=namespace)
    for doc in docs:
        if doc["kind"] == "Namespace":
            continue
        created = _resource(api, doc).create(
            body=doc,
            namespace=doc["metadata"].get("namespace"),
            dry_run="All",
            query_params=[("fieldValidation", "Strict")],
        )
        assert created.metadata.name == doc["metadata"]["name"]


@pytest.mark.e2e
def test_the_api_server_rejects_what_istio_forbids(kube):
    """The same server refuses a broken VirtualService: the dry runs above mean something."""
    from kubernetes.dynamic.exceptions import UnprocessibleEntityError

    api = kube.client()
    service = next(d for d in yaml.safe_load_all(POLICY.read_text()) if d["kind"] == "VirtualService")
    broken = copy.deepcopy(service)
    broken["spec"]["http"][1]["retries"]["perTryTimeout"] = "0s"  # CEL: at least 1ms
    with pytest.raises(UnprocessibleEntityError, match="perTryTimeout"):
        _resource(api, broken).create(body=broken, namespace="default", dry_run="All")


@pytest.mark.e2e
def test_the_api_server_validates_the_alert_rules_against_their_crd(kube):
    """The PrometheusRule CRD is installed: a rule with a `for` that is no duration is refused."""
    from kubernetes.dynamic.exceptions import UnprocessibleEntityError

    api = kube.client()
    rules = yaml.safe_load(
        (manifests.ROOT / "mesh" / "kubernetes" / "monitoring" / "infermesh-alerts.yaml").read_text()
    )
    broken = copy.deepcopy(rules)
    broken["spec"]["groups"][0]["rules"][0]["for"] = "5 minutes"
    with pytest.raises(UnprocessibleEntityError, match="for"):
        _resource(api, broken).create(body=broken, namespace="default", dry_run="All")
    assert _resource(api, rules).create(body=rules, namespace="default", dry_run="All").metadata.name == "infermesh"


@pytest.fixture
def live(kube, tmp_path):
    """mesh/istio's model-server policy in the cluster, and a copy of the file."""
    api = kube.client()
    namespace = f"live-{tmp_path.name[-12:].lower().replace('_', '-')}".rstrip("-")
    api.resources.get(api_version="v1", kind="Namespace").create(
        body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    )
    for doc in yaml.safe_load_all(POLICY.read_text()):
        _resource(api, doc).create(body=doc, namespace=namespace)
    policy = tmp_path / "model-server-traffic.yaml"
    shutil.copy(POLICY, policy)
    return api, namespace, policy


def meshctl(kube, namespace, policy, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "services.meshctl",
            "--file",
            str(policy),
            "--apply",
            "--kubeconfig",
            str(kube.kubeconfig),
            "--namespace",
            namespace,
            *args,
        ],
        capture_output=True,
        text=True,
    )


def live_service(api, namespace):
    return (
        api.resources.get(api_version="networking.istio.io/v1", kind="VirtualService")
        .get(name="model-server", namespace=namespace)
        .to_dict()
    )


@pytest.mark.e2e
def test_set_weights_and_rollback_change_the_live_virtual_service_and_the_file(kube, live):
    api, namespace, policy = live
    done = meshctl(kube, namespace, policy, "set-weights", "model-server", "blue=90", "green=10")
    assert done.returncode == 0, done.stderr
    service = live_service(api, namespace)
    assert [r.get("weight") for r in service["spec"]["http"][1]["route"]] == [90, 10]
    assert service["spec"]["http"][0]["route"][0]["destination"]["subset"] == "vip"  # untouched
    assert service["metadata"]["annotations"][core.PREVIOUS] == '{"blue": 100, "green": 0}'
    assert core.weights(policy, "model-server") == {"blue": 90, "green": 10}

    assert meshctl(kube, namespace, policy, "rollback", "model-server").returncode == 0
    assert [r.get("weight") for r in live_service(api, namespace)["spec"]["http"][1]["route"]] == [100, 0]
    assert core.weights(policy, "model-server") == {"blue": 100, "green": 0}
    with metrics_page() as url:
        status = meshctl(kube, namespace, policy, "status", "model-server", "--metrics", url)
        assert status.returncode == 0 and status.stderr == "", status.stderr  # file and cluster agree
        assert [line.split()[:2] for line in status.stdout.splitlines()[1:]] == [["blue", "100"], ["green", "0"]]
        Cluster(namespace, kubeconfig=str(kube.kubeconfig)).set_weights("model-server", {"blue": 70, "green": 30})
        status = meshctl(kube, namespace, policy, "status", "model-server", "--metrics", url)
        assert status.returncode == 0
        assert (
            "warning: the live VirtualService has {'blue': 70, 'green': 30}, the file {'blue': 100, 'green': 0}"
            in status.stderr
        )
    status = meshctl(kube, namespace, policy, "status", "model-server", "--metrics", "http://127.0.0.1:1/metrics")
    assert status.returncode == 2 and "cannot read the batcher's metrics at http://127.0.0.1:1/metrics" in status.stderr


@contextlib.contextmanager
def metrics_page():
    """A /metrics page with nothing on it yet, as a batcher that just started has."""
    server, thread = prometheus_client.start_http_server(
        0, addr="127.0.0.1", registry=prometheus_client.CollectorRegistry()
    )
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        thread.join()


@pytest.mark.e2e
def test_a_live_change_that_fails_leaves_the_file_as_it_was(kube, live):
    api, namespace, policy = live
    service = live_service(api, namespace)
    service["spec"]["http"][1]["route"][1]["destination"]["subset"] = "canary"  # someone else's edit
    api.resources.get(api_version="networking.istio.io/v1", kind="VirtualService").replace(
        body=service, namespace=namespace
    )
    before = policy.read_text()
    done = meshctl(kube, namespace, policy, "promote", "model-server", "green")
    assert done.returncode == 2 and "live route blue-green splits between ['blue', 'canary']" in done.stderr
    assert policy.read_text() == before


@pytest.mark.e2e
def test_a_patch_computed_from_a_stale_copy_is_refused(kube, live):
    _api, namespace, _ = live
    cluster = Cluster(namespace, kubeconfig=str(kube.kubeconfig))
    stale = cluster.virtual_service("model-server")
    cluster.set_weights("model-server", {"blue": 50, "green": 50})  # a change since `stale` was read
    ops, _ = weight_patch(stale, {"blue": 0, "green": 100})
    with pytest.raises(MeshctlError, match=r"HTTP (409|422)"):
        cluster._call(
            "patching",
            cluster._api.patch_namespaced_custom_object,
            "model-server",
            ops,
            _content_type="application/json-patch+json",
        )
    assert cluster.weights("model-server") == {"blue": 50, "green": 50}


@pytest.mark.service
def test_apply_without_a_cluster_says_so(tmp_path):
    policy = tmp_path / "p.yaml"
    shutil.copy(POLICY, policy)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.meshctl",
            "--file",
            str(policy),
            "--apply",
            "--kubeconfig",
            str(tmp_path / "none"),
            "promote",
            "model-server",
            "green",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "no Kubernetes cluster to apply to" in done.stderr
    assert core.weights(policy, "model-server") == {"blue": 100, "green": 0}


@pytest.mark.e2e
def test_a_rollout_in_a_cluster_is_refused_before_it_changes_anything(kube, live):
    """The batcher behind Istio has no per-subset figures: a rollout judged on them
    would roll back every time, so meshctl says so instead of starting one."""
    api, namespace, policy = live
    done = meshctl(kube, namespace, policy, "rollout", "model-server", "green", "--interval-s", "1")
    assert done.returncode == 2 and "rollout --apply is not supported" in done.stderr
    assert [r.get("weight") for r in live_service(api, namespace)["spec"]["http"][1]["route"]] == [100, 0]
    assert core.weights(policy, "model-server") == {"blue": 100, "green": 0}


@pytest.mark.e2e
def test_a_rollback_in_the_cluster_goes_back_to_the_live_objects_previous_weights(kube, live):
    """Another operator changed the live weights from another copy of the file:
    rollback --apply undoes that change, not this file's older one."""
    api, namespace, policy = live
    assert meshctl(kube, namespace, policy, "set-weights", "model-server", "blue=90", "green=10").returncode == 0
    Cluster(namespace, kubeconfig=str(kube.kubeconfig)).set_weights("model-server", {"blue": 50, "green": 50})
    done = meshctl(kube, namespace, policy, "rollback", "model-server")
    assert done.returncode == 0, done.stderr
    assert [r.get("weight") for r in live_service(api, namespace)["spec"]["http"][1]["route"]] == [90, 10]
    assert core.weights(policy, "model-server") == {"blue": 90, "green": 10}


@pytest.mark.e2e
def test_meshctl_in_a_pod_with_its_service_account_may_patch_weights_and_nothing_else(kube, live, tmp_path):
    """mesh/kubernetes/base/meshctl-rbac.yaml, under the API server's RBAC: a token
    of the infermesh-meshctl service account can shift the weights, and cannot
    read the namespace's Secrets."""
    from kubernetes import client, config

    api, namespace, policy = live
    for doc in yaml.safe_load_all((manifests.ROOT / "mesh" / "kubernetes" / "base" / "meshctl-rbac.yaml").read_text()):
        for subject in doc.get("subjects", []):
            subject["namespace"] = namespace
        _resource(api, doc).create(body=doc, namespace=namespace)
    admin = config.new_client_from_config(config_file=str(kube.kubeconfig))
    token = (
        client.CoreV1Api(admin)
        .create_namespaced_service_account_token("infermesh-meshctl", namespace, {"spec": {"expirationSeconds": 600}})
        .status.token
    )
    as_meshctl = yaml.safe_load(kube.kubeconfig.read_text())
    as_meshctl["users"] = [{"name": "admin", "user": {"token": token}}]
    kubeconfig = tmp_path / "meshctl-kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(as_meshctl))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.meshctl",
            "--file",
            str(policy),
            "--apply",
            "--kubeconfig",
            str(kubeconfig),
            "--namespace",
            namespace,
            "set-weights",
            "model-server",
            "blue=80",
            "green=20",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert [r.get("weight") for r in live_service(api, namespace)["spec"]["http"][1]["route"]] == [80, 20]
    with pytest.raises(client.exceptions.ApiException) as refused:
        client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig))).list_namespaced_secret(namespace)
    assert refused.value.status == 403
