"""Fair share between two tenants of one tier: does a flood from one tenant
take the other's share?

Two standard tenants send minilm distinct short texts. "steady" sends 30% of
the mesh's capacity (measured first: ghz, 64 callers, closed loop); "flood"
sends five times its share (its share: half the capacity). Three meshes up
side by side, each with both tenants' keys:

- one queue: both keys belong to one tenant, so the batcher sees one FIFO
  queue per level (what the mesh did before tenants);
- fair queueing: two tenants of weight 1; the batcher's level is shared by
  start-time fair queueing, and a full level admits a tenant below its share;
- fair queueing + rate limits: as above, and the router holds each tenant
  to its share (a token bucket of capacity/2 rows a second).

Each run has, per mesh, three phases in a seeded shuffled order: steady
alone; steady beside a neighbour that sends exactly its share; steady beside
the flood. Reported: steady's p50/p99 and failures, its p99 with the flood over
its p99 alone (the issue's goal: at most 1.5) and over its p99 beside the
well-behaved neighbour (what the flood's excess costs it), and what the flood
got (served, refused with RESOURCE_EXHAUSTED).

    .venv/bin/python -m bench.fairness --runs 3

Writes bench/results/fairness.{json,md,png}.
"""

import argparse
import concurrent.futures
import pathlib
import sys
import tempfile
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
from bench.workload import ghz_unique_template, run_ghz
from services.common import identity
from services.launcher.mesh import Mesh, MeshConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
MESHES = ("one_queue", "fair", "fair_limited")
LABELS = {"one_queue": "one queue (one tenant)", "fair": "fair queueing", "fair_limited": "fair queueing + rate limits"}
STEADY_SHARE = 0.3  # of capacity, sent by the steady tenant
FLOOD_FACTOR = 5.0  # the flood's rate over its share
GOAL_P99_RATIO = 1.5
KEYS = {"steady": identity.new_key(), "flood": identity.new_key()}


def registry(kind: str, capacity: float) -> dict:
    """The tenant registry of one mesh (see the module's docstring)."""
    if kind == "one_queue":
        return {"anonymous": "refuse", "tenants": {"shared": {"keys": [identity.hash_key(k) for k in KEYS.values()]}}}
    limits = (
        {"rate_per_s": round(capacity / 2, 1), "burst": max(1.0, round(capacity / 10))}
        if kind == "fair_limited"
        else {}
    )
    return {
        "anonymous": "refuse",
        "tenants": {name: {"keys": [identity.hash_key(key)], **limits} for name, key in KEYS.items()},
    }


def summary_of(report: dict) -> dict:
    details = report["details"]
    ok = sorted(d["latency"] / 1e6 for d in details if d["status"] == "OK")

    def pct(p):
        return ok[min(len(ok) - 1, int(p * len(ok)))] if ok else float("nan")

    return {
        "count": len(details),
        "ok": len(ok),
        "ok_rps": len(ok) / (report["total"] / 1e9),
        "codes": report["statusCodeDistribution"],
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
        "refused": sum(1 for d in details if d["status"] == "ResourceExhausted"),
    }


# What the other tenant sends in each phase, as a share of capacity: nothing; its half share
# (a neighbour within its share); five times that (the flood).
PHASES = {"alone": 0.0, "neighbour": 0.5, "flooded": FLOOD_FACTOR / 2}


def phase(mesh: Mesh, tag: str, capacity: float, seconds: float, other_share: float) -> dict:
    steady_rps = STEADY_SHARE * capacity
    other_rps = other_share * capacity
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        steady = pool.submit(
            run_ghz,
            mesh.router,
            ghz_unique_template(f"s{tag}"),
            int(steady_rps * seconds),
            16,
            steady_rps,
            10,
            KEYS["steady"],
        )
        other = (
            pool.submit(
                run_ghz,
                mesh.router,
                ghz_unique_template(f"f{tag}"),
                int(other_rps * seconds),
                64,
                other_rps,
                10,
                KEYS["flood"],
            )
            if other_rps
            else None
        )
        result = {"steady": summary_of(steady.result())}
        if other is not None:
            result["flood"] = summary_of(other.result())
    return result


