"""The mesh beside two peer servers, PyTriton and Ray Serve, on the same
workload in one run, each peer in the mesh's own model layout and in the other.

The three servers, all up for the whole run on this one machine, all on
ONNX Runtime (CPU) with the same graph files from build/models:

- the infermesh mesh (services.launcher.mesh.Mesh: router, cache, batcher,
  model server, redis-server), its batcher set to the peers' batching (max
  batch 32 rows, 2 ms queue delay; its own default delay is 5 ms);
- PyTriton (bench/peers/pytriton_server.py): Triton Inference Server's gRPC
  front end and dynamic batcher (max batch 32, 2 ms); the model is a Python
  callable in PyTriton's process, which Triton's Python-backend stub reaches
  over ZeroMQ and shared memory, so every batch crosses two process boundaries;
- Ray Serve (bench/peers/ray_server.py): its gRPC proxy and replicas batching
  with @serve.batch (max batch 32, 2 ms, one batch at a time per replica). Ray
  binds every interface, so it runs in a network namespace of its own that has
  only loopback, made for the run and deleted after it, and the ghz that drives
  it runs in the same namespace.

Layouts. The mesh runs minilm on one one-thread ONNX Runtime session per core
("split": minilm's two instances, the VIP one lent to standard batches once no
VIP batch came for 10 s, as here none does) and mlp on one session with a
thread per core ("shared"). Each peer serves each model in both layouts at
once, under two names (PyTriton: two models; Ray: two applications), and
every layout is measured: the peer in the mesh's layout is the equal-terms
comparison, and the better of its two layouts is the peer at its best.

The workload, the same for all: ghz at 64 callers (closed loop, over 4
connections, 30 s deadline) sends ModelInfer to `mlp` (INPUT0 FP32 [1, 64],
256 distinct bytes on every call) and to `minilm` (one short text, distinct on
every call, EMBEDDING FP32 [1, 384] back), for --seconds per phase. Each run
has every phase (model × server × layout) once, in an order shuffled by --seed
(recorded in the report). The report gives medians over runs of requests/s,
p50, p99 and the CPU each server's processes spent per request (from /proc:
every process in the server's tree), errors summed over runs, and each
peer's requests/s over the mesh's, a ratio taken within each run, with its
spread (min–max). Before the runs every server is warmed up (the mesh past
its cache's automatic bypass) and asked for the same mlp input and the same
text in every layout: their answers must agree with the mesh's.

    make peers                                  # once: .venv-peers/{pytriton,ray}
    .venv/bin/python -m bench.peers --runs 3    # or: make bench-peers

As root (for the namespace). `--runs 1 --seconds 3 --warmup-seconds 2` is a
short look. Writes bench/results/peers.{json,md,png}. Caveats:

- What differs in the calls: Triton's batching puts a batch dimension in front
  of each sample's shape and a sample may not be empty, so minilm's TEXT goes
  to it as [1, 1] (to the mesh and Ray as [1]); Ray's proxy routes a call by
  its `application` metadata, which ghz sends to it alone. All answer
  [1, 384].
- The mesh's model server runs at nice 5, the peers at nice 0; every
  session's threads do not spin.
- On a 2-core machine ghz takes a large share of the CPU (its own CPU per
  request is in the report), the same for every server; the servers not
  being measured stay resident and idle, and what they spend meanwhile (Ray's
  control plane most) is reported as "idle peers' cores".
- The mesh does more per call than the peers (priority queues, admission,
  a cache lookup until its bypass engages, metrics): this compares serving
  stacks as deployed, not the same code path.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.fastpath import ghz_cpu_s, mlp_template
from bench.report import (
    chosen_seed,
    cpu_times,
    machine,
    phase_order,
    process_cpu_s,
    progress,
    pyplot,
    save_figure,
    seed_argument,
    span,
    spread,
    steal_share,
    write,
)
from bench.workload import GHZ, ghz_unique_template
from services.launcher.mesh import Mesh, MeshConfig, MeshError, Process
from services.launcher.ports import free_ports

ROOT = pathlib.Path(__file__).resolve().parent.parent
PEERS = ROOT / "bench" / "peers"
VENVS = ROOT / ".venv-peers"
PROTO = ROOT / "protos" / "inference" / "grpc_predict_v2.proto"
CALLERS = 64
MODELS = ("mlp", "minilm")
SERVERS = ("mesh", "pytriton", "ray")
LABELS = {"mesh": "infermesh mesh", "pytriton": "PyTriton", "ray": "Ray Serve"}
MAX_BATCH_SIZE = 32
MAX_QUEUE_DELAY_MS = 2.0
CHECK_TEXT = "Hello, my parcel was sent to the wrong address, can you help me?"
LAYOUTS = ("shared", "split")  # one session with a thread per core; one one-thread session per core
MESH_LAYOUT = {"mlp": "shared", "minilm": "split"}  # build/models' configs
LAYOUT_LABELS = {"shared": "1 session × {cores} threads", "split": "{cores} sessions × 1 thread"}
MLP_MAX_ABS = 1e-4  # the mesh's own golden probe for mlp
MINILM_MIN_COSINE = 0.999


@dataclasses.dataclass(frozen=True)
class Server:
    """One server under test: where ghz reaches it and which processes are its."""

    name: str
    address: str
    roots: tuple[int, ...]  # each root's whole process tree counts as the server's
    netns: str | None = None  # the network namespace it is reachable in, if not this one
    text_shape: tuple[int, ...] = (1,)  # minilm's TEXT of one text
    routed_by_application: bool = False  # Ray's proxy: {"application": name} metadata
    layouts: tuple[str, ...] = ("",)  # "": the mesh, its own layout; peers serve each of LAYOUTS

    def prefix(self) -> list[str]:
        """What runs a command where this server is reachable."""
        return ["ip", "netns", "exec", self.netns] if self.netns else []

    def target(self, model: str, layout: str) -> str:
        """The name that reaches `model` in `layout`: a model name (PyTriton), an application (Ray)."""
        return f"{model}_{layout}" if layout else model

    def model_name(self, model: str, layout: str) -> str:
        return model if self.routed_by_application else self.target(model, layout)

    def metadata(self, model: str, layout: str) -> list[tuple[str, str]]:
        return [("application", self.target(model, layout))] if self.routed_by_application else []

    def body(self, model: str, layout: str, tag: str) -> str:
        """ghz's -d template for `model`, distinct on every call."""
        name = self.model_name(model, layout)
        if model == "mlp":
            return mlp_template(tag, name)
        body = json.loads(ghz_unique_template(tag, name))
        body["inputs"][0]["shape"] = list(self.text_shape)
        return json.dumps(body)


