"""What one gRPC hop costs on this machine: the floor under every service of the mesh.

Every request crosses Python gRPC servers (router, batcher, model server), and
under overload most of the router's answers are refusals. This measures, side by
side in one run, at the rates the overload benchmark drives:

- a bare grpc.aio server (reflection only, no interceptor, no metrics) that
  answers at once: OK, or RESOURCE_EXHAUSTED with a retry hint as a shed
  refusal is sent;
- the router of a running mesh refusing a model it does not serve (NOT_FOUND):
  its cheapest refusal, the same work as a shed one up to the status (parse,
  metadata, lookup, metrics).

For each: the server process's own CPU time per call (from /proc, all its
threads) and the latency ghz sees, and the share of the CPU the hypervisor gave
to other guests meanwhile.

    .venv/bin/python -m bench.hop --runs 3

Writes bench/results/hop.{json,md,png}.
"""

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

from bench.bare import REFUSE
from bench.bare import start as start_bare
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
    steal_share,
    write,
)
from bench.workload import ghz_unique_template, run_ghz
from services.launcher.mesh import Mesh, MeshConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
RATES = (150, 300, 600)  # the overload's standard rate at the saturation measured here, and either side of it
TARGETS = ("bare_ok", "bare_refused", "router_refused")
LABELS = {
    "bare_ok": "bare grpc.aio: OK",
    "bare_refused": "bare grpc.aio: RESOURCE_EXHAUSTED",
    "router_refused": "router: NOT_FOUND",
}


def measure(address: str, pid: int, model: str, rate: int, seconds: float) -> dict:
    cpu_before, machine_before = process_cpu_s(pid), cpu_times()
    report = run_ghz(address, ghz_unique_template("hop", model), int(rate * seconds), 64, rps=rate, timeout_s=10)
    cpu_after, machine_after = process_cpu_s(pid), cpu_times()
    latencies = sorted(d["latency"] / 1e6 for d in report["details"])
    return {
        "rate": rate,
        "sent_rps": report["rps"],
        "codes": report["statusCodeDistribution"],
        "cpu_us_per_call": 1e6 * (cpu_after - cpu_before) / len(latencies),
        "p50_ms": latencies[len(latencies) // 2],
        "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "steal": steal_share(machine_before, machine_after),
    }


def summarise(runs: list[dict]) -> dict:
    med = statistics.median
    summary = {}
    for target in TARGETS:
        for rate in RATES:
            cells = [r[target][str(rate)] for r in runs]
            summary[f"{target}@{rate}"] = {
                key: med(c[key] for c in cells) for key in ("cpu_us_per_call", "p50_ms", "p99_ms")
            }
    steals = [c["steal"] for r in runs for t in TARGETS for c in r[t].values() if c["steal"] is not None]
    return {
        "machine": machine(),
        "command": "python -m bench.hop " + " ".join(sys.argv[1:]),
        "runs": len(runs),
        "date": time.strftime("%Y-%m-%d"),
        "rates": list(RATES),
        "summary": summary,
        "steal_median": med(steals) if steals else None,
        "steal_max": max(steals) if steals else None,
        "raw": runs,
    }


def markdown(report: dict) -> str:
    s = report["summary"]
    steal = (
        ""
        if report["steal_median"] is None
        else f" The hypervisor took {report['steal_median']:.0%} of the CPU at the median measurement "
        f"(at most {report['steal_max']:.0%})."
    )
    lines = [
        f"Machine: {report['machine']}. Command: `{report['command']}`. Medians of {report['runs']} runs on "
        f"{report['date']}; ghz at 64 workers, open rate.{steal}",
        "",
        "| server, answer | rate (requests/s) | server CPU per call | p50 | p99 |",
        "|---|---|---|---|---|",
    ]
    for target in TARGETS:
        for rate in report["rates"]:
            cell = s[f"{target}@{rate}"]
            lines.append(
                f"| {LABELS[target]} | {rate} | {cell['cpu_us_per_call']:.0f} µs | {cell['p50_ms']:.2f} ms "
                f"| {cell['p99_ms']:.2f} ms |"
            )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    fig, (cpu, latency) = plt.subplots(1, 2, figsize=(10, 4))
    rates = report["rates"]
    for target in TARGETS:
        cells = [report["summary"][f"{target}@{rate}"] for rate in rates]
        cpu.plot(rates, [c["cpu_us_per_call"] for c in cells], marker="o", label=LABELS[target])
        (line,) = latency.plot(rates, [c["p99_ms"] for c in cells], marker="o", label=f"{LABELS[target]} p99")
        latency.plot(rates, [c["p50_ms"] for c in cells], marker=".", linestyle="--", color=line.get_color())
    cpu.set(xlabel="requests/s", ylabel="server CPU per call (µs)", title="CPU time per call", ylim=(0, None))
    latency.set(
        xlabel="requests/s", ylabel="ms (dashed: p50; dotted: 5 ms)", title="latency as ghz sees it", ylim=(0, None)
    )
    latency.axhline(5, color="grey", linewidth=0.8, linestyle=":")
    cpu.legend(fontsize=7)
    save_figure(fig, path, report, "one gRPC hop")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each measurement")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    seed_argument(parser)
    args = parser.parse_args()
    seed = chosen_seed(args.seed)
    bare, bare_address = start_bare(ROOT)
    try:
        with Mesh(
            MeshConfig(
                models=ROOT / "build" / "models",
                cache=False,
                log_dir=pathlib.Path(tempfile.mkdtemp(prefix="infermesh-hop-")),
            )
        ) as mesh:
            router_pid = mesh.processes["router"].popen.pid
            plan = {
                "bare_ok": (bare_address, bare.pid, "minilm"),
                "bare_refused": (bare_address, bare.pid, REFUSE),
                "router_refused": (mesh.router, router_pid, "no-such-model"),
            }
            for address, pid, model in plan.values():  # warm each path once
                measure(address, pid, model, 100, 1)
            runs, orders = [], []
            for run in range(args.runs):
                result = {target: {} for target in TARGETS}
                order = phase_order([(rate, target) for rate in RATES for target in TARGETS], run, seed)
                orders.append([f"{target}@{rate}" for rate, target in order])
                for rate, target in order:
                    address, pid, model = plan[target]
                    cell = result[target][str(rate)] = measure(address, pid, model, rate, args.seconds)
                    progress(
                        f"run {run + 1}/{args.runs}: {target} at {rate}/s: "
                        f"{cell['cpu_us_per_call']:.0f} µs CPU per call, p50 {cell['p50_ms']:.2f} ms, "
                        f"p99 {cell['p99_ms']:.2f} ms, {cell['codes']}"
                    )
                runs.append(result)
    finally:
        bare.kill()
        bare.wait()
    report = summarise(runs)
    report.update(seed=seed, orders=orders)
    write(args.out, "hop", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
