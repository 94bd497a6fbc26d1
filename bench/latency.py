"""Where one request's milliseconds go: the lone caller, hop by hop.

One caller (ghz, closed loop), mlp with a distinct input on every call, in each
run's phases (shuffled per run with a recorded seed):

- bare: one bare grpc.aio server answering ModelInfer (bench/bare.py --echo);
- chain: three bare servers in series (as many Python processes as the mesh's
  path), each hop a unary call;
- mesh: the mesh, tracing off;
- mesh_traced: a second mesh whose router traces every request (ratio 1) into a
  Jaeger v2 (bin/jaeger); its traces give the breakdown.

and at 64 callers, bare and mesh (throughput, so that a lone caller's gain is
not paid for by a crowd's). From the traced phase's traces, every request's
time is cut into consecutive segments at its spans' edges, the same process
clock on one machine: the router's own work, each transit between processes
(the message through grpc.aio's stream or call, both ways), the batcher's
queue and forming, the model server's gate, the ONNX Runtime run and the
encoding. The front door (the caller's call into the router and back, which no
span covers) is the caller's p50 less the median of the router's span. The
figure: the waterfall of the request of median duration, and the medians per
segment beside one bare hop.

    .venv/bin/python -m bench.latency --runs 3 --label before

--label names the code measured; the report keeps each label's latest results
(bench/results/latency.{json,md,png}), so a change is published as before and
after, each against the bare hop of its own run.
"""

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
import urllib.request

from bench.bare import start as start_bare
from bench.fastpath import load, mesh_pids, mlp_template
from bench.report import (
    chosen_seed,
    machine,
    phase_order,
    progress,
    pyplot,
    save_figure,
    seed_argument,
    span,
    spread,
)
from bench.workload import run_ghz
from services.launcher.jaeger import Jaeger
from services.launcher.mesh import Mesh, MeshConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
CALLERS = 64
ONE_CALLER_CALLS = 1500
GOAL_RATIO = 2.0  # the mesh's lone-caller p50 at most twice one bare hop's (issue 34)
ROUTER_SERVICE = "infermesh-router"

# A request's consecutive segments: (name, where it runs, from edge, to edge); an
# edge is (span name, "start" | "end"). They tile the router's span end to end.
SEGMENTS = (
    ("router: decode, validate, cache", "router", ("router.infer", "start"), ("router.submit", "start")),
    ("router → batcher", "transit", ("router.submit", "start"), ("batcher.submit", "start")),
    ("batcher: queue, form", "batcher", ("batcher.submit", "start"), ("batcher.batch", "start")),
    ("batcher → model server", "transit", ("batcher.batch", "start"), ("model_server.execute", "start")),
    ("model server: gate", "model_server", ("model_server.execute", "start"), ("onnxruntime.run", "start")),
    ("ONNX Runtime run", "model_server", ("onnxruntime.run", "start"), ("onnxruntime.run", "end")),
    ("model server: encode", "model_server", ("onnxruntime.run", "end"), ("model_server.execute", "end")),
    ("model server → batcher", "transit", ("model_server.execute", "end"), ("batcher.batch", "end")),
    ("batcher: split, answer", "batcher", ("batcher.batch", "end"), ("batcher.submit", "end")),
    ("batcher → router", "transit", ("batcher.submit", "end"), ("router.submit", "end")),
    ("router: answer", "router", ("router.submit", "end"), ("router.infer", "end")),
)
FRONT_DOOR = "caller ↔ router (front door)"
COLOURS = {
    "router": "#4c72b0",
    "batcher": "#55a868",
    "model_server": "#c44e52",
    "transit": "#b0b0b0",
    "front": "#8172b2",
    "bare": "#dd8452",
}


