"""meshctl: the operators' CLI for the traffic policy.

    meshctl status model-server
    meshctl set-weights model-server blue=90 green=10
    meshctl promote model-server green
    meshctl rollback model-server
    meshctl rollout model-server green --step 10 --interval-s 30
    meshctl tenants add acme --tier vip   (services/meshctl/tenants.py)
    meshctl services    (a local mesh's processes: pid, state, restarts, ready)

Edits go to the policy file (default mesh/istio/model-server-traffic.yaml),
keeping its comments and order; a running local mesh picks them up within a
second. With --apply the same change is patched into the live VirtualService
through the Kubernetes API (kubeconfig, or the pod's service account), and the
file is left alone if that fails. Cumulative metrics (success rate, p99) come
from the batcher of the mesh described in var/run/mesh.json.
"""

import argparse
import http.client
import pathlib
import sys
import time

from services.common.identity import RegistryError
from services.common.metrics import scrape
from services.meshctl import core, tenants

DEFAULT_FILE = pathlib.Path("mesh/istio/model-server-traffic.yaml")
DEFAULT_RUN_FILE = pathlib.Path("var/run/mesh.json")


def _parse_weights(items: list[str]) -> dict[str, int]:
    wanted = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise core.MeshctlError(f"weights are SUBSET=INTEGER, got {item!r}")
        wanted[name.strip()] = int(value)
    return wanted


def _scrape(url: str) -> dict:
    try:
        return scrape(url)
    except (OSError, ValueError, http.client.HTTPException) as exc:  # URLError is an OSError
        raise core.MeshctlError(f"cannot read the batcher's metrics at {url}: {exc}") from None


