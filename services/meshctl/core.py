"""What meshctl does, without the command line: read and edit the traffic
policy file (keeping its comments and order) and read the mesh's health from
the batcher's metrics."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pathlib
import tempfile

from services.common.traffic import PolicyError, load_policy_files

PREVIOUS = "infermesh.io/previous-weights"  # annotation: the weights before the last change, for rollback


class MeshctlError(Exception):
    """A request meshctl cannot carry out; the message says why."""


def _yaml():
    from ruamel.yaml import YAML

    yaml = YAML()  # round-trip: comments, order and quoting survive an edit
    yaml.preserve_quotes = True
    yaml.indent(mapping=2, sequence=2, offset=0)  # our files put list dashes under their key
    return yaml


def _virtual_service(documents: list, host: str):
    for doc in documents:
        if doc and doc.get("kind") == "VirtualService" and host in (doc.get("spec", {}).get("hosts") or []):
            return doc
    raise MeshctlError(f"no VirtualService for host {host!r}")


def weighted_routes(service) -> list:
    """The routes that split traffic by subset (header-matched single-subset routes are left alone)."""
    return [http for http in service["spec"]["http"] if len(http.get("route", [])) > 1]


def route_weights(http) -> dict[str, int]:
    """One route's weights, by subset."""
    return {r["destination"].get("subset", ""): int(r.get("weight", 0)) for r in http["route"]}


def weights(path: pathlib.Path, host: str) -> dict[str, int]:
    """The weights of the first weighted route, by subset."""
    documents = list(_yaml().load_all(path.read_text()))
    routes = weighted_routes(_virtual_service(documents, host))
    if not routes:
        raise MeshctlError(f"the VirtualService for {host!r} has no route split between subsets")
    return route_weights(routes[0])


def set_weights(path: pathlib.Path, host: str, wanted: dict[str, int], live=None) -> dict[str, int]:
    """Sets the weights of every route that splits traffic between these
    subsets; records the old ones for rollback; writes atomically, and only
    a file that still passes the policy checks. With `live` (a live.Cluster)
    the live VirtualService is patched the same way first, and the file is
    left as it was when that fails. Returns the old weights."""
    if any(w < 0 for w in wanted.values()) or not any(wanted.values()):
        raise MeshctlError(f"weights must be >= 0 and not all 0, got {wanted}")
    yaml = _yaml()
    documents = list(yaml.load_all(path.read_text()))
    service = _virtual_service(documents, host)
    routes = weighted_routes(service)
    old = None
    for http in routes:
        subsets = {r["destination"].get("subset", "") for r in http["route"]}
        if subsets != set(wanted):
            raise MeshctlError(
                f"route {http.get('name', '?')} splits between {sorted(subsets)}; give a weight for "
                f"each of them (got {sorted(wanted)})"
            )
        if old is None:
            old = route_weights(http)
        for destination in http["route"]:
            destination["weight"] = wanted[destination["destination"].get("subset", "")]
    if old is None:
        raise MeshctlError(f"the VirtualService for {host!r} has no route split between subsets")
    service["metadata"].setdefault("annotations", {})[PREVIOUS] = json.dumps(old, sort_keys=True)
    buffer = io.StringIO()
    yaml.dump_all(documents, buffer)
    _write_checked(path, buffer.getvalue(), lambda: live.set_weights(host, wanted) if live is not None else None)
    return old


def previous_weights(path: pathlib.Path, host: str) -> dict[str, int]:
    documents = list(_yaml().load_all(path.read_text()))
    annotations = _virtual_service(documents, host)["metadata"].get("annotations") or {}
    if PREVIOUS not in annotations:
        raise MeshctlError(f"{path} records no earlier weights for {host!r} to roll back to")
    return {k: int(v) for k, v in json.loads(annotations[PREVIOUS]).items()}


def _write_checked(path: pathlib.Path, text: str, before_replace=lambda: None) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        try:
            load_policy_files(pathlib.Path(tmp))
        except PolicyError as exc:
            raise MeshctlError(f"the edited policy would not pass its checks, nothing written: {exc}") from None
        before_replace()  # e.g. the live patch: when it fails, the file stays as it was
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)  # readers (the batcher) see the old file or the new one, never half of it
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ---------------------------------------------------------------- status


def subset_health(samples: dict, subset: str) -> dict:
    """Ready replicas, answered batches, success rate and p99 (histogram bucket bound) of one subset."""
    total, ok, buckets = _subset_counters(samples, subset)
    ready = sum(
        v
        for (n, ls), v in samples.items()
        if n == "infermesh_batcher_subset_ready_replicas" and dict(ls).get("subset") == subset
    )
    p99 = _p99(buckets)
    return {
        "ready_replicas": int(ready),
        "batches": int(total),
        "success_rate": (ok / total) if total else None,
        "p99_s": None if math.isinf(p99) else p99,
    }


