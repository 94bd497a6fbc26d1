"""What tracing costs the mesh, side by side in one run.

Four phases, each on a mesh of its own started once (mlp from build/models,
distinct inputs on every call, the cache as the mesh's default, as
bench/fastpath.py runs it), all beside one Jaeger v2 (bin/jaeger), idle where
nothing is sent:

- off: no OTLP endpoint (the SDK is never imported);
- sampling off: the endpoint set, trace_ratio 0: every request pays the hooks'
  checks and the router's sampling decision, and no span is made;
- ratio 0.01: one trace in a hundred sampled where it starts (the router);
- ratio 1: every request traced, every span exported to Jaeger.

In each phase, after a warm-up past the cache's bypass window: ghz at 64
callers for --seconds (throughput, CPU per request of every process), then one
caller for a fixed number of calls (p50, p99). The phases' order is shuffled
per run with a recorded seed; each phase's ratio to `off` is taken within its
run. Where spans are sent, the traces Jaeger stored for the one-caller calls are
counted once the exporters have sent what they hold (every 5 s).

    .venv/bin/python -m bench.tracing --runs 3

Writes bench/results/tracing.{json,md,png}.
"""

import argparse
import contextlib
import json
import pathlib
import statistics
import sys
import tempfile
import time
import urllib.request

from bench.fastpath import load, mesh_pids, mlp_template
from bench.report import (
    chosen_seed,
    goal_verdict,
    machine,
    phase_order,
    progress,
    pyplot,
    save_figure,
    seed_argument,
    span,
    spread,
    write,
)
from bench.workload import run_ghz
from services.launcher.jaeger import Jaeger
from services.launcher.mesh import Mesh, MeshConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
CALLERS = 64
ONE_CALLER_CALLS = 1500
WARM_UP_CALLS = 3000  # past the cache's bypass window (500 lookups), as bench/fastpath.py warms up
GOAL_RATIO = 0.98  # sampling off within 2% of tracing off, throughput at 64 callers
ROUTER_SERVICE = "infermesh-router"

# name: (an endpoint is set, trace_ratio); "off" is the baseline every ratio is taken to.
PHASES = {
    "off": (False, 0.0),
    "sampling_off": (True, 0.0),
    "ratio_0.01": (True, 0.01),
    "ratio_1": (True, 1.0),
}
LABELS = {
    "off": "(a) tracing off (no endpoint)",
    "sampling_off": "(b) endpoint set, ratio 0 (sampling off)",
    "ratio_0.01": "(c) ratio 0.01",
    "ratio_1": "(d) ratio 1.0",
}
FIGURES = ("rps", "p50_ms", "p99_ms")  # throughput at 64 callers; latency at one


def stored_spans(jaeger: Jaeger, start_s: float, end_s: float, limit: int) -> tuple[int, int]:
    """(traces, spans) that Jaeger holds of the traces the router started between
    two wall-clock times (the query API's search, at most `limit` traces)."""
    query = f"service={ROUTER_SERVICE}&start={int(start_s * 1e6)}&end={int(end_s * 1e6)}&limit={limit}"
    with urllib.request.urlopen(f"{jaeger.query_url}/api/traces?{query}", timeout=60) as response:
        traces = json.load(response).get("data") or []
    return len(traces), sum(len(trace.get("spans", ())) for trace in traces)