def summarise(runs: list[dict], capacity: float) -> dict:
    summary = {}
    for kind in MESHES:
        alone = [r[kind]["alone"]["steady"] for r in runs]
        near = [r[kind]["neighbour"]["steady"] for r in runs]
        both = [r[kind]["flooded"]["steady"] for r in runs]
        floods = [r[kind]["flooded"]["flood"] for r in runs]
        ratios = [b["p99_ms"] / a["p99_ms"] for a, b in zip(alone, both, strict=True)]
        over_neighbour = [b["p99_ms"] / n["p99_ms"] for n, b in zip(near, both, strict=True)]
        summary[kind] = {
            "alone_p50_ms": spread(a["p50_ms"] for a in alone),
            "alone_p99_ms": spread(a["p99_ms"] for a in alone),
            "flooded_p50_ms": spread(b["p50_ms"] for b in both),
            "flooded_p99_ms": spread(b["p99_ms"] for b in both),
            "neighbour_p99_ms": spread(n["p99_ms"] for n in near),
            "over_neighbour": spread(over_neighbour),
            "steady_failed": sum(c["count"] - c["ok"] for c in (*alone, *near, *both)),
            "steady_sent": sum(c["count"] for c in (*alone, *near, *both)),
            "p99_ratio": spread(ratios),
            "verdict": goal_verdict(ratios, lambda v: v <= GOAL_P99_RATIO),
            "flood_ok_rps": spread(f["ok_rps"] for f in floods),
            "flood_refused_share": spread(f["refused"] / f["count"] for f in floods),
            "flood_other_failures": sum(f["count"] - f["ok"] - f["refused"] for f in floods),
        }
    return {
        "machine": machine(),
        "command": "python -m bench.fairness " + " ".join(sys.argv[1:]),
        "runs": len(runs),
        "date": time.strftime("%Y-%m-%d"),
        "capacity_rps": capacity,
        "steady_rps": STEADY_SHARE * capacity,
        "flood_rps": FLOOD_FACTOR * capacity / 2,
        "goal_p99_ratio": GOAL_P99_RATIO,
        "summary": summary,
        "raw": runs,
    }