def cell_key(server: str, layout: str) -> str:
    """A report cell: "mesh", or "<peer>/<layout>"."""
    return f"{server}/{layout}" if layout else server


# -- processes ------------------------------------------------------------------


def process_table() -> dict[int, tuple[int, int]]:
    """{pid: (parent pid, start time in ticks)} of every process now."""
    table = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        table[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return table


def tree(roots: tuple[int, ...]) -> dict[int, int]:
    """{pid: start time} of `roots` and all their descendants now."""
    table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = {}, [pid for pid in roots if pid in table]
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][1]
        todo += children.get(pid, [])
    return found


def tree_cpu_s(roots: tuple[int, ...]) -> dict[tuple[int, int], float]:
    """CPU seconds so far of every process in the trees, keyed by (pid, start time)."""
    spent = {}
    for pid, start in tree(roots).items():
        with contextlib.suppress(OSError):
            spent[(pid, start)] = process_cpu_s(pid)
    return spent


def spent_between(before: dict, after: dict) -> float:
    """CPU seconds between two tree_cpu_s(); a process born meanwhile counts from 0
    (one that ended meanwhile is lost, which the long-lived servers make rare)."""
    return sum(cpu - before.get(key, 0.0) for key, cpu in after.items())


def stop_tree(process: Process, grace_s: float) -> None:
    """SIGTERM, then after `grace_s` SIGKILL, to the server; then SIGKILL to any
    process of its tree (as it was before the stop) still left."""
    left = tree((process.popen.pid,))
    process.stop(grace_s)
    for pid, start in left.items():
        if process_table().get(pid, (0, None))[1] == start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def network_namespace(name: str):
    """A network namespace with only loopback, up; on leaving, every process
    still in it is killed and the namespace deleted."""
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        deadline = time.monotonic() + 10
        while pids := subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
            if time.monotonic() > deadline:
                progress(f"processes {pids} are still in network namespace {name}")
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.2)
        subprocess.run(["ip", "netns", "del", name], check=False)


