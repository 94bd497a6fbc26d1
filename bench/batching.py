"""The batcher under load, in one run, on one machine:

A. Batching on vs off (max batch 1) through the mesh at 64 callers, beside the
   same ratio for in-process ONNX Runtime (best batch vs batch 1). Goal: the
   mesh keeps >= 90% of the gain ONNX Runtime itself offers.
B. Overload isolation: standard traffic at 2x the mesh's saturation rate plus
   VIP traffic at 10% of it. Goals: VIP p99 under that load <= 1.5x VIP p99
   alone; no VIP request rejected; excess standard requests rejected in under
   5 ms instead of timing out.

    .venv/bin/python -m bench.batching --runs 3

Writes bench/results/batching.{json,md,png}.
"""

import argparse
import concurrent.futures
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from bench.report import machine, progress, pyplot, write
from bench.workload import InProcessMinilm, ghz_unique_template, texts
from services.launcher.mesh import Mesh

ROOT = pathlib.Path(__file__).resolve().parent.parent
GHZ = ROOT / "bin" / "ghz"
MODEL = ROOT / "build" / "models" / "minilm" / "1"



def ghz(router: str, tag: str, total: int, concurrency: int, rps: float = 0, vip: bool = False,
        timeout_s: float = 20) -> dict:
    argv = [str(GHZ), "--insecure", "--call", "inference.GRPCInferenceService.ModelInfer",
            "-d", ghz_unique_template(tag), "--total", str(total), "--concurrency", str(concurrency),
            "--connections", str(min(concurrency, 4)), "--timeout", f"{timeout_s}s", "--format", "json"]
    if rps:
        argv += ["--rps", str(int(rps))]
    if vip:
        argv += ["-m", '{"x-user-tier": "vip"}']
    report = json.loads(subprocess.run([*argv, router], capture_output=True, text=True, check=True,
                                       timeout=900).stdout)
    ok = sorted(d["latency"] / 1e6 for d in report["details"] if d["status"] == "OK")
    rejected = sorted(d["latency"] / 1e6 for d in report["details"] if d["status"] == "ResourceExhausted")

    def pct(values, p):
        return values[min(len(values) - 1, int(p * len(values)))] if values else float("nan")

    return {"rps": report["rps"], "ok": len(ok), "count": report["count"],
            "statuses": report["statusCodeDistribution"], "p50_ms": pct(ok, 0.5), "p99_ms": pct(ok, 0.99),
            "rejected": len(rejected), "rejected_p50_ms": pct(rejected, 0.5), "rejected_p99_ms": pct(rejected, 0.99)}


def in_process(seconds: float, seed: int) -> dict[int, float]:
    model = InProcessMinilm(MODEL)
    pool = texts(20000, seed)
    rates = {}
    for batch in (1, 8, 16, 32, 64):
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            model.embed(pool[done % 19000:done % 19000 + batch])
            done += batch
        rates[batch] = done / (time.perf_counter() - started)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="rough length of each measurement")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-batching-"))
    runs = []
    with Mesh(models=ROOT / "build" / "models", cache=False, log_dir=work / "on") as on, \
            Mesh(models=ROOT / "build" / "models", cache=False, log_dir=work / "off",
                 batcher_args=("--max-batch-size", "1")) as off:
        progress("meshes up (batching on, batching off); warming up")
        for mesh in (on, off):
            ghz(mesh.router, "warm", 200, 16)
        for run in range(args.runs):
            r = {"ort": in_process(args.seconds / 3, seed=run)}
            guess = int(args.seconds * 160)
            r["on"] = ghz(on.router, f"on{run}", guess, 64)
            r["off"] = ghz(off.router, f"off{run}", int(args.seconds * 100), 64)
            saturation = r["on"]["rps"]
            vip_rps = 0.1 * saturation
            duration = args.seconds
            r["vip_alone"] = ghz(on.router, f"va{run}", int(vip_rps * duration), 8, rps=vip_rps, vip=True)
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                standard = pool.submit(ghz, on.router, f"st{run}", int(2 * saturation * duration), 256,
                                       rps=2 * saturation, timeout_s=2)
                vip = pool.submit(ghz, on.router, f"vl{run}", int(vip_rps * duration), 8, rps=vip_rps, vip=True)
                r["standard_overload"], r["vip_loaded"] = standard.result(), vip.result()
            runs.append(r)
            ort_gain = max(r["ort"].values()) / r["ort"][1]
            mesh_gain = r["on"]["rps"] / r["off"]["rps"]
            progress(f"run {run + 1}/{args.runs}: ORT x{ort_gain:.2f}, mesh x{mesh_gain:.2f} "
                     f"(keeps {(mesh_gain - 1) / (ort_gain - 1):.0%}); VIP p99 {r['vip_alone']['p99_ms']:.0f} -> "
                     f"{r['vip_loaded']['p99_ms']:.0f} ms, VIP rejected {r['vip_loaded']['count'] - r['vip_loaded']['ok']}; "
                     f"standard {r['standard_overload']['statuses']}, rejections p99 "
                     f"{r['standard_overload']['rejected_p99_ms']:.1f} ms")
    report = summarise(runs)
    write(args.out, "batching", report, markdown(report), plot)
    return 0


