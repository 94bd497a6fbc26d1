"""minilm through the whole mesh at concurrency 1, 16 and 64 (driven by ghz),
beside in-process ONNX Runtime at its best batch size, in one run. In-process
ORT runs in two layouts: one session with an intra-op thread per core, and
one one-thread session per core, each driven by a thread of its own (the
mesh's model server runs two such instances); the best of either is the
baseline.

    make bench            # or: .venv/bin/python -m bench.throughput --runs 3

Writes bench/results/throughput.{json,md,png}. Every text is unique (ghz
renders it per call from a template), so the cache never answers: this
measures the model path; the mesh runs with its defaults, so the router's
automatic bypass soon stops paying for lookups that never hit (the warm-up
engages it, so every run starts from that state).

Equal work: in-process ORT embeds exactly the texts ghz sends the mesh
(bench.workload.ghz_texts renders the template's format for the same request
numbers), padded to the longest text of each batch as the model server pads.
Each phase lasts --seconds (ghz runs by duration), and the phases of a run go
in an order shuffled by --seed (recorded in the report).
"""

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time

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
from bench.workload import InProcessMinilm, ghz_texts, ghz_unique_template, run_ghz
from services.launcher.mesh import Mesh, MeshConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODEL = ROOT / "build" / "models" / "minilm" / "1"


CORES = len(os.sched_getaffinity(0))


GOAL = 0.85  # the mesh at 64 callers, as a share of in-process ORT at its best layout


