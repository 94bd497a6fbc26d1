"""A tidal ramp through the mesh, per batch-size policy (fixed, baseline,
adaptive), side by side in one run: open-loop traffic at a low rate L, then
6L, then L again; throughput and p99 per phase. L is a seventh of the mesh's
measured saturation, so the high tide nears it without overloading. Each run
also measures each policy's own saturation (closed loop, 64 callers): a policy
that sends smaller batches must not give up throughput for it. Beside the
policies, `fixed` capped at 4 rows shows what small batches trade; and before
the meshes start, in-process ONNX Runtime on one thread (as each of minilm's
instances runs) gives the model's own cost per row at each batch size.

    .venv/bin/python -m bench.tidal --runs 3

Writes bench/results/tidal.{json,md,png}.
"""

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

from bench.batching import ghz, in_process
from bench.report import chosen_seed, machine, phase_order, progress, pyplot, save_figure, seed_argument, write
from services.launcher.mesh import Mesh, MeshConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYOUTS = {  # report key -> the batcher's arguments
    "fixed": ("--batch-policy", "fixed"),
    "baseline": ("--batch-policy", "baseline"),
    "adaptive": ("--batch-policy", "adaptive"),
    "fixed, 4 rows": ("--batch-policy", "fixed", "--max-batch-size", "4"),
}
IN_PROCESS_SIZES = (1, 2, 4, 8, 16, 32, 64)
PHASES = (("low", 1), ("high", 6), ("low again", 1))
CALLERS = 64


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--phase-seconds", type=float, default=8.0)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    seed_argument(parser)
    args = parser.parse_args()
    seed = chosen_seed(args.seed)
    work = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-tidal-"))
    per_row = in_process(3.0, seed=1, sizes=IN_PROCESS_SIZES, threads=1)
    progress(
        "in-process, one thread: "
        + ", ".join(f"{rows}: {rate:.0f}" for rows, rate in per_row.items())
        + " rows/s by batch size"
    )
    meshes = {
        name: Mesh(
            MeshConfig(
                models=ROOT / "build" / "models",
                cache=False,
                log_dir=work / name.replace(", ", "-"),
                batcher_args=batcher_args,
            )
        )
        for name, batcher_args in LAYOUTS.items()
    }
    runs = []
    try:
        for mesh in meshes.values():
            mesh.start()
            ghz(mesh.router, "warm", 300, 16)
        saturation = ghz(meshes["fixed"].router, "saturation", 0, CALLERS, seconds=args.phase_seconds)["rps"]
        low = saturation / 7
        progress(f"meshes up; saturation {saturation:.0f} req/s, low tide {low:.0f} req/s")
        orders = []
        for run in range(args.runs):
            result = {}
            order = phase_order(list(meshes), run, seed)  # the ramp itself stays in order: low, high, low
            orders.append(order)
            for policy in order:
                mesh = meshes[policy]
                result[policy] = {
                    "saturation": ghz(mesh.router, f"{policy}{run}saturation", 0, CALLERS, seconds=args.phase_seconds)
                }
                for phase, factor in PHASES:
                    rate = low * factor
                    result[policy][phase] = ghz(
                        mesh.router, f"{policy}{run}{phase}", int(rate * args.phase_seconds), CALLERS, rps=rate
                    )
                progress(
                    f"run {run + 1}/{args.runs} {policy:13s}: "
                    + "; ".join(f"{ph} {r['rps']:.0f}/s p99 {r['p99_ms']:.0f} ms" for ph, r in result[policy].items())
                )
            runs.append(result)
    finally:
        for mesh in meshes.values():
            mesh.stop()
    report = {
        "machine": machine(),
        "command": "python -m bench.tidal " + " ".join(sys.argv[1:]),
        "runs": args.runs,
        "seed": seed,
        "orders": orders,
        "date": time.strftime("%Y-%m-%d"),
        "saturation_rps": saturation,
        "low_rps": low,
        "in_process_rows_per_s": per_row,
        "summary": {
            p: {
                ph: {k: statistics.median(r[p][ph][k] for r in runs) for k in ("rps", "p50_ms", "p99_ms")}
                | {"errors": sum(r[p][ph]["count"] - r[p][ph]["ok"] for r in runs)}
                for ph in ("saturation", *(ph for ph, _ in PHASES))
            }
            for p in LAYOUTS
        },
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
        "| policy | "
        + " | ".join(f"{ph}: req/s, p50, p99 ms" for ph, _ in PHASES)
        + f" | saturation ({CALLERS} callers, closed loop): req/s, p50, p99 ms | failed |",
        "|---|" + "---|" * (len(PHASES) + 2),
    ]
    for policy, phases in report["summary"].items():
        order = [ph for ph, _ in PHASES] + ["saturation"]
        cells = [f"{phases[ph]['rps']:.0f}, {phases[ph]['p50_ms']:.0f}, {phases[ph]['p99_ms']:.0f}" for ph in order]
        lines.append(f"| {policy} | " + " | ".join(cells) + f" | {sum(r['errors'] for r in phases.values())} |")
    per_row = report["in_process_rows_per_s"]
    lines += [
        "",
        "The model itself (in-process ONNX Runtime, one thread, before the meshes started), rows/s by batch "
        "size: " + ", ".join(f"{rows}: {rate:.0f}" for rows, rate in per_row.items()) + ".",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> None:
    plt = pyplot()

    fig, (ax, sat, model) = plt.subplots(1, 3, figsize=(14, 4), gridspec_kw={"width_ratios": [3, 1.3, 1.5]})
    phases = [ph for ph, _ in PHASES]
    layouts = len(report["summary"])
    width = 0.8 / layouts
    for i, (policy, data) in enumerate(report["summary"].items()):
        xs = [j + (i - (layouts - 1) / 2) * width for j in range(len(phases))]
        ax.bar(xs, [data[ph]["p99_ms"] for ph in phases], width, label=policy)
        sat.bar(i, data["saturation"]["rps"], 0.6, color=f"C{i}")
    ax.set_xticks(range(len(phases)), phases)
    ax.set_ylabel("p99 latency, ms")
    ax.set_title("tidal ramp: p99 per phase and batch policy")
    ax.legend()
    sat.set_xticks(range(layouts), list(report["summary"]), rotation=30, ha="right")
    sat.set_ylabel("requests/s")
    sat.set_title(f"saturation, {CALLERS} callers")
    per_row = {int(rows): rate for rows, rate in report["in_process_rows_per_s"].items()}
    model.plot(list(per_row), list(per_row.values()), marker="o")
    model.set_xscale("log", base=2)
    model.set_xticks(list(per_row), [str(rows) for rows in per_row])
    model.set_ylim(bottom=0)
    model.set_xlabel("batch size, rows")
    model.set_ylabel("rows/s")
    model.set_title("the model alone, one thread")
    save_figure(fig, path, report)


if __name__ == "__main__":
    sys.exit(main())