def peer_env(work: pathlib.Path, **extra: str) -> dict[str, str]:
    """The environment of a peer server: no project venv on its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    return {**env, "PYTHONUNBUFFERED": "1", "TMPDIR": str(work), **extra}


def venv_python(name: str) -> str:
    python = VENVS / name / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing: run 'make peers' first")
    return str(python)


def start_pytriton(work: pathlib.Path, logs: pathlib.Path, delay_ms: float) -> Process:
    grpc_port, http_port, metrics_port = free_ports(3)
    tmp = work / "pytriton-tmp"
    tmp.mkdir()
    argv = [
        venv_python("pytriton"),
        str(PEERS / "pytriton_server.py"),
        "--models",
        str(ROOT / "build" / "models"),
        "--grpc-port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--metrics-port",
        str(metrics_port),
        "--max-batch-size",
        str(MAX_BATCH_SIZE),
        "--max-queue-delay-ms",
        str(delay_ms),
    ]
    return Process("pytriton", argv, logs, peer_env(tmp))


def start_ray(work: pathlib.Path, logs: pathlib.Path, netns: str, delay_ms: float) -> Process:
    temp = work / "ray"
    temp.mkdir()
    # A token of this run's own: Ray would otherwise make one and keep it in ~/.ray.
    env = peer_env(
        temp, PYTHONPATH=str(ROOT / "gen"), RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_TOKEN=secrets.token_hex(32)
    )
    argv = [
        "ip",
        "netns",
        "exec",
        netns,
        venv_python("ray"),
        str(PEERS / "ray_server.py"),
        "--models",
        str(ROOT / "build" / "models"),
        "--grpc-port",
        "9000",
        "--http-port",
        "8000",
        "--temp-dir",
        str(temp),
        "--max-batch-size",
        str(MAX_BATCH_SIZE),
        "--max-queue-delay-ms",
        str(delay_ms),
    ]
    return Process("ray", argv, logs, env)


def package_version(venv: str, package: str) -> str:
    return subprocess.run(
        [venv_python(venv), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


# -- load -----------------------------------------------------------------------


def ghz(server: Server, model: str, layout: str, tag: str, seconds: float) -> dict:
    """ghz's JSON report of `seconds` of ModelInfer calls from CALLERS callers.
    bench.workload.run_ghz cannot run in a namespace, name a .proto (Triton and
    Ray's proxy have no reflection here) or send Ray's routing metadata."""
    argv = [
        *server.prefix(),
        str(GHZ),
        "--insecure",
        "--proto",
        str(PROTO),
        "--import-paths",
        str(PROTO.parent.parent),
        "--call",
        "inference.GRPCInferenceService.ModelInfer",
        "-d",
        server.body(model, layout, tag),
        "--duration",
        f"{seconds:g}s",
        "--duration-stop",
        "ignore",
        "--concurrency",
        str(CALLERS),
        "--connections",
        str(min(CALLERS, 4)),
        "--timeout",
        "30s",
        "--format",
        "json",
    ]
    if server.routed_by_application:
        argv += ["-m", json.dumps(dict(server.metadata(model, layout)))]
    return json.loads(
        subprocess.run(
            [*argv, server.address], capture_output=True, text=True, check=True, timeout=seconds + 120
        ).stdout
    )


def phase(server: Server, model: str, layout: str, tag: str, seconds: float, servers: list[Server]) -> dict:
    """One ghz phase against `server`, with the CPU every server's processes spent."""
    before = {s.name: tree_cpu_s(s.roots) for s in servers}
    ghz_before, machine_before = ghz_cpu_s(), cpu_times()
    report = ghz(server, model, layout, tag, seconds)
    ghz_after, machine_after = ghz_cpu_s(), cpu_times()
    after = {s.name: tree_cpu_s(s.roots) for s in servers}
    spent = {name: spent_between(before[name], after[name]) for name in before}
    calls, wall_s = report["count"], report["total"] / 1e9
    latency = {p["percentage"]: p["latency"] / 1e6 for p in report.get("latencyDistribution") or ()}
    codes = report["statusCodeDistribution"]
    return {
        "rps": report["rps"],
        "calls": calls,
        "errors": calls - codes.get("OK", 0),
        "codes": codes,
        "error_samples": list(report.get("errorDistribution") or {})[:3],
        "p50_ms": latency.get(50),
        "p99_ms": latency.get(99),
        "cpu_us": 1e6 * spent[server.name] / max(calls, 1),
        "ghz_cpu_us": 1e6 * (ghz_after - ghz_before) / max(calls, 1),
        "idle_peers_cores": sum(v for name, v in spent.items() if name != server.name) / wall_s,
        "steal": steal_share(machine_before, machine_after),
    }


# -- the answers check --------------------------------------------------------------


def answers(server: Server) -> dict[str, dict[str, list[float]]]:
    """One server's answers, in each of its layouts, to one mlp input and one text (the check's calls)."""
    import grpc
    from inference import grpc_predict_v2_pb2 as pb
    from inference import grpc_predict_v2_pb2_grpc as pb_grpc

    def output(response) -> list[float]:
        if response.raw_output_contents:
            return np.frombuffer(response.raw_output_contents[0], dtype="<f4").tolist()
        return list(response.outputs[0].contents.fp32_contents)

    found = {}
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for layout in server.layouts:
            mlp = pb.ModelInferRequest(model_name=server.model_name("mlp", layout))
            mlp.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 64])
            mlp.raw_input_contents.append(np.linspace(-1, 1, 64, dtype="<f4").tobytes())
            minilm = pb.ModelInferRequest(model_name=server.model_name("minilm", layout))
            minilm.inputs.add(
                name="TEXT", datatype="BYTES", shape=list(server.text_shape)
            ).contents.bytes_contents.append(CHECK_TEXT.encode())
            found[cell_key(server.name, layout)] = {
                model: output(stub.ModelInfer(request, timeout=30, metadata=server.metadata(model, layout) or None))
                for model, request in (("mlp", mlp), ("minilm", minilm))
            }
    return found


