"""The mesh's own cost per request (the fast path), side by side in one run.

With a free model (`mlp`, 64 floats in and out, distinct inputs on every
call, so the cache never answers and its automatic bypass engages), what is
measured is the mesh itself:

- throughput at 64 ghz callers through the mesh with one router and with two
  router processes sharing the port, against a bare grpc.aio server answering
  the same call (bench/bare.py, echoing the input as OUTPUT0);
- the CPU time every process of the mesh spends per request (from /proc: the
  router(s), batcher, model server, cache, redis-server) and ghz's own;
- three bare servers in series (each forwarding the call to the next, the
  last echoing), at 64 callers and at one: as many Python processes as the
  mesh puts between a caller and the model, doing nothing else;
- cache traffic while the bypass is engaged (the cache service's lookups and
  stored bytes, which should not move);
- p50 and p99 at one caller, mesh against bare and against the chain;
- what an idle gap costs this machine: an mlp run in-process back to back and
  after a 3 ms pause (at one caller every process of the mesh wakes from such
  a pause for every request);
- refusals: the router's CPU per call refusing an unknown model (NOT_FOUND)
  and under a standard-tier flood of minilm with a one-place queue (nearly
  every call refused, most by the router's own shedding), against the bare
  server's RESOURCE_EXHAUSTED.

Every phase runs in every run, interleaved; the report gives medians over runs
of each figure, ratios taken within a run. With --flame, py-spy records each
service under the mesh's 64-caller load once more after the runs (sampling
costs CPU, so those seconds are not in the figures) and writes flame graphs
to bench/results/flame-<service>.svg.

    .venv/bin/python -m bench.fastpath --runs 3 --flame

Writes bench/results/fastpath.{json,md,png}.
"""

import argparse
import json
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnxruntime as ort

from bench.bare import REFUSE
from bench.bare import start as start_bare
from bench.report import (
    chosen_seed,
    cpu_times,
    goal_verdict,
    machine,
    phase_order,
    process_cpu_s,
    progress,
    pyplot,
    save_figure,
    seed_argument,
    steal_share,
    write,
)
from bench.workload import ghz_unique_template, run_ghz
from services.common.metrics import scrape
from services.launcher.mesh import Mesh, MeshConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
CALLERS = 64
SERVICES = ("router", "batcher", "model_server", "cache", "redis")
GOAL_CPU_US = 400  # the whole mesh's CPU per mlp request (issue 24)


def mlp_template(tag: str, model: str = "mlp") -> str:
    """A ghz -d body for mlp whose 256 input bytes (64 FP32 values) differ on
    every call: the tag and ghz's request number, zero-padded, as raw bytes."""
    digits = f"{{{{ printf `{tag}-%0{255 - len(tag)}d` .RequestNumber | b64enc }}}}"
    return json.dumps(
        {
            "model_name": model,
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 64]}],
            "raw_input_contents": [digits],
        }
    )


def idle_gap_cost(model: pathlib.Path, calls: int = 400, gap_s: float = 0.003) -> dict:
    """Median µs of one in-process mlp run back to back, and after `gap_s` asleep."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    feeds = {"INPUT0": np.random.default_rng(0).random((1, 64), dtype=np.float32)}
    result = {}
    for key, pause in (("back_to_back_us", 0.0), ("after_gap_us", gap_s)):
        for _ in range(50):
            session.run(None, feeds)
        times = []
        for _ in range(calls):
            if pause:
                time.sleep(pause)
            started = time.perf_counter()
            session.run(None, feeds)
            times.append(time.perf_counter() - started)
        result[key] = 1e6 * statistics.median(times)
    return result


def ghz_cpu_s() -> float:
    """CPU time of the finished children waited for so far (ghz runs as one)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def load(
    address: str, data: str, total: int, callers: int, pids: dict[str, list[int]], seconds: float | None = None
) -> dict:
    """One ghz run of `total` calls (or of `seconds`) from `callers` workers
    (closed loop), with the CPU seconds each named group of processes spent per call."""
    before = {name: sum(process_cpu_s(pid) for pid in group) for name, group in pids.items()}
    ghz_before, machine_before = ghz_cpu_s(), cpu_times()
    report = run_ghz(address, data, total, callers, timeout_s=30, seconds=seconds)
    ghz_after, machine_after = ghz_cpu_s(), cpu_times()
    after = {name: sum(process_cpu_s(pid) for pid in group) for name, group in pids.items()}
    calls = report["count"]
    latency = {p["percentage"]: p["latency"] / 1e6 for p in report.get("latencyDistribution") or ()}
    return {
        "rps": report["rps"],
        "codes": report["statusCodeDistribution"],
        "p50_ms": latency.get(50),
        "p99_ms": latency.get(99),
        "cpu_us": {name: 1e6 * (after[name] - before[name]) / calls for name in pids},
        "ghz_cpu_us": 1e6 * (ghz_after - ghz_before) / calls,
        "steal": steal_share(machine_before, machine_after),
    }


