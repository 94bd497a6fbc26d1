"""The cache under realistic and hostile workloads, measured side by side in one run.

    .venv/bin/python -m bench.cache_bench --runs 3

- Zipf (s = 1.1) over 10,000 distinct texts: hit rate per level, throughput,
  p50/p99, with the cache and without it.
- All-unique texts: what the cache costs when it can never help (goal <= 5%),
  with automatic bypass (the default) and with it switched off.
- Cache-hit latency through the router at one caller (goal p50 <= 1 ms), from
  the router's memory (the default) and from Redis.

Each run has every phase once, in an order shuffled by --seed (recorded in
the report), and starts from the same state: new texts every run (a cold
cache for the Zipf workload, no entry of an earlier run to hit), and the
all-unique mesh's automatic bypass engaged before every run (its steady state
under such traffic: the warm-up engages it, and each run checks it still is).
Writes bench/results/cache.{json,md,png}.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench import loadgen
from bench.report import chosen_seed, goal_verdict, machine, phase_order, progress, pyplot, seed_argument, spread, write
from bench.workload import ghz_data, texts
from services.launcher.mesh import Mesh, MeshConfig
from tests.conftest import metric

ROOT = pathlib.Path(__file__).resolve().parent.parent
GHZ = ROOT / "bin" / "ghz"
DISTINCT = 10_000
UNIQUE_COST_GOAL = 0.05  # what the cache may cost throughput when it can never help
PHASES = (
    "zipf_plain",
    "zipf_cached",
    "unique_plain",
    "unique_cached",
    "unique_nobypass",
    "hit_latency",
    "hit_latency_l1",
)


def zipf_sequence(count: int, seed: int, s: float = 1.1) -> list[str]:
    pool = texts(DISTINCT, seed=seed)
    ranks = np.arange(1, DISTINCT + 1)
    weights = ranks**-s
    picks = np.random.default_rng(seed).choice(DISTINCT, size=count, p=weights / weights.sum())
    return [pool[i] for i in picks]


def ghz_hits(router: str, hot: list[str], total: int = 2000) -> dict:
    """A small hot set, cycled at one caller by ghz. Each text comes back only
    after the others (> 50 ms later), so no answer is single-flight's linger;
    a data file this small costs ghz little per call."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as data:
        data.write(ghz_data(hot))
    try:
        out = subprocess.run(
            [
                str(GHZ),
                "--insecure",
                "--call",
                "inference.GRPCInferenceService.ModelInfer",
                "--data-file",
                data.name,
                "--total",
                str(total),
                "--concurrency",
                "1",
                "--format",
                "json",
                router,
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        ).stdout
    finally:
        os.unlink(data.name)
    report = json.loads(out)
    latency = {p["percentage"]: p["latency"] / 1e6 for p in report["latencyDistribution"]}
    return {
        "rps": report["rps"],
        "p50_ms": latency[50],
        "p99_ms": latency[99],
        "errors": report["count"] - report["statusCodeDistribution"].get("OK", 0),
    }


def load(router: str, items: list[str], concurrency: int) -> dict:
    return loadgen.run(router, loadgen.serialise(items), concurrency)


def cache_levels(mesh: Mesh) -> dict[str, float]:
    url = mesh.metrics_url("cache")
    return {
        level: metric(url, "infermesh_cache_lookups_total", level=level, result="hit") for level in ("l1", "l2")
    } | {
        "miss": metric(url, "infermesh_cache_lookups_total", result="miss"),
        "shared": metric(mesh.router_metrics, "infermesh_router_cache_lookups_total", result="shared"),
        "near": metric(mesh.router_metrics, "infermesh_router_cache_lookups_total", result="near_hit"),
    }


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def bypassed(mesh: Mesh, model: str = "minilm") -> bool:
    return metric(mesh.router_metrics, "infermesh_router_cache_bypassed", model=model) == 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--zipf-requests", type=int, default=4000)
    parser.add_argument("--unique-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    seed_argument(parser)
    args = parser.parse_args()
    seed = chosen_seed(args.seed)
    models = ROOT / "build" / "models"
    work = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-cache-bench-"))
    c = args.concurrency
    runs, orders = [], []
    # Four meshes side by side; only the one being measured gets traffic. The
    # unique workloads get meshes of their own: they would (rightly) switch on
    # the automatic bypass of a mesh that the Zipf workload then measures.
    with (
        Mesh(MeshConfig(models=models, cache=False, log_dir=work / "plain")) as plain,
        Mesh(MeshConfig(models=models, l2_path=work / "l2", log_dir=work / "cached")) as cached,
        Mesh(MeshConfig(models=models, l2_path=work / "l2-unique", log_dir=work / "unique")) as unique_mesh,
        Mesh(
            MeshConfig(
                models=models,
                l2_path=work / "l2-nobypass",
                log_dir=work / "nobypass",
                router_args=("--cache-min-hit-rate", "0", "--near-cache-ttl-s", "0"),
            )
        ) as nobypass,
    ):
        progress(f"four meshes up; warming up (seed {seed})")
        for mesh in (plain, cached, nobypass):
            load(mesh.router, texts(200, seed=7), 8)
        load(unique_mesh.router, texts(1000, seed=8), 8)  # past its bypass window: engaged, as in every run
        for run in range(args.runs):
            text_seed = 1000 + run  # new texts every run: every run starts with a cold cache
            sequence = zipf_sequence(args.zipf_requests, text_seed)
            unique = texts(args.unique_requests, seed=text_seed + 500)
            hot = texts(100, seed=text_seed + 900)
            order = phase_order(PHASES, run, seed)
            orders.append(order)
            result = {"bypass_engaged_before": bypassed(unique_mesh)}
            for phase in order:
                if phase == "zipf_plain":
                    result[phase] = load(plain.router, sequence, c)
                elif phase == "zipf_cached":
                    before = cache_levels(cached)
                    result[phase] = load(cached.router, sequence, c)
                    result["zipf_levels"] = delta(cache_levels(cached), before)
                elif phase == "unique_plain":
                    result[phase] = load(plain.router, unique, c)
                elif phase == "unique_cached":
                    result[phase] = load(unique_mesh.router, unique, c)
                elif phase == "unique_nobypass":
                    result[phase] = load(nobypass.router, unique, c)
                else:  # a hot set answered from the router's memory, or (near cache off) from Redis
                    mesh = cached if phase == "hit_latency" else nobypass
                    load(mesh.router, hot, 1)
                    result[phase] = ghz_hits(mesh.router, hot)
            if not result["bypass_engaged_before"]:
                progress("the all-unique mesh's bypass was not engaged at the start of this run")
            runs.append(result)
            z = result["zipf_levels"]
            lookups = z["l1"] + z["l2"] + z["miss"] + z["near"]
            progress(
                f"run {run + 1}/{args.runs} ({', '.join(order)}): zipf {result['zipf_plain']['rps']:.0f} -> "
                f"{result['zipf_cached']['rps']:.0f} req/s (near {z['near'] / lookups:.0%}, "
                f"l1 {z['l1'] / lookups:.0%}, l2 {z['l2'] / lookups:.0%}); "
                f"unique {result['unique_plain']['rps']:.0f} / {result['unique_cached']['rps']:.0f} / "
                f"{result['unique_nobypass']['rps']:.0f} req/s; hit p50 {result['hit_latency']['p50_ms']:.2f} ms "
                f"(router memory), {result['hit_latency_l1']['p50_ms']:.2f} ms (Redis)"
            )
    report = summarise(runs, args)
    report.update(seed=seed, orders=orders)
    write(args.out, "cache", report, markdown(report), plot)
    return 0


def summarise(runs: list[dict], args) -> dict:
    med = statistics.median

    def m(key, field):
        return med(r[key][field] for r in runs)

    def rate(r, level):
        z = r["zipf_levels"]
        return z[level] / max(z["near"] + z["l1"] + z["l2"] + z["miss"], 1)

    return {
        "machine": machine(),
        "command": "python -m bench.cache_bench " + " ".join(sys.argv[1:]),
        "runs": len(runs),
        "date": time.strftime("%Y-%m-%d"),
        "concurrency": args.concurrency,
        "zipf_requests": args.zipf_requests,
        "unique_requests": args.unique_requests,
        "summary": {
            **{
                f"{k}_{f}": m(k, f)
                for k in (
                    "zipf_plain",
                    "zipf_cached",
                    "unique_plain",
                    "unique_cached",
                    "unique_nobypass",
                    "hit_latency",
                    "hit_latency_l1",
                )
                for f in ("rps", "p50_ms", "p99_ms")
            },
            "zipf_near_hit_rate": med(rate(r, "near") for r in runs),
            "zipf_l1_hit_rate": med(rate(r, "l1") for r in runs),
            "zipf_l2_hit_rate": med(rate(r, "l2") for r in runs),
            "zipf_shared": med(r["zipf_levels"]["shared"] for r in runs),
            "zipf_speedup": med(r["zipf_cached"]["rps"] / r["zipf_plain"]["rps"] for r in runs),
            "unique_cost": med(1 - r["unique_cached"]["rps"] / r["unique_plain"]["rps"] for r in runs),
            "unique_cost_spread": spread([1 - r["unique_cached"]["rps"] / r["unique_plain"]["rps"] for r in runs]),
            "unique_cost_goal": goal_verdict(
                [1 - r["unique_cached"]["rps"] / r["unique_plain"]["rps"] for r in runs],
                lambda cost: cost <= UNIQUE_COST_GOAL,
            ),
            "unique_cost_nobypass": med(1 - r["unique_nobypass"]["rps"] / r["unique_plain"]["rps"] for r in runs),
            "unique_cost_nobypass_spread": spread(
                [1 - r["unique_nobypass"]["rps"] / r["unique_plain"]["rps"] for r in runs]
            ),
            "zipf_speedup_spread": spread([r["zipf_cached"]["rps"] / r["zipf_plain"]["rps"] for r in runs]),
            "bypass_engaged_every_run": all(r.get("bypass_engaged_before") for r in runs),
            "errors": sum(r[k]["errors"] for r in runs for k in PHASES),
        },
        "raw": runs,
    }


def markdown(report: dict) -> str:
    s = report["summary"]
    return "\n".join(
        [
            f"Machine: {report['machine']}. Command: `{report['command']}`. Medians of {report['runs']} runs on "
            f"{report['date']}; load from bench/loadgen.py (closed loop, concurrency {report['concurrency']}), hit latency "
            f"from ghz; each run's phases in an order shuffled with seed {report.get('seed', '?')}; ratios taken within "
            "each run, their spread (min–max over runs) in brackets.",
            "",
            "| workload | mesh | requests/s | p50 ms | p99 ms |",
            "|---|---|---|---|---|",
            f"| Zipf 1.1 over 10,000 texts ({report['zipf_requests']} requests) | no cache | {s['zipf_plain_rps']:.0f} | "
            f"{s['zipf_plain_p50_ms']:.1f} | {s['zipf_plain_p99_ms']:.1f} |",
            f"| | cache (cold at start) | {s['zipf_cached_rps']:.0f} | {s['zipf_cached_p50_ms']:.1f} | {s['zipf_cached_p99_ms']:.1f} |",
            f"| all unique ({report['unique_requests']} requests) | no cache | {s['unique_plain_rps']:.0f} | "
            f"{s['unique_plain_p50_ms']:.1f} | {s['unique_plain_p99_ms']:.1f} |",
            f"| | cache, automatic bypass (default) | {s['unique_cached_rps']:.0f} | {s['unique_cached_p50_ms']:.1f} | "
            f"{s['unique_cached_p99_ms']:.1f} |",
            f"| | cache, bypass off | {s['unique_nobypass_rps']:.0f} | {s['unique_nobypass_p50_ms']:.1f} | "
            f"{s['unique_nobypass_p99_ms']:.1f} |",
            f"| one hot request, 1 caller (ghz) | cache: router memory (default) | {s['hit_latency_rps']:.0f} | "
            f"{s['hit_latency_p50_ms']:.2f} | {s['hit_latency_p99_ms']:.2f} |",
            f"| | cache: Redis (router memory off) | {s['hit_latency_l1_rps']:.0f} | "
            f"{s['hit_latency_l1_p50_ms']:.2f} | {s['hit_latency_l1_p99_ms']:.2f} |",
            "",
            f"Zipf: hit rate router memory {s['zipf_near_hit_rate']:.1%}, L1 (Redis) {s['zipf_l1_hit_rate']:.1%}, "
            f"L2 (disk) {s['zipf_l2_hit_rate']:.1%}; "
            f"{s['zipf_shared']:.0f} requests joined an identical one in flight; throughput × {_span(s, 'zipf_speedup', '{:.2f}')}. "
            f"All unique: the cache costs {_span(s, 'unique_cost', '{:.1%}')} of throughput with automatic bypass "
            f"(engaged at the start of every run: {s.get('bypass_engaged_every_run', '?')}; goal ≤ {UNIQUE_COST_GOAL:.0%}: "
            f"{s.get('unique_cost_goal', '?')}), {_span(s, 'unique_cost_nobypass', '{:.1%}')} without it. "
            f"Failed requests: {s['errors']}.",
            "",
        ]
    )


def _span(s: dict, key: str, fmt: str) -> str:
    """A summary figure with its spread over runs, where the report has one."""
    found = s.get(f"{key}_spread")
    if not found:
        return fmt.format(s[key])
    return f"{fmt.format(found['median'])} ({fmt.format(found['min'])} to {fmt.format(found['max'])})"


def plot(report: dict, path: pathlib.Path) -> None:
    plt = pyplot()

    s = report["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = ["Zipf\nno cache", "Zipf\ncache", "unique\nno cache", "unique\ncache", "unique\ncache,\nno bypass"]
    keys = ["zipf_plain", "zipf_cached", "unique_plain", "unique_cached", "unique_nobypass"]
    left.bar(labels, [s[f"{k}_rps"] for k in keys], color=["#8c8c8c", "#4c72b0", "#8c8c8c", "#4c72b0", "#dd8452"])
    left.set_ylabel("requests / s")
    left.set_title("throughput")
    left.tick_params(axis="x", labelsize=8)
    x = np.arange(len(keys))
    right.bar(x - 0.2, [s[f"{k}_p50_ms"] for k in keys], 0.4, label="p50")
    right.bar(x + 0.2, [s[f"{k}_p99_ms"] for k in keys], 0.4, label="p99")
    right.set_xticks(x, labels, fontsize=8)
    right.set_ylabel("ms")
    right.set_title("latency")
    right.legend()
    fig.suptitle(
        f"{report['machine']}; medians of {report['runs']} runs; concurrency {report['concurrency']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