def router_traces(jaeger: Jaeger, start_s: float, end_s: float, limit: int) -> list[dict[str, dict]]:
    """The traces the router started between two wall-clock times, each as
    {span name: {"start": µs, "end": µs, "service": ...}} (the first span of a
    name; a lone caller's request has one of each)."""
    query = f"service={ROUTER_SERVICE}&start={int(start_s * 1e6)}&end={int(end_s * 1e6)}&limit={limit}"
    with urllib.request.urlopen(f"{jaeger.query_url}/api/traces?{query}", timeout=120) as response:
        data = json.load(response).get("data") or []
    traces = []
    for trace in data:
        services = {key: process.get("serviceName", "") for key, process in trace.get("processes", {}).items()}
        spans: dict[str, dict] = {}
        for s in trace.get("spans", ()):
            spans.setdefault(
                s["operationName"],
                {
                    "start": s["startTime"],
                    "end": s["startTime"] + s["duration"],
                    "service": services.get(s.get("processID"), ""),
                },
            )
        traces.append(spans)
    return traces


def settled_traces(jaeger: Jaeger, start_s: float, end_s: float, expected: int, patience_s: float = 20.0):
    """router_traces once `expected` are complete, or once `patience_s` has passed
    (each service's exporter sends what it holds every 5 s, or when 512 spans wait)."""
    deadline = time.monotonic() + patience_s
    while True:
        traces = router_traces(jaeger, start_s, end_s, 2 * expected + 100)
        complete = sum(segments(t) is not None for t in traces)
        if complete >= expected or time.monotonic() > deadline:
            return traces
        time.sleep(1.0)


def segments(spans: dict[str, dict]) -> dict[str, float] | None:
    """One trace's segments in µs; None when a span the cut needs is missing
    (a request answered from the cache, or spans still in an exporter)."""
    out = {}
    for name, _, (a, a_edge), (b, b_edge) in SEGMENTS:
        if a not in spans or b not in spans:
            return None
        out[name] = spans[b][b_edge] - spans[a][a_edge]
    out["router"] = spans["router.infer"]["end"] - spans["router.infer"]["start"]
    return out