def mesh_pids(mesh: Mesh) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for name, process in mesh.processes.items():
        service = "router" if name.startswith("router") else name
        groups.setdefault(service, []).append(process.popen.pid)
    return groups


def cache_traffic(mesh: Mesh) -> tuple[float, float]:
    """(lookups answered, bytes stored) so far, from the cache service itself."""
    scraped = scrape(mesh.metrics_url("cache"))
    return (
        sum(v for (n, _), v in scraped.items() if n == "infermesh_cache_lookups_total"),
        sum(v for (n, _), v in scraped.items() if n == "infermesh_cache_stored_bytes_total"),
    )


def one_run(
    run: int,
    meshes: dict[str, Mesh],
    bare: tuple[int, str],
    chain: tuple[list[int], str],
    flood: Mesh,
    seconds: float,
    seed: int,
) -> tuple[dict, list[str]]:
    """Every phase once, in an order shuffled by (seed, run); each 64-caller
    phase lasts `seconds`, each 1-caller one 1500 calls."""
    bare_pid, bare_address = bare
    chain_pids, chain_address = chain
    result: dict = {}
    mesh = meshes["mesh"]
    tag = f"r{run}"

    def phase(key: str, address: str, data: str, callers: int, pids: dict[str, list[int]]):
        def measure():
            if callers == CALLERS:
                cell = result[key] = load(address, data, 0, callers, pids, seconds=seconds)
            else:
                cell = result[key] = load(address, data, 1500, callers, pids)
            cpu = ", ".join(f"{name} {us:.0f}" for name, us in cell["cpu_us"].items())
            progress(
                f"run {run}: {key}: {cell['rps']:.0f}/s, p50 {cell['p50_ms'] or 0:.2f} ms, CPU µs per call: "
                f"{cpu}, ghz {cell['ghz_cpu_us']:.0f}; {cell['codes']}"
            )

        return key, measure

    def through_mesh(name: str, target: Mesh):
        key, measure = phase(name, target.router, mlp_template(f"{tag}{name}"), CALLERS, mesh_pids(target))

        def with_cache_traffic():
            lookups_before = cache_traffic(target)
            measure()
            result[name]["cache_traffic"] = [
                after - before for after, before in zip(cache_traffic(target), lookups_before, strict=True)
            ]

        return key, with_cache_traffic

    def idle_gap():
        result["idle_gap"] = idle_gap_cost(ROOT / "build" / "models" / "mlp" / "1" / "model.onnx")
        progress(
            f"run {run}: an mlp run in-process: {result['idle_gap']['back_to_back_us']:.0f} µs back to back, "
            f"{result['idle_gap']['after_gap_us']:.0f} µs after a 3 ms pause"
        )

    phases = [
        phase("bare", bare_address, mlp_template(tag), CALLERS, {"bare": [bare_pid]}),
        phase("chain", chain_address, mlp_template(f"{tag}c"), CALLERS, {"chain": chain_pids}),
        *(through_mesh(name, target) for name, target in meshes.items()),
        phase("bare_1", bare_address, mlp_template(f"{tag}b1"), 1, {"bare": [bare_pid]}),
        phase("mesh_1", mesh.router, mlp_template(f"{tag}m1"), 1, mesh_pids(mesh)),
        phase("chain_1", chain_address, mlp_template(f"{tag}c1"), 1, {"chain": chain_pids}),
        ("idle_gap", idle_gap),
        phase("bare_refused", bare_address, mlp_template(tag, REFUSE), CALLERS, {"bare": [bare_pid]}),
        phase("router_not_found", mesh.router, mlp_template(tag, "no-such-model"), CALLERS, mesh_pids(mesh)),
        phase("router_flooded", flood.router, ghz_unique_template(f"flood{tag}"), CALLERS, mesh_pids(flood)),
    ]
    order = phase_order(phases, run, seed)
    for _, measure in order:
        measure()
    return result, [key for key, _ in order]