def markdown(report: dict) -> str:
    s = report["summary"]
    lines = [
        f"Machine: {report['machine']}. Command: `{report['command']}`. {report['runs']} runs on {report['date']}, "
        f"phases in a seeded shuffled order (seed {report['seed']}); medians with the min–max over runs.",
        "",
        f"minilm, distinct short texts. Capacity measured first: {report['capacity_rps']:.0f} requests/s (ghz, 64 "
        f"callers, closed loop). Two standard tenants: steady at {report['steady_rps']:.0f}/s "
        f"({STEADY_SHARE:.0%} of capacity), flood at {report['flood_rps']:.0f}/s (five times its half share).",
        "",
        "| mesh | steady p99 alone | with a neighbour at its share | with the flood | flood × alone (goal ≤ 1.5) "
        "| flood × neighbour | steady p50 alone → flooded | steady failed | flood served/s "
        "| flood refused (RESOURCE_EXHAUSTED) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in MESHES:
        c = s[kind]
        lines.append(
            f"| {LABELS[kind]} | {span(c['alone_p99_ms'], '{:.0f}')} ms | {span(c['neighbour_p99_ms'], '{:.0f}')} ms "
            f"| {span(c['flooded_p99_ms'], '{:.0f}')} ms | {span(c['p99_ratio'])} ({c['verdict']}) "
            f"| {span(c['over_neighbour'])} | {c['alone_p50_ms']['median']:.0f} → "
            f"{c['flooded_p50_ms']['median']:.0f} ms | {c['steady_failed']} of {c['steady_sent']} "
            f"| {span(c['flood_ok_rps'], '{:.0f}')} | {span(c['flood_refused_share'], '{:.0%}')} "
            f"(other failures: {c['flood_other_failures']}) |"
        )
    lines += [
        "",
        "- one queue: both keys are one tenant's, so the batcher's level is FIFO and the flood's backlog "
        "is the steady tenant's wait, until admission control refuses what would miss its deadline.",
        "- fair queueing: the steady tenant's requests start next to the head of the level whatever the "
        "flood has queued, and the flood waits behind its own backlog (with ghz's 10 s deadline, admission "
        "refuses none of it).",
        "- rate limits: the router refuses the flood's excess before it costs the batcher anything, with a "
        "retry hint (retry-after-ms).",
        "- Why the steady tenant still waits: execution is not preemptive, so under load every request waits "
        "for the batch running on its instance (up to a full batch of 32 rows), whatever its place in the "
        "queue; and on this 2-core machine the flood's refusals and ghz's own calls take CPU from the model "
        "(the fuzz section of hardening.md puts a refusal through a running router near 1 ms of CPU).",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    fig, axis = plt.subplots(figsize=(8, 4))
    s = report["summary"]
    x = range(len(MESHES))
    bars = (
        ("alone_p99_ms", "steady alone"),
        ("neighbour_p99_ms", "a neighbour at its share"),
        ("flooded_p99_ms", "the flood"),
    )
    for offset, (key, label) in enumerate(bars):
        values = [s[k][key]["median"] for k in MESHES]
        errors = [
            [v - s[k][key]["min"] for v, k in zip(values, MESHES, strict=True)],
            [s[k][key]["max"] - v for v, k in zip(values, MESHES, strict=True)],
        ]
        axis.bar([i + 0.27 * offset for i in x], values, 0.27, yerr=errors, capsize=3, label=label)
    axis.set_xticks([i + 0.27 for i in x], [LABELS[k] for k in MESHES], fontsize=8)
    axis.set(ylabel="steady tenant's p99 (ms)", title="a flood from another tenant of the same tier")
    axis.legend()
    save_figure(fig, path, report, "two tenants")


def measure(runs: int, seconds: float, seed: int) -> dict:
    """The whole measurement (see the module's docstring); the report's rows are
    in its summary, every phase's figures in its raw."""
    work = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-fairness-"))
    models = ROOT / "build" / "models"
    with Mesh(MeshConfig(models=models, cache=False, log_dir=work / "probe")) as probe:
        run_ghz(probe.router, ghz_unique_template("warm"), 200, 16)
        capacity = summary_of(
            run_ghz(probe.router, ghz_unique_template("capacity"), 0, 64, seconds=seconds, timeout_s=10)
        )["ok_rps"]
    progress(
        f"capacity {capacity:.0f} requests/s; steady {STEADY_SHARE * capacity:.0f}/s, flood "
        f"{FLOOD_FACTOR * capacity / 2:.0f}/s"
    )
    meshes = {}
    for kind in MESHES:
        path = work / f"{kind}.yaml"
        identity.write_registry(path, registry(kind, capacity))
        meshes[kind] = Mesh(MeshConfig(models=models, cache=False, log_dir=work / kind, tenants_file=path))
    try:
        for mesh in meshes.values():
            mesh.start()
            run_ghz(mesh.router, ghz_unique_template("warm"), 200, 16, key=KEYS["steady"])
        results, orders = [], []
        for run in range(runs):
            result = {kind: {} for kind in MESHES}
            order = phase_order([(kind, name) for kind in MESHES for name in PHASES], run, seed)
            orders.append([f"{kind}/{name}" for kind, name in order])
            for kind, name in order:
                flood = name != "alone"
                cell = result[kind][name] = phase(meshes[kind], f"{run}{kind}{name}", capacity, seconds, PHASES[name])
                steady = cell["steady"]
                extra = (
                    f"; other {cell['flood']['ok_rps']:.0f}/s served, {cell['flood']['refused']} refused"
                    if flood
                    else ""
                )
                progress(
                    f"run {run + 1}/{runs}: {LABELS[kind]}, {name}: steady "
                    f"p50 {steady['p50_ms']:.0f} ms p99 {steady['p99_ms']:.0f} ms, "
                    f"{steady['count'] - steady['ok']} failed{extra}"
                )
            results.append(result)
    finally:
        for mesh in meshes.values():
            mesh.stop()
    report = summarise(results, capacity)
    report.update(seed=seed, orders=orders)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    seed_argument(parser)
    args = parser.parse_args()
    report = measure(args.runs, args.seconds, chosen_seed(args.seed))
    write(args.out, "fairness", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