def one_phase(name: str, run: int, mesh: Mesh, jaeger: Jaeger, pids: dict[str, list[int]], seconds: float) -> dict:
    """Phase `name` of run `run` on its own mesh: 64 callers for `seconds`, then
    one caller for ONE_CALLER_CALLS calls, each call's input new to the cache."""
    traced, _ = PHASES[name]
    tag = f"r{run}{name}"
    many = load(mesh.router, mlp_template(f"{tag}m"), 0, CALLERS, pids, seconds=seconds)
    one_started = time.time()
    one = load(mesh.router, mlp_template(f"{tag}o"), ONE_CALLER_CALLS, 1, pids)
    one_ended = time.time()
    traces = spans = None
    if traced:
        # Each service's exporter sends what it holds every 5 s (or at 512 spans).
        time.sleep(6)
        traces, spans = stored_spans(jaeger, one_started, one_ended, 2 * ONE_CALLER_CALLS)
    cpu = sum(us for group, us in many["cpu_us"].items() if group != "jaeger")
    result = {
        "rps": many["rps"],
        "p50_ms": one["p50_ms"],
        "p99_ms": one["p99_ms"],
        "p50_ms_64": many["p50_ms"],
        "p99_ms_64": many["p99_ms"],
        "mesh_cpu_us": cpu,
        "cpu_us": many["cpu_us"],
        "codes_64": many["codes"],
        "codes_1": one["codes"],
        "steal_64": many["steal"],
        "steal_1": one["steal"],
        "one_caller_calls": sum(one["codes"].values()),
        "traces_stored": traces,
        "spans_stored": spans,
    }
    stored = "" if traces is None else f"; Jaeger holds {traces} traces, {spans} spans of the one-caller calls"
    progress(
        f"run {run}: {name}: {many['rps']:.0f}/s at {CALLERS} callers, mesh CPU {cpu:.0f} µs/request "
        f"(jaeger {many['cpu_us'].get('jaeger', 0):.0f}); one caller p50 {one['p50_ms']:.3f} ms, "
        f"p99 {one['p99_ms']:.3f} ms{stored}; {many['codes']} {one['codes']}"
    )
    return result


def summarise(runs: list[dict]) -> dict:
    """Per phase: the spread over runs of each figure and of its ratio to `off` within each run."""
    summary: dict = {}
    for name in PHASES:
        cells = [r[name] for r in runs]
        entry = {key: spread(c[key] for c in cells) for key in (*FIGURES, "mesh_cpu_us", "p99_ms_64")}
        entry["ratio"] = {
            key: spread(c[key] / r["off"][key] for c, r in zip(cells, runs, strict=True)) for key in FIGURES
        }
        entry["cpu_over_off_us"] = spread(
            c["mesh_cpu_us"] - r["off"]["mesh_cpu_us"] for c, r in zip(cells, runs, strict=True)
        )
        if cells[0]["traces_stored"] is not None:
            entry["traces_per_request"] = spread(c["traces_stored"] / c["one_caller_calls"] for c in cells)
            entry["spans_per_request"] = spread(c["spans_stored"] / c["one_caller_calls"] for c in cells)
        entry["not_ok"] = sum(
            n for c in cells for codes in (c["codes_64"], c["codes_1"]) for code, n in codes.items() if code != "OK"
        )
        summary[name] = entry
    goal_runs = summary["sampling_off"]["ratio"]["rps"]["runs"]
    summary["goal"] = {
        "what": f"sampling off serves at least {GOAL_RATIO} of tracing off's requests/s at {CALLERS} callers",
        "runs": goal_runs,
        "verdict": goal_verdict(goal_runs, lambda v: v >= GOAL_RATIO),
    }
    steals = [c[key] for r in runs for c in r.values() for key in ("steal_64", "steal_1") if c.get(key) is not None]
    summary["steal_median"] = statistics.median(steals) if steals else None
    summary["steal_max"] = max(steals) if steals else None
    return summary