def check_answers(servers: list[Server]) -> dict:
    """Every server's answers, in every layout, beside the mesh's: mlp's largest
    difference and minilm's cosine. Raises unless they agree (the same graph must answer)."""
    found = {}
    for server in servers:
        if server.netns:  # reached from inside its namespace, by this module run there
            argv = [
                *server.prefix(),
                sys.executable,
                "-m",
                "bench.peers",
                "--answers",
                json.dumps(dataclasses.asdict(server)),
            ]
            found.update(
                json.loads(
                    subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True, timeout=120).stdout
                )
            )
        else:
            found.update(answers(server))
    mesh = {model: np.array(values) for model, values in found.pop("mesh").items()}
    agreement = {}
    for name, got in found.items():
        mlp, minilm = np.array(got["mlp"]), np.array(got["minilm"])
        if mlp.shape != mesh["mlp"].shape or minilm.shape != mesh["minilm"].shape:
            raise RuntimeError(
                f"{name} answered shapes {mlp.shape} and {minilm.shape}, the mesh "
                f"{mesh['mlp'].shape} and {mesh['minilm'].shape}"
            )
        max_abs = float(np.max(np.abs(mlp - mesh["mlp"])))
        cosine = float(minilm @ mesh["minilm"] / (np.linalg.norm(minilm) * np.linalg.norm(mesh["minilm"])))
        agreement[name] = {"mlp_max_abs": max_abs, "minilm_cosine": cosine}
        if max_abs > MLP_MAX_ABS or cosine < MINILM_MIN_COSINE:
            raise RuntimeError(
                f"{name}'s answers differ from the mesh's: mlp by up to {max_abs:.2e} "
                f"(at most {MLP_MAX_ABS:g}), minilm cosine {cosine:.6f} (at least {MINILM_MIN_COSINE})"
            )
    return agreement


