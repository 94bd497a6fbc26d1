"""meshctl --apply: the weight change made to the policy file, made to the
live VirtualService too, through the Kubernetes API.

The change is one JSON Patch that first tests what it was computed from (the
object's resourceVersion and each destination's subset), so an edit that
someone else made in between fails the patch instead of being overwritten.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib

from services.meshctl.core import PREVIOUS, MeshctlError, route_weights, weighted_routes

GROUP, VERSION, PLURAL = "networking.istio.io", "v1", "virtualservices"


def weight_patch(live: dict, wanted: dict[str, int]) -> tuple[list[dict], dict[str, int]]:
    """The JSON Patch (RFC 6902) that gives the live VirtualService's weighted
    routes the `wanted` weights and records the old ones for rollback; and the
    old weights."""
    split = [id(http) for http in weighted_routes(live)]
    if not split:
        raise MeshctlError(f"the live VirtualService {live['metadata']['name']} has no route split between subsets")
    ops: list[dict] = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": live["metadata"]["resourceVersion"]}
    ]
    old: dict[str, int] | None = None  # the first weighted route's
    for i, http in enumerate(live["spec"]["http"]):  # by position: two routes may be equal
        if id(http) not in split:
            continue
        subsets = [r["destination"].get("subset", "") for r in http["route"]]
        if set(subsets) != set(wanted):
            raise MeshctlError(
                f"live route {http.get('name', i)} splits between {sorted(subsets)}; give a weight "
                f"for each of them (got {sorted(wanted)})"
            )
        if old is None:
            old = route_weights(http)
        for j, subset in enumerate(subsets):
            at = f"/spec/http/{i}/route/{j}"
            ops.append({"op": "test", "path": f"{at}/destination/subset", "value": subset})
            ops.append({"op": "add", "path": f"{at}/weight", "value": wanted[subset]})  # add replaces a member
    if "annotations" not in live["metadata"]:
        ops.append({"op": "add", "path": "/metadata/annotations", "value": {}})
    ops.append(
        {
            "op": "add",
            "path": "/metadata/annotations/" + PREVIOUS.replace("~", "~0").replace("/", "~1"),
            "value": json.dumps(old, sort_keys=True),
        }
    )
    assert old is not None  # there is a weighted route (split), and the first set it
    return ops, old


class Cluster:
    """The VirtualServices of one namespace of the cluster that kubeconfig (or,
    inside a pod, the pod's service account) points at."""

    def __init__(self, namespace: str, context: str | None = None, kubeconfig: str | None = None):
        from kubernetes import client, config

        self.namespace = namespace
        try:
            default = pathlib.Path(os.environ.get("KUBECONFIG", "~/.kube/config").split(os.pathsep)[0]).expanduser()
            if kubeconfig or context or default.exists():
                config.load_kube_config(config_file=kubeconfig, context=context)
            else:
                config.load_incluster_config()
        except (config.ConfigException, OSError) as exc:
            raise MeshctlError(f"no Kubernetes cluster to apply to: {exc}") from None
        self._api = client.CustomObjectsApi()

    def _call(self, what: str, method, *args, **kwargs):
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return method(GROUP, VERSION, self.namespace, PLURAL, *args, **kwargs)
        except ApiException as exc:
            reason = exc.reason
            with contextlib.suppress(TypeError, ValueError):  # no body, or not JSON: the reason alone
                reason = json.loads(exc.body or "").get("message", reason)
            raise MeshctlError(f"{what} in namespace {self.namespace!r}: HTTP {exc.status}: {reason}") from None
        except HTTPError as exc:
            raise MeshctlError(f"{what}: cannot reach the Kubernetes API: {exc}") from None

    def virtual_service(self, host: str) -> dict:
        found = self._call("listing VirtualServices", self._api.list_namespaced_custom_object)["items"]
        for item in found:
            if host in (item.get("spec", {}).get("hosts") or []) or item["metadata"]["name"] == host:
                return item
        raise MeshctlError(f"no live VirtualService for host {host!r} in namespace {self.namespace!r}")

    def weights(self, host: str) -> dict[str, int]:
        routes = weighted_routes(self.virtual_service(host))
        return route_weights(routes[0]) if routes else {}

    def previous_weights(self, host: str) -> dict[str, int]:
        """The weights before the live VirtualService's last change by meshctl
        (its annotation): what a rollback in the cluster goes back to, whoever
        made that change and from whichever copy of the file."""
        live = self.virtual_service(host)
        recorded = (live["metadata"].get("annotations") or {}).get(PREVIOUS)
        if recorded is None:
            raise MeshctlError(
                f"the live VirtualService {live['metadata']['name']!r} records no earlier weights to roll back to"
            )
        return {k: int(v) for k, v in json.loads(recorded).items()}

    def set_weights(self, host: str, wanted: dict[str, int]) -> dict[str, int]:
        live = self.virtual_service(host)
        ops, old = weight_patch(live, wanted)
        self._call(
            f"patching VirtualService {live['metadata']['name']}",
            self._api.patch_namespaced_custom_object,
            live["metadata"]["name"],
            ops,
            _content_type="application/json-patch+json",
        )
        return old
