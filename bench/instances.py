"""Session instances of minilm on a shared CPU: one instance with every core
(intra-op threads = cores) against two instances with a core each, neither
reserved for VIP (minilm's shipped config reserves its second for VIP batches;
bench.batching measures that), side by side in one run, through the whole mesh.

Two meshes, alike but for minilm's `instances.count`, take turns under the
same closed-loop ghz load at 1, 16, 64 and 256 callers; each round measures
both. The model server's resident memory is read at the end. The question is
whether two single-threaded sessions, which need no barrier between threads
inside each operator, beat one two-threaded session when the cores are also
busy with the router, the batcher and the load generator.

    .venv/bin/python -m bench.instances --runs 3

Writes bench/results/instances.{json,md,png}.
"""

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

from bench.batching import ghz
from bench.report import machine, progress, pyplot, save_figure, write
from bench.workload import minilm_instances_repository
from services.launcher.mesh import Mesh, MeshConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
CALLERS = (1, 16, 64, 256)
LAYOUTS = {"one instance, 2 threads": 1, "two instances, 1 thread each": 2}


def resident_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0, help="length of each measurement")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-instances-"))
    meshes = {
        name: Mesh(MeshConfig(models=minilm_instances_repository(work, count), cache=False, log_dir=work / str(count)))
        for name, count in LAYOUTS.items()
    }
    runs = []
    try:
        for mesh in meshes.values():
            mesh.start()
        progress("meshes up (one instance, two instances); warming up")
        for mesh in meshes.values():
            ghz(mesh.router, "warm", 300, 16)
        for run in range(args.runs):
            r = {name: {} for name in meshes}
            for callers in CALLERS:
                order = list(meshes.items()) if run % 2 == 0 else list(reversed(meshes.items()))
                for name, mesh in order:  # alternate who goes first, so drift favours neither
                    r[name][callers] = ghz(mesh.router, f"i{run}c{callers}{name[:3]}", 0, callers, seconds=args.seconds)
            runs.append(r)
            progress(
                f"run {run + 1}/{args.runs}: "
                + "; ".join(
                    f"{callers} callers {r[names[0]][callers]['rps']:.0f} vs {r[names[1]][callers]['rps']:.0f}/s"
                    for names in [list(meshes)]
                    for callers in CALLERS
                )
            )
        memory = {name: resident_mib(mesh.processes["model_server"].popen.pid) for name, mesh in meshes.items()}
    finally:
        for mesh in meshes.values():
            mesh.stop()
        shutil.rmtree(work, ignore_errors=True)
    report = summarise(runs, memory)
    write(args.out, "instances", report, markdown(report), plot)
    return 0


def summarise(runs: list[dict], memory: dict[str, float]) -> dict:
    med = statistics.median
    names = list(LAYOUTS)
    summary = {
        name: {
            str(c): {
                "rps": med(r[name][c]["rps"] for r in runs),
                "p50_ms": med(r[name][c]["p50_ms"] for r in runs),
                "p99_ms": med(r[name][c]["p99_ms"] for r in runs),
                "failed": sum(r[name][c]["count"] - r[name][c]["ok"] for r in runs),
            }
            for c in CALLERS
        }
        for name in names
    }
    ratios = {str(c): med(r[names[1]][c]["rps"] / r[names[0]][c]["rps"] for r in runs) for c in CALLERS}
    return {
        "machine": machine(),
        "command": "python -m bench.instances " + " ".join(sys.argv[1:]),
        "runs": len(runs),
        "date": time.strftime("%Y-%m-%d"),
        "summary": summary,
        "ratio": ratios,
        "memory_mib": memory,
        "raw": runs,
    }


def markdown(report: dict) -> str:
    names = list(LAYOUTS)
    s = report["summary"]
    lines = [
        f"Machine: {report['machine']}. Command: `{report['command']}`. Medians of {report['runs']} runs on "
        f"{report['date']}; both layouts measured in every run, taking turns; closed-loop ghz, every text unique.",
        "",
        "| callers | " + " | ".join(f"{n}: req/s, p50, p99 ms" for n in names) + " | two ÷ one (req/s) |",
        "|---|---|---|---|",
    ]
    for c in CALLERS:
        lines.append(
            f"| {c} | "
            + " | ".join(
                f"{s[n][str(c)]['rps']:.0f}, {s[n][str(c)]['p50_ms']:.1f}, {s[n][str(c)]['p99_ms']:.1f}" for n in names
            )
            + f" | × {report['ratio'][str(c)]:.2f} |"
        )
    failed = sum(s[n][str(c)]["failed"] for n in names for c in CALLERS)
    lines += [
        "",
        "Model server resident memory at the end: "
        + ", ".join(f"{n} {report['memory_mib'][n]:.0f} MiB" for n in names)
        + f". Failed requests over all runs: {failed}.",
        "",
    ]
    return "\n".join(lines)


def plot(report: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, colour in zip(LAYOUTS, ("#8c8c8c", "#4c72b0"), strict=True):
        s = report["summary"][name]
        left.plot(CALLERS, [s[str(c)]["rps"] for c in CALLERS], marker="o", color=colour, label=name)
        right.plot(CALLERS, [s[str(c)]["p99_ms"] for c in CALLERS], marker="o", color=colour, label=name)
    for axis, label in ((left, "requests/s"), (right, "p99 latency, ms")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(list(CALLERS), [str(c) for c in CALLERS])
        axis.set_xlabel("callers (closed loop)")
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
    left.set_title("throughput")
    right.set_title("tail latency")
    save_figure(fig, path, report, "minilm session instances")


if __name__ == "__main__":
    sys.exit(main())