# -- the run --------------------------------------------------------------------


def phases(servers: list[Server]) -> list[tuple[str, Server, str]]:
    """Every (model, server, layout) measured in a run."""
    return [(model, server, layout) for model in MODELS for server in servers for layout in server.layouts]


def one_run(run: int, servers: list[Server], seconds: float, seed: int) -> tuple[dict, list[str]]:
    """One run's cells, and the order they were measured in."""
    result: dict = {model: {} for model in MODELS}
    order = phase_order(phases(servers), run, seed)
    for model, server, layout in order:
        key = cell_key(server.name, layout)
        cell = result[model][key] = phase(server, model, layout, f"r{run}{key}", seconds, servers)
        progress(
            f"run {run + 1}: {model} via {key}: {cell['rps']:.0f}/s, p50 {cell['p50_ms'] or 0:.2f} ms, "
            f"p99 {cell['p99_ms'] or 0:.2f} ms, errors {cell['errors']}, CPU µs per request: server "
            f"{cell['cpu_us']:.0f}, ghz {cell['ghz_cpu_us']:.0f}; idle peers {cell['idle_peers_cores']:.2f} "
            f"cores{'; ' + '; '.join(cell['error_samples']) if cell['errors'] else ''}"
        )
    return result, [f"{model}:{cell_key(server.name, layout)}" for model, server, layout in order]


def measure(args, seed: int, work: pathlib.Path, stack: contextlib.ExitStack) -> dict:
    logs = work / "logs"
    logs.mkdir()
    netns = stack.enter_context(network_namespace(f"infermesh-peers-{os.getpid()}"))
    # The peers start while the mesh does; all three are up before any load.
    pytriton = start_pytriton(work, logs, args.max_queue_delay_ms)
    stack.callback(stop_tree, pytriton, 45)  # Triton waits for its models to unload
    ray = start_ray(work, logs, netns, args.max_queue_delay_ms)
    stack.callback(stop_tree, ray, 45)
    batching = ("--max-batch-size", str(MAX_BATCH_SIZE), "--max-queue-delay-ms", str(args.max_queue_delay_ms))
    started = time.monotonic()
    progress(f"starting the mesh, PyTriton and Ray Serve (logs in {logs})")
    mesh = stack.enter_context(
        Mesh(MeshConfig(models=ROOT / "build" / "models", log_dir=logs / "mesh", batcher_args=batching))
    )
    servers = [Server("mesh", mesh.router, tuple(p.popen.pid for p in mesh.processes.values()))]
    triton_address = pytriton.wait_ready(300)["grpc"]
    servers.append(Server("pytriton", triton_address, (pytriton.popen.pid,), text_shape=(1, 1), layouts=LAYOUTS))
    ray_address = ray.wait_ready(300)["grpc"]
    servers.append(
        Server("ray", ray_address, (ray.popen.pid,), netns=netns, routed_by_application=True, layouts=LAYOUTS)
    )
    progress(
        f"all up in {time.monotonic() - started:.0f}s: mesh {mesh.router}, PyTriton {triton_address}, "
        f"Ray Serve {ray_address} (namespace {netns}); warming up"
    )
    for model, server, layout in phases(servers):  # the mesh's mlp phase must pass its cache's bypass window
        cell = phase(server, model, layout, f"warm{server.name}{layout}", args.warmup_seconds, servers)
        progress(f"  warm-up {model} via {cell_key(server.name, layout)}: {cell['rps']:.0f}/s, errors {cell['errors']}")
    agreement = check_answers(servers)
    progress(
        "answers agree with the mesh's: "
        + "; ".join(
            f"{name} mlp |Δ| ≤ {a['mlp_max_abs']:.1e}, minilm cosine {a['minilm_cosine']:.6f}"
            for name, a in agreement.items()
        )
    )
    runs, orders = [], []
    for run in range(args.runs):
        result, order = one_run(run, servers, args.seconds, seed)
        runs.append(result)
        orders.append(order)
    return {"agreement": agreement, "runs": runs, "orders": orders}


