"""make run: the whole mesh in the foreground until Ctrl-C or SIGTERM."""

import argparse
import json
import os
import pathlib
import signal
import sys
import time

from services.launcher.mesh import Mesh, MeshError
from services.meshctl import tenants



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="build/models", help="model repository")
    parser.add_argument("--host", default=os.environ.get("INFERMESH_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("INFERMESH_PORT", 8001)), help="router gRPC port")
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("INFERMESH_METRICS_PORT", 8002)),
                        help="the first router's metrics port; the others take the next ones")
    parser.add_argument("--routers", type=int, default=int(os.environ.get("INFERMESH_ROUTERS", 1)),
                        help="router processes sharing the gRPC port (SO_REUSEPORT), for more than one core's worth")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"), help="use this Redis instead of starting one")
    parser.add_argument("--l2-path", default=os.environ.get("INFERMESH_L2_PATH", "var/cache"),
                        help="the cache's on-disk L2 folder; it survives restarts ('' disables L2)")
    parser.add_argument("--run-file", type=pathlib.Path, default=pathlib.Path("var/run/mesh.json"),
                        help="where to write every service's address while the mesh runs")
    parser.add_argument("--log-dir", default=os.environ.get("INFERMESH_LOG_DIR"), help="write each service's log here")
    parser.add_argument("--traffic-policy", default="mesh/istio/model-server-traffic.yaml",
                        help="the VirtualService/DestinationRule the batcher applies ('' for none)")
    parser.add_argument("--model-server-labels", default="version=blue,pool=vip",
                        help="labels of the model server, as a DestinationRule subset selects them (one local "
                             "server is in both the blue subset and the VIP pool)")
    parser.add_argument("--tenants-file", type=pathlib.Path,
                        default=pathlib.Path(os.environ.get("INFERMESH_TENANTS_FILE", "var/tenants.yaml")),
                        help="the router's tenant registry; made with development tenants (keys printed once) if "
                             "missing (python -m services.meshctl tenants)")
    args = parser.parse_args()
    if args.routers < 1:
        parser.error(f"--routers must be at least 1, got {args.routers}")

    def interrupt(*_):
        raise KeyboardInterrupt

    # While starting, a signal interrupts the start (which stops what it began);
    # once running, it asks the loop below to drain and stop.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    if not args.tenants_file.exists():
        tenants.parse_and_run(["--registry", str(args.tenants_file), "init"])
    mesh = Mesh(models=args.models, tenants_file=args.tenants_file, host=args.host, router_port=args.port,
                metrics_port=args.metrics_port,
                redis_url=args.redis_url, l2_path=args.l2_path, log_dir=args.log_dir,
                model_server_labels=(args.model_server_labels,) if args.model_server_labels else (),
                batcher_args=("--traffic-policy", args.traffic_policy) if args.traffic_policy else (),
                routers=args.routers)
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
    # Where every service listens, for operators' tools (services.cache.admin, ...):
    # written whole before "ready" is said, so whoever waits for that line finds it.
    args.run_file.parent.mkdir(parents=True, exist_ok=True)
    partial = args.run_file.with_name(args.run_file.name + ".tmp")
    partial.write_text(json.dumps(
        {name: p.info.get("grpc") for name, p in mesh.processes.items() if name != "redis"}
        | {"redis": mesh.redis_url,
           "metrics": {name: mesh.metrics_url(name) for name in mesh.processes if name != "redis"}},
        indent=1))
    partial.replace(args.run_file)
    routers = f"{args.routers} routers on " if args.routers > 1 else "router "
    print(f"infermesh ready: {routers}gRPC {mesh.router}, metrics {mesh.router_metrics} "
          f"(Ctrl-C drains and stops)", flush=True)
    try:
        while not stopping:
            dead = mesh.dead()
            if dead:
                print(f"infermesh: {', '.join(dead)} exited; stopping the mesh", file=sys.stderr, flush=True)
                mesh.stop()
                return 1
            time.sleep(0.2)
    finally:
        print("infermesh: draining and stopping ...", flush=True)
        mesh.stop()
        args.run_file.unlink(missing_ok=True)
        print("infermesh: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
