"""A tidal ramp through the mesh, per batch-size policy (fixed, baseline,
adaptive), side by side in one run: open-loop traffic at a low rate L, then
6L, then L again; throughput and p99 per phase. L is a seventh of the mesh's
measured saturation, so the high tide nears it without overloading.

    .venv/bin/python -m bench.tidal --runs 3

Writes bench/results/tidal.{json,md,png}.
"""

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

from bench.batching import ghz
from bench.report import machine, progress, pyplot, save_figure, write
from services.launcher.mesh import Mesh

ROOT = pathlib.Path(__file__).resolve().parent.parent
POLICIES = ("fixed", "baseline", "adaptive")
PHASES = (("low", 1), ("high", 6), ("low again", 1))



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--phase-seconds", type=float, default=8.0)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-tidal-"))
    meshes = {p: Mesh(models=ROOT / "build" / "models", cache=False, log_dir=work / p,
                      batcher_args=("--batch-policy", p)) for p in POLICIES}
    runs = []
    try:
        for mesh in meshes.values():
            mesh.start()
            ghz(mesh.router, "warm", 300, 16)
        saturation = ghz(meshes["fixed"].router, "saturation", int(args.phase_seconds * 160), 64)["rps"]
        low = saturation / 7
        progress(f"meshes up; saturation {saturation:.0f} req/s, low tide {low:.0f} req/s")
        for run in range(args.runs):
            result = {}
            for policy, mesh in meshes.items():
                result[policy] = {}
                for phase, factor in PHASES:
                    rate = low * factor
                    result[policy][phase] = ghz(mesh.router, f"{policy}{run}{phase}", int(rate * args.phase_seconds),
                                                64, rps=rate)
                progress(f"run {run + 1}/{args.runs} {policy:8s}: " + "; ".join(
                    f"{ph} {r['rps']:.0f}/s p99 {r['p99_ms']:.0f} ms" for ph, r in result[policy].items()))
            runs.append(result)
    finally:
        for mesh in meshes.values():
            mesh.stop()
    report = {
        "machine": machine(),
        "command": "python -m bench.tidal " + " ".join(sys.argv[1:]), "runs": args.runs,
        "date": time.strftime("%Y-%m-%d"), "saturation_rps": saturation, "low_rps": low,
        "summary": {p: {ph: {k: statistics.median(r[p][ph][k] for r in runs) for k in ("rps", "p50_ms", "p99_ms")}
                        | {"errors": sum(r[p][ph]["count"] - r[p][ph]["ok"] for r in runs)}
                        for ph, _ in PHASES} for p in POLICIES},
        "raw": runs,
    }
    write(args.out, "tidal", report, markdown(report), plot)
    return 0


def markdown(report: dict) -> str:
    lines = [
        f"Machine: {report['machine']}. Command: `{report['command']}`. Medians of {report['runs']} runs on "
        f"{report['date']}; open-loop ghz at {report['low_rps']:.0f} → {6 * report['low_rps']:.0f} → "
        f"{report['low_rps']:.0f} requests/s (the mesh saturated at {report['saturation_rps']:.0f}/s).",
        "",
        "| policy | " + " | ".join(f"{ph}: req/s, p50, p99 ms" for ph, _ in PHASES) + " | failed |",
        "|---|" + "---|" * (len(PHASES) + 1),
    ]
    for policy, phases in report["summary"].items():
        cells = [f"{r['rps']:.0f}, {r['p50_ms']:.0f}, {r['p99_ms']:.0f}" for r in phases.values()]
        lines.append(f"| {policy} | " + " | ".join(cells) + f" | {sum(r['errors'] for r in phases.values())} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4))
    phases = [ph for ph, _ in PHASES]
    width = 0.25
    for i, (policy, data) in enumerate(report["summary"].items()):
        xs = [j + (i - 1) * width for j in range(len(phases))]
        ax.bar(xs, [data[ph]["p99_ms"] for ph in phases], width, label=policy)
    ax.set_xticks(range(len(phases)), phases)
    ax.set_ylabel("p99 latency, ms")
    ax.set_title("tidal ramp: p99 per phase and batch policy")
    ax.legend()
    save_figure(fig, path, report)


if __name__ == "__main__":
    sys.exit(main())