def summarise(runs: list[dict]) -> dict:
    med = statistics.median
    return {
        "machine": machine(),
        "command": "python -m bench.batching " + " ".join(sys.argv[1:]), "runs": len(runs),
        "date": time.strftime("%Y-%m-%d"),
        "summary": {
            "ort_batch1": med(r["ort"][1] for r in runs),
            "ort_best": med(max(r["ort"].values()) for r in runs),
            "ort_gain": med(max(r["ort"].values()) / r["ort"][1] for r in runs),
            "mesh_on": med(r["on"]["rps"] for r in runs),
            "mesh_off": med(r["off"]["rps"] for r in runs),
            "mesh_gain": med(r["on"]["rps"] / r["off"]["rps"] for r in runs),
            "gain_kept": med((r["on"]["rps"] / r["off"]["rps"] - 1) / (max(r["ort"].values()) / r["ort"][1] - 1)
                             for r in runs),
            "vip_alone_p99_ms": med(r["vip_alone"]["p99_ms"] for r in runs),
            "vip_loaded_p99_ms": med(r["vip_loaded"]["p99_ms"] for r in runs),
            "vip_p99_ratio": med(r["vip_loaded"]["p99_ms"] / r["vip_alone"]["p99_ms"] for r in runs),
            "vip_rejected": sum(r["vip_loaded"]["count"] - r["vip_loaded"]["ok"] for r in runs),
            "standard_rejected_share": med(r["standard_overload"]["rejected"] / r["standard_overload"]["count"]
                                           for r in runs),
            "standard_rejected_p50_ms": med(r["standard_overload"]["rejected_p50_ms"] for r in runs),
            "standard_rejected_p99_ms": med(r["standard_overload"]["rejected_p99_ms"] for r in runs),
            "standard_timeouts": sum(r["standard_overload"]["statuses"].get("DeadlineExceeded", 0) for r in runs),
            "standard_served_p99_ms": med(r["standard_overload"]["p99_ms"] for r in runs),
        },
        "raw": runs,
    }


def markdown(report: dict) -> str:
    s = report["summary"]
    return "\n".join([
        f"Machine: {report['machine']}. Command: `{report['command']}`. Medians of {report['runs']} runs on "
        f"{report['date']}; ratios taken within each run; load from ghz.",
        "",
        "| batching | in-process ORT (sentences/s) | mesh at 64 callers (requests/s) |",
        "|---|---|---|",
        f"| off (batch 1) | {s['ort_batch1']:.0f} | {s['mesh_off']:.0f} |",
        f"| on (ORT: best batch; mesh: defaults) | {s['ort_best']:.0f} | {s['mesh_on']:.0f} |",
        f"| gain | × {s['ort_gain']:.2f} | × {s['mesh_gain']:.2f} |",
        "",
        f"The mesh keeps {s['gain_kept']:.0%} of the gain that batching gives ONNX Runtime itself (goal ≥ 90%; "
        f"the median of the per-run ratios (mesh gain − 1) / (ORT gain − 1)).",
        "",
        "| overload (standard at 2× saturation, VIP at 10% of it) | value | goal |",
        "|---|---|---|",
        f"| VIP p99 alone → under load | {s['vip_alone_p99_ms']:.0f} → {s['vip_loaded_p99_ms']:.0f} ms "
        f"(× {s['vip_p99_ratio']:.2f}) | ≤ × 1.5 |",
        f"| VIP requests rejected | {s['vip_rejected']} | 0 |",
        f"| standard requests rejected at once | {s['standard_rejected_share']:.0%}, p50 "
        f"{s['standard_rejected_p50_ms']:.2f} ms, p99 {s['standard_rejected_p99_ms']:.2f} ms | < 5 ms |",
        f"| standard requests that timed out instead | {s['standard_timeouts']} | 0 |",
        f"| standard requests served: p99 | {s['standard_served_p99_ms']:.0f} ms (their deadline: 2 s) | |",
        "",
    ])


def plot(report: dict, path: pathlib.Path) -> None:
    plt = pyplot()

    s = report["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(["ORT\nbatch 1", "ORT\nbest batch", "mesh\nbatch 1", "mesh\nbatching"],
             [s["ort_batch1"], s["ort_best"], s["mesh_off"], s["mesh_on"]],
             color=["#8c8c8c", "#c44e52", "#8c8c8c", "#4c72b0"])
    left.set_ylabel("per second")
    left.set_title(f"batching gain: ORT x{s['ort_gain']:.2f}, mesh x{s['mesh_gain']:.2f}")
    right.bar(["VIP alone", "VIP under\noverload", "standard\nrejections"],
              [s["vip_alone_p99_ms"], s["vip_loaded_p99_ms"], s["standard_rejected_p99_ms"]],
              color=["#55a868", "#4c72b0", "#dd8452"])
    right.set_ylabel("p99 latency, ms")
    right.set_title("overload isolation")
    fig.suptitle(f"{report['machine']}; medians of {report['runs']} runs", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