def summarise(runs: list[dict]) -> dict:
    med = statistics.median
    keys = [key for key in runs[0] if key != "idle_gap"]
    summary = {"idle_gap": {name: med(r["idle_gap"][name] for r in runs) for name in runs[0]["idle_gap"]}}
    for key in keys:
        cells = [r[key] for r in runs]
        summary[key] = {
            "rps": med(c["rps"] for c in cells),
            "p50_ms": med(c["p50_ms"] for c in cells if c["p50_ms"] is not None)
            if any(c["p50_ms"] is not None for c in cells)
            else None,
            "p99_ms": med(c["p99_ms"] for c in cells if c["p99_ms"] is not None)
            if any(c["p99_ms"] is not None for c in cells)
            else None,
            "cpu_us": {name: med(c["cpu_us"][name] for c in cells) for name in cells[0]["cpu_us"]},
            "ghz_cpu_us": med(c["ghz_cpu_us"] for c in cells),
            "codes": _summed([c["codes"] for c in cells]),
        }
        if "cache_traffic" in cells[0]:
            summary[key]["cache_traffic"] = [sum(c["cache_traffic"][i] for c in cells) for i in (0, 1)]
    per_run = {
        "mesh_over_bare": [r["mesh"]["rps"] / r["bare"]["rps"] for r in runs],
        "two_routers_over_one": [r["mesh_2_routers"]["rps"] / r["mesh"]["rps"] for r in runs],
        "mesh_cpu_us": [sum(r["mesh"]["cpu_us"].values()) for r in runs],
        "p50_over_bare_ms": [r["mesh_1"]["p50_ms"] - r["bare_1"]["p50_ms"] for r in runs],
        "p50_over_chain_ms": [r["mesh_1"]["p50_ms"] - r["chain_1"]["p50_ms"] for r in runs],
        "chain_p50_over_bare_ms": [r["chain_1"]["p50_ms"] - r["bare_1"]["p50_ms"] for r in runs],
        "mesh_over_chain": [r["mesh"]["rps"] / r["chain"]["rps"] for r in runs],
        "flood_refused_share": [
            1 - r["router_flooded"]["codes"].get("OK", 0) / sum(r["router_flooded"]["codes"].values()) for r in runs
        ],
    }
    summary["ratios"] = {key: {"median": med(values), "runs": values} for key, values in per_run.items()}
    steals = [c["steal"] for r in runs for k, c in r.items() if k != "idle_gap" and c.get("steal") is not None]
    summary["steal_median"] = med(steals) if steals else None
    summary["steal_max"] = max(steals) if steals else None
    return summary


def _summed(distributions: list[dict]) -> dict:
    total: dict[str, int] = {}
    for distribution in distributions:
        for code, count in distribution.items():
            total[code] = total.get(code, 0) + count
    return total


LABELS = {
    "bare": "bare grpc.aio server",
    "chain": "three bare servers in series",
    "mesh": "mesh, one router",
    "mesh_2_routers": "mesh, two routers",
}