def in_process_throughput(batch_sizes: list[int], seconds: float, tag: str, sessions: int = 1) -> dict[int, float]:
    """Sentences per second of bare ORT (same graph, same tokenizer, padding
    to the longest text of each batch) on the texts ghz would send under
    `tag`: one session with an intra-op thread per core, or `sessions`
    one-thread sessions run side by side by as many threads (ORT releases the
    GIL while it runs)."""
    models = [InProcessMinilm(MODEL, threads=None if sessions == 1 else 1) for _ in range(sessions)]
    pool = ghz_texts(tag, 4000)  # request numbers as a run's phases reach them: one to four digits
    layout = "one session" if sessions == 1 else f"{sessions} one-thread sessions"
    results = {}
    for batch in batch_sizes:
        done = [0] * sessions
        started = time.perf_counter()

        def drive(index: int) -> None:
            offset = index * len(pool) // sessions
            while time.perf_counter() - started < seconds:
                start = (offset + done[index]) % (len(pool) - batch)
                models[index].embed(pool[start : start + batch])
                done[index] += batch

        workers = [threading.Thread(target=drive, args=(i,)) for i in range(sessions)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        results[batch] = sum(done) / (time.perf_counter() - started)
        progress(f"  in-process ORT, {layout}, batch {batch:3d}: {results[batch]:7.1f} sentences/s")
    return results


def ghz_run(router: str, concurrency: int, seconds: float, tag: str) -> dict:
    """`seconds` of ghz with a one-message template whose text differs on every call."""
    report = run_ghz(router, ghz_unique_template(tag), 0, concurrency, seconds=seconds)
    latency = {p["percentage"]: p["latency"] / 1e6 for p in report["latencyDistribution"]}
    ok = report["statusCodeDistribution"].get("OK", 0)
    return {
        "rps": report["rps"],
        "p50_ms": latency[50],
        "p99_ms": latency[99],
        "ok": ok,
        "count": report["count"],
        "seconds": report["total"] / 1e9,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="repetitions; medians are reported")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each mesh phase (ORT: per batch size)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    seed_argument(parser)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    seed = chosen_seed(args.seed)
    phases = ["ort", "ort_sessions", *(f"mesh{c}" for c in levels)]

    runs, orders = [], []
    with Mesh(
        MeshConfig(models=ROOT / "build" / "models", log_dir=tempfile.mkdtemp(prefix="infermesh-bench-"))
    ) as mesh:
        progress(f"mesh up, router {mesh.router}; warming up (seed {seed})")
        ghz_run(mesh.router, 16, 3.0, "warm")
        for run in range(args.runs):
            # In-process ORT is measured in the same run, among the mesh phases,
            # while the idle mesh processes stay resident, as they would.
            order = phase_order(phases, run, seed)
            orders.append(order)
            progress(f"run {run + 1}/{args.runs}: {', '.join(order)}")
            result: dict = {"mesh": {}}
            for phase in order:
                tag = f"run{run}{phase}"
                if phase == "ort":
                    result["ort"] = in_process_throughput([1, 8, 16, 32, 64], args.seconds / 2, tag)
                elif phase == "ort_sessions":
                    result["ort_sessions"] = in_process_throughput(
                        [1, 8, 16, 32], args.seconds / 2, tag, sessions=CORES
                    )
                else:
                    c = int(phase.removeprefix("mesh"))
                    cell = result["mesh"][c] = ghz_run(mesh.router, c, args.seconds, tag)
                    progress(
                        f"  mesh concurrency {c:3d}: {cell['rps']:7.1f} req/s  p50 {cell['p50_ms']:6.2f} ms  "
                        f"p99 {cell['p99_ms']:6.2f} ms  ok {cell['ok']}/{cell['count']} in {cell['seconds']:.1f} s"
                    )
            runs.append(result)

    summary = summarise(runs, levels)
    report = {
        "machine": machine(),
        "command": "python -m bench.throughput " + " ".join(sys.argv[1:]),
        "runs": args.runs,
        "seed": seed,
        "orders": orders,
        "date": time.strftime("%Y-%m-%d"),
        "summary": summary,
        "raw": runs,
    }
    write(args.out, "throughput", report, markdown(report, levels), lambda r, path: plot(r, levels, path))
    return 0


def _best(r: dict) -> float:
    """The best in-process rate of a run, either layout."""
    return max(*r["ort"].values(), *r.get("ort_sessions", {}).values())


def summarise(runs: list[dict], levels: list[int]) -> dict:
    med = statistics.median
    out = {
        "ort_batch1_per_s": med(r["ort"][1] for r in runs),
        "ort_best_per_s": med(max(r["ort"].values()) for r in runs),
        "ort_best_batch": statistics.mode(max(r["ort"], key=r["ort"].get) for r in runs),
        "mesh": {},
    }
    if all("ort_sessions" in r for r in runs):
        out["sessions"] = CORES
        out["ort_sessions_per_s"] = med(max(r["ort_sessions"].values()) for r in runs)
        out["ort_sessions_batch"] = statistics.mode(max(r["ort_sessions"], key=r["ort_sessions"].get) for r in runs)
    out["baseline_per_s"] = med(_best(r) for r in runs)
    for c in levels:
        ratios = [r["mesh"][c]["rps"] / _best(r) for r in runs]  # within each run
        out["mesh"][c] = {
            "rps": med(r["mesh"][c]["rps"] for r in runs),
            "p50_ms": med(r["mesh"][c]["p50_ms"] for r in runs),
            "p99_ms": med(r["mesh"][c]["p99_ms"] for r in runs),
            "errors": sum(r["mesh"][c]["count"] - r["mesh"][c]["ok"] for r in runs),
            "ratio_to_ort_best": med(ratios),
            "ratio_to_ort_best_spread": spread(ratios),
            "ratio_to_one_session": med(r["mesh"][c]["rps"] / max(r["ort"].values()) for r in runs),
        }
    if 64 in levels:
        out["goal"] = {
            "ratio": GOAL,
            "verdict": goal_verdict(out["mesh"][64]["ratio_to_ort_best_spread"]["runs"], lambda v: v >= GOAL),
        }
    return out


def markdown(report: dict, levels: list[int]) -> str:
    s = report["summary"]
    baseline = s.get("baseline_per_s", s["ort_best_per_s"])
    lines = [
        f"Machine: {report['machine']}. Command: `{report['command']}`. "
        f"Medians of {report['runs']} runs on {report['date']}, each run's phases in an order shuffled with seed "
        f"{report.get('seed', '?')}; ratios are taken within each run, their spread (min–max over runs) in brackets. Both "
        "sides embed the same texts (those ghz renders), padded to the longest of each batch.",
        "",
        "| path | concurrency | sentences/s | p50 ms | p99 ms | vs in-process ORT (best) | vs one session (best batch) |",
        "|---|---|---|---|---|---|---|",
        f"| in-process ORT, one session ({CORES} threads), batch 1 | – | {s['ort_batch1_per_s']:.0f} | | | "
        f"{s['ort_batch1_per_s'] / baseline:.2f} | {s['ort_batch1_per_s'] / s['ort_best_per_s']:.2f} |",
        f"| in-process ORT, one session ({CORES} threads), batch {s['ort_best_batch']} (its best) | – | "
        f"{s['ort_best_per_s']:.0f} | | | {s['ort_best_per_s'] / baseline:.2f} | 1.00 |",
    ]
    if "ort_sessions_per_s" in s:
        lines.append(
            f"| in-process ORT, {s['sessions']} one-thread sessions side by side, batch "
            f"{s['ort_sessions_batch']} (their best) | – | {s['ort_sessions_per_s']:.0f} | | | "
            f"{s['ort_sessions_per_s'] / baseline:.2f} | {s['ort_sessions_per_s'] / s['ort_best_per_s']:.2f} |"
        )
    for c in levels:
        m = s["mesh"][str(c)] if str(c) in s["mesh"] else s["mesh"][c]
        lines.append(
            f"| mesh (ghz → router → cache → batcher → model_server) | {c} | {m['rps']:.0f} | "
            f"{m['p50_ms']:.2f} | {m['p99_ms']:.2f} | "
            f"{span(m['ratio_to_ort_best_spread']) if 'ratio_to_ort_best_spread' in m else format(m['ratio_to_ort_best'], '.2f')} | "
            f"{m.get('ratio_to_one_session', m['ratio_to_ort_best']):.2f} |"
        )
    errors = sum((s["mesh"][c]["errors"]) for c in s["mesh"])
    lines.append("")
    lines.append(f"Failed requests over all mesh runs: {errors}.")
    if "goal" in s:
        lines.append(
            f"Goal: the mesh at 64 callers ≥ {s['goal']['ratio']:.2f} of in-process ORT at its best layout: "
            f"{s['goal']['verdict']}."
        )
    return "\n".join(lines) + "\n"


def plot(report: dict, levels: list[int], path: pathlib.Path) -> None:
    plt = pyplot()

    s = report["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    rps = [s["mesh"][c]["rps"] for c in levels]
    left.bar([str(c) for c in levels], rps, color="#4c72b0", label="mesh")
    left.axhline(
        s["ort_best_per_s"],
        color="#c44e52",
        linestyle="--",
        label=f"in-process ORT, one session, best batch ({s['ort_best_batch']})",
    )
    if "ort_sessions_per_s" in s:
        left.axhline(
            s["ort_sessions_per_s"],
            color="#dd8452",
            linestyle="-.",
            label=f"in-process ORT, {s['sessions']} one-thread sessions ({s['ort_sessions_batch']})",
        )
    left.axhline(s["ort_batch1_per_s"], color="#8c8c8c", linestyle=":", label="in-process ORT, batch 1")
    left.set_xlabel("concurrent callers (ghz)")
    left.set_ylabel("sentences / s")
    left.set_title("minilm throughput")
    lines_top = max(s["ort_best_per_s"], s.get("ort_sessions_per_s", 0.0), *rps)
    left.set_ylim(0, 1.55 * lines_top)  # room above the lines for the legend
    left.legend(fontsize=7, loc="upper left")
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