PEER_NAMES = ("pytriton", "ray")


def cells() -> list[str]:
    """Every cell of a model's table, in the report's order."""
    return ["mesh", *(cell_key(peer, layout) for peer in PEER_NAMES for layout in LAYOUTS)]


def summarise(runs: list[dict]) -> dict:
    med = statistics.median
    summary: dict = {}
    for model in MODELS:
        summary[model] = {}
        for key in cells():
            found = [r[model][key] for r in runs]
            ratios = [c["rps"] / r[model]["mesh"]["rps"] for c, r in zip(found, runs, strict=True)]
            summary[model][key] = {
                "rps": med(c["rps"] for c in found),
                "rps_over_mesh": spread(ratios),
                "p50_ms": _median_of(c["p50_ms"] for c in found),
                "p99_ms": _median_of(c["p99_ms"] for c in found),
                "errors": sum(c["errors"] for c in found),
                "calls": sum(c["calls"] for c in found),
                "cpu_us": med(c["cpu_us"] for c in found),
                "ghz_cpu_us": med(c["ghz_cpu_us"] for c in found),
                "idle_peers_cores": med(c["idle_peers_cores"] for c in found),
            }
        for peer in PEER_NAMES:
            equal = cell_key(peer, MESH_LAYOUT[model])
            best = [
                max(r[model][cell_key(peer, layout)]["rps"] for layout in LAYOUTS) / r[model]["mesh"]["rps"]
                for r in runs
            ]
            summary[model][peer] = {
                "equal_layout": equal,
                "equal_over_mesh": summary[model][equal]["rps_over_mesh"],
                "best_over_mesh": spread(best),
                "best_layouts": [max(LAYOUTS, key=lambda lay: r[model][cell_key(peer, lay)]["rps"]) for r in runs],
            }
    steals = [c["steal"] for r in runs for by_cell in r.values() for c in by_cell.values() if c["steal"] is not None]
    summary["steal_median"] = med(steals) if steals else None
    summary["steal_max"] = max(steals) if steals else None
    return summary


def _median_of(values) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def label(key: str, model: str, cores: int) -> str:
    """A cell's row name: the server and its layout, marked where it is the mesh's."""
    if key == "mesh":
        return f"{LABELS['mesh']} ({LAYOUT_LABELS[MESH_LAYOUT[model]].format(cores=cores)})"
    peer, layout = key.split("/")
    same = " = the mesh's" if layout == MESH_LAYOUT[model] else ""
    return f"{LABELS[peer]}, {LAYOUT_LABELS[layout].format(cores=cores)}{same}"


def verdict(ratios: dict) -> str:
    """Whether a peer's throughput is above or below the mesh's in every run, or either way."""
    if ratios["min"] > 1:
        return "more than the mesh in every run"
    if ratios["max"] < 1:
        return "less than the mesh in every run"
    return "either side of the mesh across runs"