def markdown(report: dict) -> str:
    s = report["summary"]
    ratios = s["ratios"]
    steal = (
        ""
        if s["steal_median"] is None
        else f" The hypervisor took {s['steal_median']:.0%} of the CPU at the median phase (at most {s['steal_max']:.0%})."
    )
    lines = [
        f"Machine: {report['machine']}. Command: `{report['command']}`. Medians of {report['runs']} runs on "
        f"{report['date']}, each run's phases in an order shuffled with seed {report.get('seed', '?')}; ratios "
        f"are taken within each run.{steal}",
        "",
        f"**mlp, distinct inputs, ghz at {CALLERS} callers (closed loop)**",
        "",
        "| path | requests/s | p50 ms | p99 ms | CPU µs per request: " + ", ".join(SERVICES) + " | mesh total | ghz |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in ("bare", "chain", "mesh", "mesh_2_routers"):
        cell = s[key]
        cpu = cell["cpu_us"]
        parts = {
            "bare": lambda: f"{cpu['bare']:.0f} (the server)",
            "chain": lambda: f"{cpu['chain']:.0f} (the three servers)",
        }.get(key, lambda: " / ".join(f"{cpu[name]:.0f}" if name in cpu else "–" for name in SERVICES))()
        total = f"{sum(cpu.values()):.0f}" if key not in ("bare", "chain") else "–"
        lines.append(
            f"| {LABELS[key]} | {cell['rps']:.0f} | {cell['p50_ms']:.2f} | {cell['p99_ms']:.2f} | {parts} "
            f"| {total} | {cell['ghz_cpu_us']:.0f} |"
        )
    lookups, stored = s["mesh"]["cache_traffic"]
    lines += [
        "",
        f"- Mesh over bare server: **×{ratios['mesh_over_bare']['median']:.2f}** "
        f"(runs: {', '.join(f'{v:.2f}' for v in ratios['mesh_over_bare']['runs'])}; goal ≥ 0.6: "
        f"{goal_verdict(ratios['mesh_over_bare']['runs'], lambda v: v >= 0.6)}); "
        f"over three bare servers in series: ×{ratios['mesh_over_chain']['median']:.2f}.",
        f"- Whole-mesh CPU per request: **{ratios['mesh_cpu_us']['median']:.0f} µs** "
        f"(runs: {', '.join(f'{v:.0f}' for v in ratios['mesh_cpu_us']['runs'])}; goal ≤ {GOAL_CPU_US}: "
        f"{goal_verdict(ratios['mesh_cpu_us']['runs'], lambda v: v <= GOAL_CPU_US)}).",
        f"- Two router processes over one: ×{ratios['two_routers_over_one']['median']:.2f} "
        f"(runs: {', '.join(f'{v:.2f}' for v in ratios['two_routers_over_one']['runs'])}).",
        f"- Cache traffic during the mesh's mlp phases (bypass engaged), all runs: {lookups:.0f} lookups, "
        f"{stored:.0f} bytes stored.",
        "",
        "**One caller**",
        "",
        "| path | p50 ms | p99 ms |",
        "|---|---|---|",
        f"| bare grpc.aio server | {s['bare_1']['p50_ms']:.3f} | {s['bare_1']['p99_ms']:.3f} |",
        f"| three bare servers in series | {s['chain_1']['p50_ms']:.3f} | {s['chain_1']['p99_ms']:.3f} |",
        f"| mesh | {s['mesh_1']['p50_ms']:.3f} | {s['mesh_1']['p99_ms']:.3f} |",
        "",
        f"- Mesh p50 above the bare server's: **{ratios['p50_over_bare_ms']['median']:.3f} ms** "
        f"(runs: {', '.join(f'{v:.3f}' for v in ratios['p50_over_bare_ms']['runs'])}; goal ≤ 0.5: "
        f"{goal_verdict(ratios['p50_over_bare_ms']['runs'], lambda v: v <= 0.5)}); "
        f"above three bare servers in series: {ratios['p50_over_chain_ms']['median']:.3f} ms "
        f"(runs: {', '.join(f'{v:.3f}' for v in ratios['p50_over_chain_ms']['runs'])}). The chain itself is "
        f"{ratios['chain_p50_over_bare_ms']['median']:.3f} ms above one bare server.",
        f"- What an idle gap costs this machine: an mlp run in-process takes "
        f"{s['idle_gap']['back_to_back_us']:.0f} µs back to back and {s['idle_gap']['after_gap_us']:.0f} µs "
        f"after a 3 ms pause (medians); at one caller each process of the path wakes from such a pause.",
        "",
        f"**Refusals, {CALLERS} callers**",
        "",
        "| what | calls/s | CPU µs per call | answers |",
        "|---|---|---|---|",
    ]
    for key, label, cpu_key in (
        ("bare_refused", "bare grpc.aio server: RESOURCE_EXHAUSTED", "bare"),
        ("router_not_found", "router: unknown model (NOT_FOUND)", "router"),
        ("router_flooded", "router: minilm flood, one-place standard queue", "router"),
    ):
        cell = s[key]
        lines.append(f"| {label} | {cell['rps']:.0f} | {cell['cpu_us'][cpu_key]:.0f} | {cell['codes']} |")
    lines.append("")
    lines.append(
        f"- Share of the flood refused: {ratios['flood_refused_share']['median']:.1%}; in the flood the "
        f"batcher spent {s['router_flooded']['cpu_us']['batcher']:.0f} µs and the model server "
        f"{s['router_flooded']['cpu_us']['model_server']:.0f} µs per call."
    )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    s = report["summary"]
    fig, (rate, cpu, latency) = plt.subplots(1, 3, figsize=(13, 4))
    keys = ("bare", "chain", "mesh", "mesh_2_routers")
    short = {
        "bare": "bare\nserver",
        "chain": "3 bare\nin series",
        "mesh": "mesh,\none router",
        "mesh_2_routers": "mesh,\ntwo routers",
    }
    rate.bar([short[k] for k in keys], [s[k]["rps"] for k in keys], color=["#8c8c8c", "#bdbdbd", "#4c72b0", "#55a868"])
    rate.set(ylabel="requests / s", title=f"mlp at {CALLERS} callers")
    bottom = 0.0
    for name in SERVICES:
        value = s["mesh"]["cpu_us"].get(name, 0.0)
        cpu.bar(["mesh (one router)"], [value], bottom=[bottom], label=name)
        bottom += value
    cpu.bar(["bare server"], [s["bare"]["cpu_us"]["bare"]], color="#8c8c8c", label="bare server")
    cpu.bar(["3 bare in series"], [s["chain"]["cpu_us"]["chain"]], color="#bdbdbd", label="3 bare in series")
    cpu.axhline(GOAL_CPU_US, color="#c44e52", linestyle="--", linewidth=1, label=f"goal {GOAL_CPU_US} µs")
    cpu.set(ylabel="CPU µs per request", title="where the CPU goes")
    cpu.legend(fontsize=7)
    latency.bar(
        ["bare\np50", "chain\np50", "mesh\np50", "bare\np99", "chain\np99", "mesh\np99"],
        [s[k][q] for q in ("p50_ms", "p99_ms") for k in ("bare_1", "chain_1", "mesh_1")],
        color=["#8c8c8c", "#bdbdbd", "#4c72b0"] * 2,
    )
    latency.set(ylabel="ms", title="one caller")
    save_figure(fig, path, report, "the mesh's own cost per request")


def flame_graphs(mesh: Mesh, out: pathlib.Path, seconds: float, rate: float) -> list[str]:
    """py-spy flame graphs of every service of `mesh` under the 64-caller mlp load."""
    py_spy = pathlib.Path(sys.executable).parent / "py-spy"
    written = []
    for name, process in mesh.processes.items():
        if name == "redis":
            continue
        target = out / f"flame-{name}.svg"
        recorder = subprocess.Popen(
            [
                str(py_spy),
                "record",
                "--pid",
                str(process.popen.pid),
                "--output",
                str(target),
                "--rate",
                "100",
                "--nonblocking",
                "--duration",
                str(int(seconds)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)  # py-spy attaches
        run_ghz(mesh.router, mlp_template(f"flame{name}"), int(seconds * rate), CALLERS, timeout_s=30)
        _, stderr = recorder.communicate(timeout=seconds + 30)
        if recorder.returncode == 0 and target.exists():
            # py-spy writes its command line into the graph: paths relative to the checkout.
            target.write_text(target.read_text().replace(f"{ROOT}/", ""))
            written.append(target.name)
            progress(f"flame graph of {name}: {target}")
        else:
            progress(f"py-spy could not record {name}: {stderr.strip()[-300:]}")
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each 64-caller phase")
    parser.add_argument("--flame", action="store_true", help="also record py-spy flame graphs of every service")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    seed_argument(parser)
    args = parser.parse_args()
    seed = chosen_seed(args.seed)
    models = ROOT / "build" / "models"
    logs = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-fastpath-"))
    bare, bare_address = start_bare(ROOT, echo=True)
    chain = [start_bare(ROOT, echo=True)]
    for _ in range(2):
        chain.insert(0, start_bare(ROOT, forward=chain[0][1]))
    try:
        with (
            Mesh(MeshConfig(models=models, log_dir=logs / "one")) as one,
            Mesh(MeshConfig(models=models, log_dir=logs / "two", routers=2)) as two,
            Mesh(
                MeshConfig(
                    models=models, log_dir=logs / "flood", cache=False, batcher_args=("--standard-max-queue-size", "1")
                )
            ) as flood,
        ):
            meshes = {"mesh": one, "mesh_2_routers": two}
            progress(f"bare server {bare_address}, meshes up (logs in {logs}); warming up until the bypass engages")
            for mesh in meshes.values():  # past the bypass window (500 lookups) with unique inputs
                run_ghz(mesh.router, mlp_template("warm"), 3000, CALLERS, timeout_s=30)
            run_ghz(bare_address, mlp_template("warm"), 2000, CALLERS, timeout_s=30)
            run_ghz(chain[0][1], mlp_template("warm"), 2000, CALLERS, timeout_s=30)
            run_ghz(flood.router, ghz_unique_template("warm"), 500, CALLERS, timeout_s=30)
            chained = ([process.pid for process, _ in chain], chain[0][1])
            runs, orders = [], []
            for run in range(args.runs):
                result, order = one_run(run + 1, meshes, (bare.pid, bare_address), chained, flood, args.seconds, seed)
                runs.append(result)
                orders.append(order)
            flames = flame_graphs(one, args.out, args.seconds, runs[-1]["mesh"]["rps"]) if args.flame else []
    finally:
        for process in [bare, *(process for process, _ in chain)]:
            process.kill()
            process.wait()
    report = {
        "machine": machine(),
        "command": "python -m bench.fastpath " + " ".join(sys.argv[1:]),
        "runs": len(runs),
        "seed": seed,
        "orders": orders,
        "date": time.strftime("%Y-%m-%d"),
        "summary": summarise(runs),
        "flame_graphs": flames,
        "raw": runs,
    }
    write(args.out, "fastpath", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