def _warn_of_unready_subsets(args, weights: dict[str, int]) -> None:
    """Where a local mesh runs (its batcher's metrics can be read), says which
    subsets now take traffic with no ready replica: their share of the batches
    fails UNAVAILABLE (no healthy upstream) until one starts."""
    try:
        samples = _scrape(args.metrics or core.batcher_metrics_url(args.run_file))
    except core.MeshctlError:
        return  # no mesh running here: the file is all there is to change
    for subset, weight in weights.items():
        if weight > 0 and core.subset_health(samples, subset)["ready_replicas"] == 0:
            print(
                f"warning: subset {subset!r} now takes {weight} of the weight but the running batcher has no "
                f"ready replica in it: its share of batches fails UNAVAILABLE until one starts",
                file=sys.stderr,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="meshctl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--file", type=pathlib.Path, default=DEFAULT_FILE, help="the traffic policy YAML")
    parser.add_argument(
        "--apply",
        action="store_true",
        help="also patch the live VirtualService in Kubernetes (status: compare with it)",
    )
    parser.add_argument("--namespace", default="infermesh", help="with --apply: the VirtualService's namespace")
    parser.add_argument("--context", help="with --apply: the kubeconfig context (default: the current one)")
    parser.add_argument(
        "--kubeconfig", help="with --apply: the kubeconfig file (default: $KUBECONFIG or ~/.kube/config)"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="weights per subset, ready replicas, success rate and p99")
    status.add_argument("host")
    status.add_argument("--run-file", type=pathlib.Path, default=DEFAULT_RUN_FILE)
    status.add_argument("--metrics", help="the batcher's metrics URL (instead of --run-file)")
    weights = commands.add_parser("set-weights", help="set every subset's weight, e.g. blue=90 green=10")
    weights.add_argument("host")
    weights.add_argument("weights", nargs="+")
    promote = commands.add_parser("promote", help="all traffic to one subset")
    promote.add_argument("host")
    promote.add_argument("subset")
    rollback = commands.add_parser("rollback", help="back to the weights before the last change")
    rollback.add_argument("host")
    for edit in (weights, promote, rollback):  # a running mesh, to warn of a subset with no ready replica
        edit.add_argument("--run-file", type=pathlib.Path, default=DEFAULT_RUN_FILE)
        edit.add_argument("--metrics", help="the batcher's metrics URL (instead of --run-file)")
    rollout = commands.add_parser(
        "rollout",
        help="progressive delivery: raise the canary step by step while its "
        "checks pass; promote at the end, roll back on failure",
    )
    rollout.add_argument("host")
    rollout.add_argument("canary", help="the subset to roll out, e.g. green")
    rollout.add_argument("--step", type=int, default=10, help="weight added per interval (Flagger's stepWeight)")
    rollout.add_argument("--max-weight", type=int, default=50, help="last weight judged before promotion")
    rollout.add_argument("--interval-s", type=float, default=30.0, help="how long each weight is judged")
    rollout.add_argument("--min-success-rate", type=float, default=0.99)
    rollout.add_argument("--max-p99-ms", type=float, default=1000.0)
    rollout.add_argument("--threshold", type=int, default=1, help="failed checks before rolling back")
    rollout.add_argument("--run-file", type=pathlib.Path, default=DEFAULT_RUN_FILE)
    rollout.add_argument("--metrics", help="the batcher's metrics URL (instead of --run-file)")
    services = commands.add_parser("services", help="a local mesh's services: pid, state, restarts and ready flag")
    services.add_argument("--run-file", type=pathlib.Path, default=DEFAULT_RUN_FILE)
    tenants.add_commands(commands)
    args = parser.parse_args(argv)
    if args.command == "tenants":
        try:
            return tenants.run(args)
        except (tenants.TenantsError, RegistryError) as exc:
            print(f"meshctl: {exc}", file=sys.stderr)
            return 2
    try:
        if args.apply and args.command == "rollout":
            # Behind Istio the batcher has one Service address and no per-subset figures to judge by.
            raise core.MeshctlError(
                "rollout --apply is not supported: in a cluster the canary's figures are Istio's telemetry "
                "(istio_requests_total by destination_version), which meshctl does not read yet; step the weights "
                "with set-weights --apply and watch that telemetry, or let Flagger drive the rollout"
            )
        live = None
        if args.apply:
            from services.meshctl.live import Cluster

            live = Cluster(args.namespace, args.context, args.kubeconfig)
        if args.command == "services":
            for line in core.services_table(args.run_file):
                print(line)
        elif args.command == "status":
            current = core.weights(args.file, args.host)
            if live is not None and live.weights(args.host) != current:
                print(
                    f"warning: the live VirtualService has {live.weights(args.host)}, the file {current}",
                    file=sys.stderr,
                )
            samples = _scrape(args.metrics or core.batcher_metrics_url(args.run_file))
            print(f"{'subset':<10} {'weight':>6} {'ready':>5} {'batches':>8} {'success':>8} {'p99':>8}")
            for subset, weight in current.items():
                h = core.subset_health(samples, subset)
                success = "-" if h["success_rate"] is None else f"{100 * h['success_rate']:.2f}%"
                p99 = "-" if h["p99_s"] is None else f"<={1000 * h['p99_s']:.0f}ms"
                print(f"{subset:<10} {weight:>6} {h['ready_replicas']:>5} {h['batches']:>8} {success:>8} {p99:>8}")
        elif args.command == "set-weights":
            old = core.set_weights(args.file, args.host, _parse_weights(args.weights), live)
            print(f"{args.host}: {old} -> {core.weights(args.file, args.host)} in {args.file}")
        elif args.command == "promote":
            subsets = core.weights(args.file, args.host)
            if args.subset not in subsets:
                raise core.MeshctlError(f"{args.host} has no subset {args.subset!r}; it has {sorted(subsets)}")
            old = core.set_weights(args.file, args.host, {s: 100 if s == args.subset else 0 for s in subsets}, live)
            print(f"{args.host}: promoted {args.subset} ({old} -> {core.weights(args.file, args.host)})")
        elif args.command == "rollout":
            url = args.metrics or core.batcher_metrics_url(args.run_file)
            checks = core.Checks(args.min_success_rate, args.max_p99_ms / 1000)
            promoted = core.rollout(
                args.file,
                args.host,
                args.canary,
                args.step,
                args.max_weight,
                args.interval_s,
                checks,
                lambda: _scrape(url),
                time.sleep,
                lambda line: print(line, flush=True),
                args.threshold,
            )
            return 0 if promoted else 1
        elif args.command == "rollback":
            # In a cluster, the live object's record: another operator may have changed it from elsewhere.
            target = (
                live.previous_weights(args.host) if live is not None else core.previous_weights(args.file, args.host)
            )
            old = core.set_weights(args.file, args.host, target, live)
            print(f"{args.host}: rolled back {old} -> {target}")
        if args.command in ("set-weights", "promote", "rollback") and live is None:
            _warn_of_unready_subsets(args, core.weights(args.file, args.host))
    except core.MeshctlError as exc:
        print(f"meshctl: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