def markdown(report: dict) -> str:
    s = report["summary"]
    settings = report["settings"]
    cores = settings.get("cores", 2)
    steal = (
        ""
        if s["steal_median"] is None
        else f" The hypervisor took {s['steal_median']:.0%} of the CPU at the median phase (at most {s['steal_max']:.0%})."
    )
    lines = [
        f"Machine: {report['machine']}. Command: `{report['command']}`. Medians of {report['runs']} runs on "
        f"{report['date']}, {settings['seconds']:g} s a phase; each run's phases in an order shuffled with seed "
        f"{report['seed']}; ratios are taken within each run, their spread (min–max over runs) in brackets.{steal}",
        "",
        f"Versions: PyTriton {report['versions']['pytriton']} (with its Triton Inference Server), Ray {report['versions']['ray']}, ONNX Runtime "
        f"{report['versions']['onnxruntime']} (CPU) in every server. Batching: max {settings['max_batch_size']} "
        f"rows, {settings['max_queue_delay_ms']:g} ms queue delay in all three.",
        "",
    ]
    for model, what in (
        ("mlp", "INPUT0 FP32 [1, 64], distinct on every call"),
        ("minilm", "one short text, distinct on every call; TEXT [1] to the mesh and Ray, [1, 1] to Triton"),
    ):
        lines += [
            f"**{model}** ({what}), ghz at {CALLERS} callers (closed loop)",
            "",
            "| server, model layout | requests/s | × mesh (min–max) | p50 ms | p99 ms | errors | "
            "server CPU µs per request | ghz CPU µs per request | idle peers' cores |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for key in cells():
            cell = s[model][key]
            ratio = "1.00" if key == "mesh" else span(cell["rps_over_mesh"])
            lines.append(
                f"| {label(key, model, cores)} | {cell['rps']:.0f} | {ratio} | {_ms(cell['p50_ms'])} | "
                f"{_ms(cell['p99_ms'])} | {cell['errors']} of {cell['calls']} | {cell['cpu_us']:.0f} | "
                f"{cell['ghz_cpu_us']:.0f} | {cell['idle_peers_cores']:.2f} |"
            )
        lines.append("")
        for peer in PEER_NAMES:
            p = s[model][peer]
            lines.append(
                f"- {LABELS[peer]} on equal terms (the mesh's layout): × {span(p['equal_over_mesh'])}, "
                f"{verdict(p['equal_over_mesh'])}; at its best layout in each run "
                f"({', '.join(p['best_layouts'])}): × {span(p['best_over_mesh'])}, {verdict(p['best_over_mesh'])}."
            )
        lines.append("")
    agreement = report["agreement"]
    lines += [
        "- Every server, in every layout, answered the same mlp input and text as the mesh before the runs: "
        + "; ".join(
            f"{name} mlp within {a['mlp_max_abs']:.1e}, minilm cosine {a['minilm_cosine']:.6f}"
            for name, a in agreement.items()
        )
        + ".",
        "- Server CPU is every process of the server's tree (mesh: router, cache, batcher, model server, "
        "redis-server; PyTriton: its Python process, tritonserver and the Python-backend stubs; Ray: the "
        "driver, GCS, raylet, agents, controller, proxy and replicas), from /proc. Idle peers' cores: what "
        "the servers not under load spent meanwhile, in cores.",
        "- The mesh's minilm runs on two one-thread ONNX Runtime sessions (one kept for VIP batches, lent "
        "after 10 s without, as here) at nice 5, behind priority queues, admission control and a cache whose "
        "bypass engages on distinct inputs; its mlp on one session with a thread per core. Each peer serves both "
        "layouts of each model side by side (PyTriton as two models, Ray as two applications). PyTriton's "
        "callables run in its own Python process, reached from Triton's Python-backend stub over ZeroMQ and "
        "shared memory; Ray runs in a network namespace of its own (loopback only), ghz beside it, its "
        "proxy routing by `application` metadata.",
        "",
    ]
    return "\n".join(lines)


COLOURS = {"mesh": "#4c72b0", "pytriton": "#76b900", "ray": "#e4a33a"}


def plot(report: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    s = report["summary"]
    keys = cells()
    fig, panels = plt.subplots(1, 3, figsize=(14, 4.2))
    width = 0.8 / len(keys)
    x = np.arange(len(MODELS))
    for i, key in enumerate(keys):
        offset = (i - (len(keys) - 1) / 2) * width
        server, _, layout = key.partition("/")
        hatch = "//" if layout == "split" else None
        for panel, field in zip(panels, ("rps", "p99_ms", "cpu_us"), strict=True):
            bars = panel.bar(
                x + offset,
                [s[m][key][field] or 0 for m in MODELS],
                width,
                color=COLOURS[server],
                hatch=hatch,
                edgecolor="white",
                label=key if panel is panels[0] else None,
            )
            panel.bar_label(bars, fmt="%.0f", fontsize=6)
        if "rps_over_mesh" in s[MODELS[0]][key] and key != "mesh":  # the spread of the ratio, as a range on the bar
            for j, model in enumerate(MODELS):
                r = s[model][key]["rps_over_mesh"]
                mesh_rps = s[model]["mesh"]["rps"]
                panels[0].vlines(x[j] + offset, r["min"] * mesh_rps, r["max"] * mesh_rps, color="black", linewidth=1)
        panels[1].scatter(
            x + offset,
            [s[m][key]["p50_ms"] or 0 for m in MODELS],
            color="black",
            marker="_",
            s=80,
            zorder=3,
            label="p50" if i == len(keys) - 1 else None,
        )
    for panel, (ylabel, title) in zip(
        panels,
        (
            ("requests / s", f"throughput at {CALLERS} callers (runs' range)"),
            ("ms", "p99 (bars) and p50 (marks)"),
            ("CPU µs per request", "server CPU per request"),
        ),
        strict=True,
    ):
        panel.set_xticks(x, MODELS)
        panel.set(ylabel=ylabel, title=title, yscale="log")
    panels[0].legend(fontsize=7, title="hatched: one one-thread session per core", title_fontsize=6)
    panels[1].legend(fontsize=7)
    save_figure(fig, path, report, "the mesh beside PyTriton and Ray Serve, each in both model layouts")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each measured phase")
    parser.add_argument("--warmup-seconds", type=float, default=4.0, help="length of each warm-up phase")
    parser.add_argument(
        "--max-queue-delay-ms", type=float, default=MAX_QUEUE_DELAY_MS, help="every server's batching delay"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the servers' logs (and Ray's session files)")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    seed_argument(parser)
    # How the answers check reaches Ray inside its namespace: this module, run there.
    parser.add_argument("--answers", metavar="SERVER", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.answers:
        fields = json.loads(args.answers)
        fields.update(
            roots=tuple(fields["roots"]), text_shape=tuple(fields["text_shape"]), layouts=tuple(fields["layouts"])
        )
        print(json.dumps(answers(Server(**fields))))
        return 0
    # Stopped by SIGTERM as by Ctrl-C: the servers stop, the namespace and temporary files go.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if os.geteuid() != 0:
        raise SystemExit("bench.peers makes a network namespace for Ray Serve: run it as root")
    seed = chosen_seed(args.seed)
    versions = {
        "pytriton": package_version("pytriton", "nvidia-pytriton"),
        "ray": package_version("ray", "ray"),
        "onnxruntime": package_version("ray", "onnxruntime"),
    }
    work = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-peers-"))
    started = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            measured = measure(args, seed, work, stack)
            progress("stopping the servers")
    except KeyboardInterrupt:
        progress("interrupted: every server stopped, the namespace deleted")
        return 130
    except (MeshError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None)
        raise SystemExit(
            f"bench.peers failed: {exc}{chr(10) + detail[-2000:] if detail else ''}"
            f"{chr(10) + 'logs kept in ' + str(work / 'logs') if args.keep_logs else ''}"
        ) from None
    finally:
        if not args.keep_logs:
            shutil.rmtree(work, ignore_errors=True)
    progress(f"done in {time.monotonic() - started:.0f}s")
    report = {
        "machine": machine(),
        "command": "python -m bench.peers " + " ".join(sys.argv[1:]),
        "runs": args.runs,
        "seed": seed,
        "orders": measured["orders"],
        "date": time.strftime("%Y-%m-%d"),
        "versions": versions,
        "settings": {
            "seconds": args.seconds,
            "warmup_seconds": args.warmup_seconds,
            "callers": CALLERS,
            "max_batch_size": MAX_BATCH_SIZE,
            "max_queue_delay_ms": args.max_queue_delay_ms,
            "cores": len(os.sched_getaffinity(0)),
            "mesh_layout": MESH_LAYOUT,
            "mesh_defaults": "batcher max batch 32, 5 ms delay; minilm 2 instances of 1 thread "
            "(1 reserved for VIP); model server at nice 5",
        },
        "agreement": measured["agreement"],
        "summary": summarise(measured["runs"]),
        "raw": measured["runs"],
    }
    write(args.out, "peers", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