def median_trace(traces: list[dict[str, dict]]) -> dict[str, dict] | None:
    """The complete trace whose router span lasted the median time."""
    complete = [t for t in traces if segments(t) is not None]
    if not complete:
        return None
    complete.sort(key=lambda t: t["router.infer"]["end"] - t["router.infer"]["start"])
    return complete[len(complete) // 2]


def breakdown(traces: list[dict[str, dict]], caller_p50_ms: float) -> dict:
    """Medians per segment (µs) over the complete traces, the router span's median,
    and the front door: the caller's p50 less that median."""
    cut = [c for c in (segments(t) for t in traces) if c is not None]
    if not cut:
        return {"traces": len(traces), "complete": 0}
    router_us = statistics.median(c["router"] for c in cut)
    return {
        "traces": len(traces),
        "complete": len(cut),
        "segments_us": {name: statistics.median(c[name] for c in cut) for name, *_ in SEGMENTS},
        "router_span_us": router_us,
        "front_door_us": 1000 * caller_p50_ms - router_us,
    }


def one_run(
    run: int, meshes: dict[str, Mesh], bare: tuple[int, str], chain: tuple[list[int], str], jaeger, seconds, seed
):
    bare_pid, bare_address = bare
    chain_pids, chain_address = chain
    result: dict = {}
    tag = f"r{run}"

    def phase(key: str, address: str, pids: dict[str, list[int]], callers: int, traced: bool = False):
        def measure():
            data = mlp_template(f"{tag}{key}")
            started = time.time()
            if callers == 1:
                cell = load(address, data, ONE_CALLER_CALLS, 1, pids)
            else:
                cell = load(address, data, 0, callers, pids, seconds=seconds)
            ended = time.time()
            result[key] = cell
            line = f"run {run}: {key}: {cell['rps']:.0f}/s, p50 {cell['p50_ms']:.3f} ms, p99 {cell['p99_ms']:.3f} ms"
            if traced:
                traces = settled_traces(jaeger, started, ended, cell["codes"].get("OK", 0))
                cell["breakdown"] = breakdown(traces, cell["p50_ms"])
                cell["median_trace"] = median_trace(traces)
                line += f"; {cell['breakdown']['complete']} of {cell['breakdown']['traces']} traces complete"
            progress(f"{line}; {cell['codes']}")

        return key, measure

    phases = [
        phase("bare", bare_address, {"bare": [bare_pid]}, 1),
        phase("chain", chain_address, {"chain": chain_pids}, 1),
        phase("mesh", meshes["mesh"].router, mesh_pids(meshes["mesh"]), 1),
        phase("mesh_traced", meshes["mesh_traced"].router, mesh_pids(meshes["mesh_traced"]), 1, traced=True),
        phase("bare_64", bare_address, {"bare": [bare_pid]}, CALLERS),
        phase("mesh_64", meshes["mesh"].router, mesh_pids(meshes["mesh"]), CALLERS),
    ]
    order = phase_order(phases, run, seed)
    for _, measure in order:
        measure()
    return result, [key for key, _ in order]


def summarise(runs: list[dict]) -> dict:
    def ratio(a: str, b: str, key: str) -> dict:
        return spread(r[a][key] / r[b][key] for r in runs)

    summary = {
        "p50_ms": {k: spread(r[k]["p50_ms"] for r in runs) for k in ("bare", "chain", "mesh", "mesh_traced")},
        "p99_ms": {k: spread(r[k]["p99_ms"] for r in runs) for k in ("bare", "chain", "mesh", "mesh_traced")},
        "mesh_over_bare": ratio("mesh", "bare", "p50_ms"),
        "chain_over_bare": ratio("chain", "bare", "p50_ms"),
        "traced_over_mesh": ratio("mesh_traced", "mesh", "p50_ms"),
        "rps_64": {k: spread(r[k]["rps"] for r in runs) for k in ("bare_64", "mesh_64")},
        "throughput_64_over_bare": ratio("mesh_64", "bare_64", "rps"),
        "segments_us": {
            name: spread(r["mesh_traced"]["breakdown"].get("segments_us", {}).get(name) for r in runs)
            for name, *_ in SEGMENTS
        },
        "front_door_us": spread(r["mesh_traced"]["breakdown"].get("front_door_us") for r in runs),
        "router_span_us": spread(r["mesh_traced"]["breakdown"].get("router_span_us") for r in runs),
        "bare_p50_us": spread(1000 * r["bare"]["p50_ms"] for r in runs),
    }
    summary["cpu_us_1"] = {
        key: {group: spread(r[key]["cpu_us"].get(group) for r in runs) for group in runs[0][key]["cpu_us"]}
        for key in ("bare", "chain", "mesh", "mesh_traced")
    }
    summary["goal_met"] = all(v <= GOAL_RATIO for v in summary["mesh_over_bare"]["runs"])
    return summary


def markdown_one(label: str, report: dict) -> list[str]:
    s = report["summary"]
    p50, p99 = s["p50_ms"], s["p99_ms"]
    lines = [
        f"### {label}",
        "",
        f"Commit {report['commit']}. Machine: {report['machine']}. Command: `{report['command']}`. Medians of "
        f"{report['runs']} runs on {report['date']} (min–max over runs in brackets); phases in an order shuffled "
        f"with seed {report['seed']}; ratios taken within each run.",
        "",
        f"| path, one caller ({ONE_CALLER_CALLS} calls) | p50 ms | p99 ms |",
        "|---|---|---|",
    ]
    names = {
        "bare": "one bare grpc.aio hop",
        "chain": "three bare servers in series",
        "mesh": "mesh",
        "mesh_traced": "mesh, every request traced",
    }
    for key, name in names.items():
        lines.append(f"| {name} | {span(p50[key], '{:.3f}')} | {span(p99[key], '{:.3f}')} |")
    lines += [
        "",
        f"- Mesh p50 over one bare hop: **×{span(s['mesh_over_bare'])}** (goal ≤ ×{GOAL_RATIO:g}: "
        f"{'met' if s['goal_met'] else 'not met'}); three bare servers in series: ×{span(s['chain_over_bare'])}.",
        "- CPU per request at one caller (µs, from /proc): one bare server "
        f"{span(s['cpu_us_1']['bare']['bare'], '{:.0f}')}; three in series "
        f"{span(s['cpu_us_1']['chain']['chain'], '{:.0f}')} together; the mesh: "
        + ", ".join(
            f"{group} {span(s['cpu_us_1']['mesh'][group], '{:.0f}')}" for group in ("router", "batcher", "model_server")
        )
        + ".",
        f"- Tracing every request costs the lone caller ×{span(s['traced_over_mesh'])} of the untraced p50.",
        f"- At {CALLERS} callers the mesh serves {span(s['rps_64']['mesh_64'], '{:.0f}')} requests/s, "
        f"×{span(s['throughput_64_over_bare'])} of the bare server's {span(s['rps_64']['bare_64'], '{:.0f}')}.",
        "",
        "| segment of the traced request (medians over its traces) | µs |",
        "|---|---|",
        f"| {FRONT_DOOR}: caller's p50 less the router's span | {span(s['front_door_us'], '{:.0f}')} |",
    ]
    for name, *_ in SEGMENTS:
        lines.append(f"| {name} | {span(s['segments_us'][name], '{:.0f}')} |")
    lines += [
        f"| (the router's span) | {span(s['router_span_us'], '{:.0f}')} |",
        f"| (one bare hop, whole, for scale) | {span(s['bare_p50_us'], '{:.0f}')} |",
        "",
    ]
    return lines


def markdown(reports: dict[str, dict]) -> str:
    lines = []
    for label, report in reports.items():
        lines += markdown_one(label, report)
    return "\n".join(lines)


def plot(reports: dict[str, dict], path: pathlib.Path) -> None:
    """Per label: the waterfall of the median traced request (of the last run)
    and the medians per segment beside one bare hop."""
    plt = pyplot()
    fig, axes = plt.subplots(len(reports), 2, figsize=(13, 4.6 * len(reports)), squeeze=False)
    for (label, report), (waterfall, bars) in zip(reports.items(), axes, strict=True):
        trace = report["raw"][-1]["mesh_traced"]["median_trace"]
        if trace is not None:
            origin = trace["router.infer"]["start"]
            cut = segments(trace) or {}
            position = 0.0
            names = [name for name, *_ in SEGMENTS]
            for row, (name, where, *_edges) in enumerate(SEGMENTS):
                width = cut.get(name, 0.0)
                waterfall.barh(row, width / 1000, left=position / 1000, color=COLOURS[where])
                waterfall.text((position + width) / 1000, row, f" {width:.0f} µs", va="center", fontsize=7)
                position += width
            waterfall.set_yticks(range(len(names)), names, fontsize=7)
            waterfall.invert_yaxis()
            total = (trace["router.infer"]["end"] - origin) / 1000
            waterfall.set(
                xlabel="ms from the router's first byte",
                title=f"{label}: the median traced request ({total:.2f} ms in the router)",
            )
        s = report["summary"]
        front = s["front_door_us"]["median"] or 0.0
        stacks = [(FRONT_DOOR, "front", front)] + [
            (name, where, s["segments_us"][name]["median"] or 0.0) for name, where, *_ in SEGMENTS
        ]
        left = 0.0
        for _name, where, value in stacks:
            bars.barh(3, value / 1000, left=left / 1000, color=COLOURS[where], edgecolor="white")
            left += value
        bars.barh(0, s["bare_p50_us"]["median"] / 1000, color=COLOURS["bare"])
        bars.barh(1, s["p50_ms"]["chain"]["median"], color=COLOURS["bare"], alpha=0.5)
        bars.barh(2, s["p50_ms"]["mesh"]["median"], color=COLOURS["router"], alpha=0.35)
        bars.axvline(GOAL_RATIO * s["bare_p50_us"]["median"] / 1000, color="#c44e52", linestyle="--", linewidth=1)
        bars.set_yticks(
            [0, 1, 2, 3],
            [
                "one bare hop (p50)",
                "three bare servers\nin series (p50)",
                "mesh untraced (p50)",
                "mesh traced:\nsegments",
            ],
            fontsize=8,
        )
        handles = [
            plt.Rectangle((0, 0), 1, 1, color=COLOURS[k])
            for k in ("front", "router", "transit", "batcher", "model_server")
        ]
        bars.legend(
            handles,
            ["front door", "router", "between processes", "batcher", "model server"],
            fontsize=7,
            loc="lower right",
        )
        bars.set(
            xlabel=f"ms, medians over the runs (dashed: the goal, ×{GOAL_RATIO:g} one bare hop)",
            title=f"{label}: one caller, per hop",
        )
    save_figure(fig, path, next(iter(reports.values())), "mlp, one caller")


def commit() -> str:
    import subprocess

    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "services"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() + (" (services changed since)" if dirty.stdout.strip() else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each 64-caller phase")
    parser.add_argument("--label", default="after", help="names the code measured (e.g. before, after)")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from latency.json, run nothing")
    seed_argument(parser)
    args = parser.parse_args()
    path = args.out / "latency.json"
    if args.report_only:
        reports = json.loads(path.read_text())
        for report in reports.values():
            report["summary"] = summarise(report["raw"])
        return publish(reports, args.out)
    seed = chosen_seed(args.seed)
    models = ROOT / "build" / "models"
    logs = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-latency-"))
    bare, bare_address = start_bare(ROOT, echo=True)
    chain = [start_bare(ROOT, echo=True)]
    for _ in range(2):
        chain.insert(0, start_bare(ROOT, forward=chain[0][1]))
    try:
        with Jaeger(ROOT) as jaeger:
            traced = MeshConfig(
                models=models, log_dir=logs / "traced", otlp_endpoint=jaeger.otlp_grpc_endpoint, trace_ratio=1.0
            )
            with Mesh(MeshConfig(models=models, log_dir=logs / "mesh")) as mesh, Mesh(traced) as mesh_traced:
                meshes = {"mesh": mesh, "mesh_traced": mesh_traced}
                progress(
                    f"{machine()}; seed {seed}; meshes up (logs in {logs}); warming up past the cache's bypass window"
                )
                for target in meshes.values():
                    run_ghz(target.router, mlp_template("warm"), 3000, CALLERS, timeout_s=30)
                for address in (bare_address, chain[0][1]):
                    run_ghz(address, mlp_template("warm"), 2000, CALLERS, timeout_s=30)
                chained = ([process.pid for process, _ in chain], chain[0][1])
                runs, orders = [], []
                for run in range(1, args.runs + 1):
                    result, order = one_run(run, meshes, (bare.pid, bare_address), chained, jaeger, args.seconds, seed)
                    runs.append(result)
                    orders.append(order)
    finally:
        for process in [bare, *(process for process, _ in chain)]:
            process.kill()
            process.wait()
    report = {
        "machine": machine(),
        "command": "python -m bench.latency " + " ".join(sys.argv[1:]),
        "commit": commit(),
        "runs": len(runs),
        "seed": seed,
        "orders": orders,
        "date": time.strftime("%Y-%m-%d"),
        "summary": summarise(runs),
        "raw": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    reports = json.loads(path.read_text()) if path.exists() else {}
    reports[args.label] = report
    return publish(reports, args.out)


def publish(reports: dict[str, dict], out: pathlib.Path) -> int:
    (out / "latency.json").write_text(json.dumps(reports, indent=1))
    text = "## The lone caller, hop by hop\n\n" + markdown(reports)
    (out / "latency.md").write_text(text)
    plot(reports, out / "latency.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