def markdown(report: dict) -> str:
    s = report["summary"]
    steal = (
        ""
        if s["steal_median"] is None
        else f" The hypervisor took {s['steal_median']:.0%} of the CPU at the median measurement "
        f"(at most {s['steal_max']:.0%})."
    )
    lines = [
        f"Machine: {report['machine']}. Command: `{report['command']}`. Medians of {report['runs']} runs on "
        f"{report['date']}, min–max over runs in brackets; each run's phases in an order shuffled with seed "
        f"{report['seed']}; ratios to tracing off are taken within each run.{steal}",
        "",
        f"**mlp, distinct inputs: ghz at {CALLERS} callers for {report['seconds']:g} s, then one caller for "
        f"{ONE_CALLER_CALLS} calls; a mesh of its own per phase, one Jaeger for all**",
        "",
        f"| phase | requests/s at {CALLERS} | × off | mesh CPU µs per request | one caller p50 ms | × off "
        "| one caller p99 ms | × off |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in PHASES:
        e = s[name]
        ratio = e["ratio"]
        lines.append(
            f"| {LABELS[name]} | {span(e['rps'], '{:.0f}')} | {span(ratio['rps'])} | {span(e['mesh_cpu_us'], '{:.0f}')} "
            f"| {span(e['p50_ms'], '{:.3f}')} | {span(ratio['p50_ms'])} | {span(e['p99_ms'], '{:.3f}')} "
            f"| {span(ratio['p99_ms'])} |"
        )
    goal = s["goal"]
    lines += [
        "",
        f"- Goal: {goal['what']} (every run): **{goal['verdict']}** "
        f"(runs: {', '.join(f'{v:.3f}' for v in goal['runs'])}).",
    ]
    for name in ("sampling_off", "ratio_0.01", "ratio_1"):
        e = s[name]
        lines.append(
            f"- {LABELS[name]}: mesh CPU per request {span(e['cpu_over_off_us'], '{:+.0f}')} µs against tracing off."
        )
    for name in ("sampling_off", "ratio_0.01", "ratio_1"):
        e = s[name]
        lines.append(
            f"- {LABELS[name]}, one caller: Jaeger stored {span(e['traces_per_request'], '{:.3f}')} traces and "
            f"{span(e['spans_per_request'], '{:.2f}')} spans per request."
        )
    not_ok = {name: s[name]["not_ok"] for name in PHASES if s[name]["not_ok"]}
    lines.append(f"- Answers other than OK, all runs: {not_ok or 'none'}.")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    s = report["summary"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    names = [n for n in PHASES if n != "off"]
    short = {"sampling_off": "ratio 0\n(sampling off)", "ratio_0.01": "ratio\n0.01", "ratio_1": "ratio\n1.0"}
    titles = {"rps": f"requests/s at {CALLERS} callers", "p50_ms": "one caller p50", "p99_ms": "one caller p99"}
    for axis, key in zip(axes, FIGURES, strict=True):
        spreads = [s[n]["ratio"][key] for n in names]
        medians = [sp["median"] for sp in spreads]
        errors = [
            [m - sp["min"] for m, sp in zip(medians, spreads, strict=True)],
            [sp["max"] - m for m, sp in zip(medians, spreads, strict=True)],
        ]
        axis.bar([short[n] for n in names], medians, yerr=errors, capsize=4, color=["#4c72b0", "#55a868", "#c44e52"])
        axis.axhline(1.0, color="#8c8c8c", linewidth=1)
        if key == "rps":
            axis.axhline(GOAL_RATIO, color="#c44e52", linestyle="--", linewidth=1, label=f"goal {GOAL_RATIO}")
            axis.legend(fontsize=7)
        axis.set(ylabel="× tracing off (within each run)", title=titles[key])
    save_figure(fig, path, report, "what tracing costs (bars: median, whiskers: min–max over runs)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each 64-caller measurement")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    seed_argument(parser)
    args = parser.parse_args()
    seed = chosen_seed(args.seed)
    models = ROOT / "build" / "models"
    logs = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-tracing-"))
    progress(f"{machine()}; seed {seed}; logs in {logs}")
    started = time.monotonic()
    runs, orders = [], []
    with Jaeger(ROOT) as jaeger, contextlib.ExitStack() as stack:
        meshes = {}
        for name, (traced, ratio) in PHASES.items():
            config = MeshConfig(
                models=models,
                log_dir=logs / name,
                otlp_endpoint=jaeger.otlp_grpc_endpoint if traced else "",
                trace_ratio=ratio,
            )
            meshes[name] = stack.enter_context(Mesh(config))
        progress("four meshes up; warming each up past the cache's bypass window")
        for name, mesh in meshes.items():
            run_ghz(mesh.router, mlp_template(f"warm{name}"), WARM_UP_CALLS, CALLERS, timeout_s=30)
        pids = {name: {**mesh_pids(mesh), "jaeger": [jaeger.process.pid]} for name, mesh in meshes.items()}
        for run in range(1, args.runs + 1):
            order = phase_order(list(PHASES), run, seed)
            progress(f"run {run}: {', '.join(order)}")
            runs.append({name: one_phase(name, run, meshes[name], jaeger, pids[name], args.seconds) for name in order})
            orders.append(order)
    report = {
        "machine": machine(),
        "command": "python -m bench.tracing " + " ".join(sys.argv[1:]),
        "runs": len(runs),
        "seconds": args.seconds,
        "seed": seed,
        "orders": orders,
        "date": time.strftime("%Y-%m-%d"),
        "wall_s": time.monotonic() - started,
        "summary": summarise(runs),
        "raw": runs,
    }
    write(args.out, "tracing", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