def services_table(run_file: pathlib.Path) -> list[str]:
    """The lines `meshctl services` prints: each service of the local mesh that
    `run_file` describes, as its launcher's supervisor sees it."""
    try:
        info = json.loads(run_file.read_text())
    except (OSError, ValueError):
        raise MeshctlError(f"{run_file}: no running mesh described (start one with 'make run')") from None
    services = info.get("services")
    if not isinstance(services, dict):
        raise MeshctlError(f"{run_file} lists no services (written by an older launcher?)")
    launcher = info.get("launcher")
    if isinstance(launcher, int) and not pathlib.Path(f"/proc/{launcher}").exists():
        raise MeshctlError(f"{run_file} is stale: its launcher (pid {launcher}) is gone")
    lines = [f"{'service':<16} {'pid':>8} {'state':<9} {'restarts':>8} {'ready':<5} last exit"]
    for name, s in services.items():
        lines.append(
            f"{name:<16} {s.get('pid') or '-':>8} {s.get('state', '?'):<9} {s.get('restarts', 0):>8} "
            f"{'yes' if s.get('ready') else 'no':<5} {s.get('last_exit') or '-'}"
        )
    return lines


def batcher_metrics_url(run_file: pathlib.Path) -> str:
    try:
        info = json.loads(run_file.read_text())
    except (OSError, ValueError):
        raise MeshctlError(f"{run_file}: no running mesh described (start one with 'make run')") from None
    return info["metrics"]["batcher"]


# ---------------------------------------------------------------- progressive delivery


@dataclasses.dataclass(frozen=True)
class Checks:
    """What each interval of a rollout must show for the canary subset."""

    min_success_rate: float = 0.99
    max_p99_s: float = 1.0
    min_batches: int = 1  # an interval with no traffic on the canary is a failed check


def _subset_counters(samples: dict, subset: str) -> tuple[float, float, list[tuple[float, float]]]:
    total = ok = 0.0
    buckets = []
    for (name, labels), value in samples.items():
        labels = dict(labels)
        if labels.get("subset") != subset:
            continue
        if name == "infermesh_batcher_upstream_requests_total":
            total += value
            ok += value if labels.get("code") == "OK" else 0.0
        elif name == "infermesh_batcher_upstream_duration_seconds_bucket":
            buckets.append((float(labels["le"]), value))
    return total, ok, sorted(buckets)


def _p99(buckets: list[tuple[float, float]]) -> float:
    """The bound of the first cumulative bucket holding 99% of the answers; inf without any."""
    answered = buckets[-1][1] if buckets else 0.0
    return next((le for le, count in buckets if answered and count >= 0.99 * answered), math.inf)


def judge(before: dict, after: dict, subset: str, checks: Checks) -> tuple[bool, str]:
    """The canary's figures over one interval (the difference of two scrapes) against the checks."""
    total0, ok0, buckets0 = _subset_counters(before, subset)
    total1, ok1, buckets1 = _subset_counters(after, subset)
    batches = total1 - total0
    if batches < checks.min_batches:
        return False, f"{int(batches)} batches reached {subset} (need {checks.min_batches}): no evidence is a failure"
    success = (ok1 - ok0) / batches
    earlier = dict(buckets0)
    p99 = _p99([(le, count - earlier.get(le, 0.0)) for le, count in buckets1])
    verdict = f"{int(batches)} batches, success {100 * success:.2f}%, p99 <= {1000 * p99:.0f} ms"
    if success < checks.min_success_rate:
        return False, verdict + f" (need >= {100 * checks.min_success_rate:.2f}%)"
    if p99 > checks.max_p99_s:
        return False, verdict + f" (need p99 <= {1000 * checks.max_p99_s:.0f} ms)"
    return True, verdict


def rollout(
    path: pathlib.Path,
    host: str,
    canary: str,
    step: int,
    max_weight: int,
    interval_s: float,
    checks: Checks,
    read_metrics,
    sleep,
    say,
    threshold: int = 1,
) -> bool:
    """Flagger's loop: raise the canary's weight by `step` up to `max_weight`,
    judging each interval; after `threshold` failed checks go back to the
    stable subset and return False; after the last step promote the canary."""
    subsets = weights(path, host)
    if canary not in subsets or len(subsets) != 2:
        raise MeshctlError(f"a rollout needs a route split between two subsets including {canary!r}; have {subsets}")
    if not 0 < step <= max_weight <= 100:
        raise MeshctlError(f"need 0 < step <= max_weight <= 100, got step {step}, max_weight {max_weight}")
    stable = next(s for s in subsets if s != canary)
    failed = 0
    weight = 0
    while weight < max_weight:
        weight = min(weight + step, max_weight)
        set_weights(path, host, {canary: weight, stable: 100 - weight})
        try:
            before = read_metrics()
            sleep(interval_s)
            passed, verdict = judge(before, read_metrics(), canary, checks)
        except MeshctlError as exc:  # no figures is no evidence: a failed check, never a rollout left half done
            passed, verdict = False, str(exc)
        say(f"{canary} at {weight}%: {verdict}: {'ok' if passed else 'FAILED'}")
        if not passed:
            failed += 1
            if failed >= threshold:
                set_weights(path, host, {canary: 0, stable: 100})
                say(f"rolled back: all traffic to {stable}")
                return False
            weight -= step  # judge this weight again
    set_weights(path, host, {canary: 100, stable: 0})
    say(f"promoted {canary}: all traffic to it")
    return True
