"""make run: the whole mesh in the foreground until Ctrl-C or SIGTERM."""

import argparse
import contextlib
import json
import os
import pathlib
import signal
import sys
import time

from services.launcher.jaeger import Jaeger
from services.launcher.mesh import Mesh, MeshConfig, MeshError
from services.meshctl import tenants


def write_run_file(path: pathlib.Path, where: dict, status: dict) -> None:
    """The run file, replaced whole: readers never see half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps({**where, "services": status}, indent=1))
    partial.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="build/models", help="model repository")
    parser.add_argument(
        "--host", default=os.environ.get("INFERMESH_HOST", "127.0.0.1"), help="the router's public address to bind"
    )
    parser.add_argument(
        "--internal-host",
        default=os.environ.get("INFERMESH_INTERNAL_HOST", "127.0.0.1"),
        help="the address the internal services (batcher, model server, cache) bind",
    )
    parser.add_argument(
        "--tls-dir",
        default=os.environ.get("INFERMESH_TLS_DIR", ""),
        help="run every hop on mutual TLS with the certificates of this folder (make certs)",
    )
    parser.add_argument(
        "--port", type=int, default=int(os.environ.get("INFERMESH_PORT", 8001)), help="router gRPC port"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("INFERMESH_METRICS_PORT", 8002)),
        help="the first router's metrics port; the others take the next ones",
    )
    parser.add_argument(
        "--routers",
        type=int,
        default=int(os.environ.get("INFERMESH_ROUTERS", 1)),
        help="router processes sharing the gRPC port (SO_REUSEPORT), for more than one core's worth",
    )
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL"), help="use this Redis instead of starting one"
    )
    parser.add_argument(
        "--l2-path",
        default=os.environ.get("INFERMESH_L2_PATH", "var/cache"),
        help="the cache's on-disk L2 folder; it survives restarts ('' disables L2)",
    )
    parser.add_argument(
        "--run-file",
        type=pathlib.Path,
        default=pathlib.Path("var/run/mesh.json"),
        help="where to write every service's address while the mesh runs",
    )
    parser.add_argument("--log-dir", default=os.environ.get("INFERMESH_LOG_DIR"), help="write each service's log here")
    parser.add_argument(
        "--traffic-policy",
        default="mesh/istio/model-server-traffic.yaml",
        help="the VirtualService/DestinationRule the batcher applies ('' for none)",
    )
    parser.add_argument(
        "--model-server-labels",
        default="version=blue,pool=vip",
        help="labels of the model server, as a DestinationRule subset selects them (one local "
        "server is in both the blue subset and the VIP pool)",
    )
    parser.add_argument(
        "--tenants-file",
        type=pathlib.Path,
        default=pathlib.Path(os.environ.get("INFERMESH_TENANTS_FILE", "var/tenants.yaml")),
        help="the router's tenant registry; made with development tenants (keys printed once) if "
        "missing (meshctl tenants)",
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        default=os.environ.get("INFERMESH_TRACING", "") not in ("", "0"),
        help="start Jaeger (bin/jaeger: OTLP on 127.0.0.1:4317, its query API on 127.0.0.1:16686) and "
        "send every service's spans to it",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("INFERMESH_OTLP_ENDPOINT", ""),
        help="send every service's spans to this OTLP/gRPC collector (host:port) instead",
    )
    parser.add_argument(
        "--trace-ratio",
        type=float,
        default=float(os.environ.get("INFERMESH_TRACE_RATIO", 0.01)),
        help="the share of requests without a sampled traceparent that are traced",
    )
    args = parser.parse_args()
    if args.routers < 1:
        parser.error(f"--routers must be at least 1, got {args.routers}")
    if args.tracing and args.otlp_endpoint:
        parser.error("give --tracing (a Jaeger of the mesh's own) or --otlp-endpoint, not both")
    with contextlib.ExitStack() as stack:
        otlp_endpoint = args.otlp_endpoint
        if args.tracing:
            try:
                jaeger = stack.enter_context(Jaeger(usual_ports=True))
            except RuntimeError as exc:
                print(f"infermesh cannot start Jaeger: {exc}", file=sys.stderr)
                return 1
            otlp_endpoint = jaeger.otlp_grpc_endpoint
            print(f"infermesh: Jaeger's query API at {jaeger.query_url} (traces: /api/v3/traces/<id>)", flush=True)
        return run(args, otlp_endpoint)


def run(args: argparse.Namespace, otlp_endpoint: str) -> int:
    """Starts the mesh and runs it until a signal; its exit status."""

    def interrupt(*_):
        raise KeyboardInterrupt

    # While starting, a signal interrupts the start (which stops what it began);
    # once running, it asks the loop below to drain and stop.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    if not args.tenants_file.exists():
        tenants.parse_and_run(["--registry", str(args.tenants_file), "init"])
    try:
        mesh = Mesh(
            MeshConfig(
                models=args.models,
                tenants_file=args.tenants_file,
                host=args.host,
                internal_host=args.internal_host,
                tls_dir=args.tls_dir or None,
                router_port=args.port,
                metrics_port=args.metrics_port,
                redis_url=args.redis_url,
                l2_path=args.l2_path,
                log_dir=args.log_dir,
                model_server_labels=(args.model_server_labels,) if args.model_server_labels else (),
                batcher_args=("--traffic-policy", args.traffic_policy) if args.traffic_policy else (),
                routers=args.routers,
                otlp_endpoint=otlp_endpoint,
                trace_ratio=args.trace_ratio,
                supervise=True,
            ),
            on_event=lambda message: print(f"infermesh: {message}", file=sys.stderr, flush=True),
        )
    except MeshError as exc:
        print(f"infermesh cannot start: {exc}", file=sys.stderr)
        return 1
    try:
        mesh.start()
    except MeshError as exc:
        print(f"infermesh failed to start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("infermesh: interrupted while starting; stopped", file=sys.stderr)
        return 130
    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.append(True))
    # Where every service listens, for operators' tools (services.cache.admin, ...), and
    # how each is doing (meshctl services): written whole before "ready" is said, so
    # whoever waits for that line finds it, then again whenever a service's state changes.
    where = (
        {name: p.info.get("grpc") for name, p in mesh.processes.items() if name != "redis"}
        | ({"tls_dir": args.tls_dir} if args.tls_dir else {})  # services.cache.admin presents admin-dev's
        | {
            "redis": mesh.redis_url,
            "metrics": {name: mesh.metrics_url(name) for name in mesh.processes if name != "redis"},
            "launcher": os.getpid(),
        }
    )
    shown = mesh.status()
    write_run_file(args.run_file, where, shown)
    routers = f"{args.routers} routers on " if args.routers > 1 else "router "
    print(
        f"infermesh ready: {routers}gRPC {mesh.router}{' (mutual TLS)' if mesh.tls_dir else ''}, "
        f"metrics {mesh.router_metrics} "
        f"(Ctrl-C drains and stops)",
        flush=True,
    )
    try:
        while not stopping:  # the supervisor restarts what exits; the run file follows its view
            status = mesh.status()
            if status != shown:
                write_run_file(args.run_file, where, status)
                shown = status
            time.sleep(0.2)
    finally:
        print("infermesh: draining and stopping ...", flush=True)
        mesh.stop()
        args.run_file.unlink(missing_ok=True)
        print("infermesh: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
