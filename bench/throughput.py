"""minilm through the whole mesh at concurrency 1, 16 and 64 (driven by ghz),
beside in-process ONNX Runtime at its best batch size, in one run.

    make bench            # or: .venv/bin/python -m bench.throughput --runs 3

Writes bench/results/throughput.{json,md,png}. Every text is unique (ghz
renders it per call from a template), so the cache never answers: this
measures the model path; the mesh runs with its defaults, so the router's
automatic bypass soon stops paying for lookups that never hit.
"""

import argparse
import pathlib
import statistics
import sys
import tempfile
import time


from bench.report import machine, progress, pyplot, save_figure, write
from bench.workload import InProcessMinilm, ghz_unique_template, run_ghz, texts
from services.launcher.mesh import Mesh

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODEL = ROOT / "build" / "models" / "minilm" / "1"



def in_process_throughput(batch_sizes: list[int], seconds: float, seed: int) -> dict[int, float]:
    """Sentences per second of a bare ORT session (same graph, same tokenizer,
    2 intra-op threads, padding to the longest text of each batch)."""
    model = InProcessMinilm(MODEL)
    pool = texts(20000, seed)
    results = {}
    for batch in batch_sizes:
        done = 0
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            model.embed(pool[(done % 19000):(done % 19000) + batch])
            done += batch
        results[batch] = done / (time.perf_counter() - started)
        progress(f"  in-process ORT batch {batch:3d}: {results[batch]:7.1f} sentences/s")
    return results


def ghz_run(router: str, concurrency: int, total: int, seed: int) -> dict:
    """ghz with a one-message template whose text differs on every call."""
    report = run_ghz(router, ghz_unique_template(f"run{seed}"), total, concurrency)
    latency = {p["percentage"]: p["latency"] / 1e6 for p in report["latencyDistribution"]}
    ok = report["statusCodeDistribution"].get("OK", 0)
    return {"rps": report["rps"], "p50_ms": latency[50], "p99_ms": latency[99], "ok": ok, "count": report["count"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="repetitions; medians are reported")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--seconds", type=float, default=8.0, help="rough length of each measurement")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    runs = []
    with Mesh(models=ROOT / "build" / "models", log_dir=tempfile.mkdtemp(prefix="infermesh-bench-")) as mesh:
        progress(f"mesh up, router {mesh.router}; warming up")
        ghz_run(mesh.router, 16, 300, seed=999)
        for run in range(args.runs):
            # In-process ORT is measured in the same run, between mesh phases,
            # while the idle mesh processes stay resident, as they would.
            progress(f"run {run + 1}/{args.runs}: in-process ONNX Runtime")
            ort_rates = in_process_throughput([1, 8, 16, 32, 64], args.seconds / 2, seed=5000 + run)
            mesh_rates = {}
            for c in levels:
                # Size each measurement from the previous rate so it lasts about args.seconds.
                guess = max(50, int(args.seconds * (mesh_rates[levels[levels.index(c) - 1]]["rps"] if mesh_rates else 150)))
                result = ghz_run(mesh.router, c, max(guess, 2 * c), seed=100 * run + c)
                mesh_rates[c] = result
                progress(f"  mesh concurrency {c:3d}: {result['rps']:7.1f} req/s  p50 {result['p50_ms']:6.2f} ms  "
                         f"p99 {result['p99_ms']:6.2f} ms  ok {result['ok']}/{result['count']}")
            runs.append({"ort": ort_rates, "mesh": mesh_rates})

    summary = summarise(runs, levels)
    report = {
        "machine": machine(),
        "command": "python -m bench.throughput " + " ".join(sys.argv[1:]),
        "runs": args.runs,
        "date": time.strftime("%Y-%m-%d"),
        "summary": summary,
        "raw": runs,
    }
    write(args.out, "throughput", report, markdown(report, levels), lambda r, path: plot(r, levels, path))
    return 0


def summarise(runs: list[dict], levels: list[int]) -> dict:
    med = statistics.median
    best_ort = [max(r["ort"].values()) for r in runs]
    best_batch = [max(r["ort"], key=r["ort"].get) for r in runs]
    out = {
        "ort_batch1_per_s": med(r["ort"][1] for r in runs),
        "ort_best_per_s": med(best_ort),
        "ort_best_batch": statistics.mode(best_batch),
        "mesh": {},
    }
    for c in levels:
        out["mesh"][c] = {
            "rps": med(r["mesh"][c]["rps"] for r in runs),
            "p50_ms": med(r["mesh"][c]["p50_ms"] for r in runs),
            "p99_ms": med(r["mesh"][c]["p99_ms"] for r in runs),
            "errors": sum(r["mesh"][c]["count"] - r["mesh"][c]["ok"] for r in runs),
            # The ratio is taken within each run, then the median over runs.
            "ratio_to_ort_best": med(r["mesh"][c]["rps"] / max(r["ort"].values()) for r in runs),
        }
    return out


def markdown(report: dict, levels: list[int]) -> str:
    s = report["summary"]
    lines = [
        f"Machine: {report['machine']}. Command: `{report['command']}`. "
        f"Medians of {report['runs']} runs on {report['date']}; ratios are taken within each run.",
        "",
        "| path | concurrency | sentences/s | p50 ms | p99 ms | vs in-process ORT (best batch) |",
        "|---|---|---|---|---|---|",
        f"| in-process ORT, batch 1 | – | {s['ort_batch1_per_s']:.0f} | | | "
        f"{s['ort_batch1_per_s'] / s['ort_best_per_s']:.2f} |",
        f"| in-process ORT, batch {s['ort_best_batch']} (best) | – | {s['ort_best_per_s']:.0f} | | | 1.00 |",
    ]
    for c in levels:
        m = s["mesh"][str(c)] if str(c) in s["mesh"] else s["mesh"][c]
        lines.append(f"| mesh (ghz → router → cache → batcher → model_server) | {c} | {m['rps']:.0f} | "
                     f"{m['p50_ms']:.2f} | {m['p99_ms']:.2f} | {m['ratio_to_ort_best']:.2f} |")
    errors = sum((s["mesh"][c]["errors"]) for c in s["mesh"])
    lines.append("")
    lines.append(f"Failed requests over all mesh runs: {errors}.")
    return "\n".join(lines) + "\n"


def plot(report: dict, levels: list[int], path: pathlib.Path) -> None:
    plt = pyplot()

    s = report["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    rps = [s["mesh"][c]["rps"] for c in levels]
    left.bar([str(c) for c in levels], rps, color="#4c72b0", label="mesh")
    left.axhline(s["ort_best_per_s"], color="#c44e52", linestyle="--",
                 label=f"in-process ORT, best batch ({s['ort_best_batch']})")
    left.axhline(s["ort_batch1_per_s"], color="#8c8c8c", linestyle=":", label="in-process ORT, batch 1")
    left.set_xlabel("concurrent callers (ghz)")
    left.set_ylabel("sentences / s")
    left.set_title("minilm throughput")
    left.legend(fontsize=8)
    right.plot(levels, [s["mesh"][c]["p50_ms"] for c in levels], marker="o", label="p50")
    right.plot(levels, [s["mesh"][c]["p99_ms"] for c in levels], marker="o", label="p99")
    right.set_xscale("log", base=2)
    right.set_xticks(levels, [str(c) for c in levels])
    right.set_xlabel("concurrent callers (ghz)")
    right.set_ylabel("latency, ms")
    right.set_title("mesh latency")
    right.legend(fontsize=8)
    save_figure(fig, path, report)


if __name__ == "__main__":
    sys.exit(main())
