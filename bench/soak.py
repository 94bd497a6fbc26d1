"""A soak: `--minutes` at `--share` of saturation; memory growth, errors, drift.

One mesh as `make run` starts it. Its capacity is measured first (ghz, 64
callers, closed loop, distinct minilm texts); then ghz sends distinct minilm
texts open loop at `--share` of it, one ghz run a minute back to back, beside
a light accounted mixed load (bench/chaos_load: 4 callers, about 10
requests a second in all, unary and streams, VIP and standard, minilm and
mlp, repeats; every request accounted for and a sample checked against ONNX
Runtime); ghz sends the rest of the rate. Every service's RSS is
sampled every second. Reported: per minute, ghz's p50/p99 and its non-OK
answers, and each service's median RSS; the growth of each service's RSS from
the second minute to the last (the first holds the warm-up: arenas, caches,
the model's buffers), the drift of the p99 (last minutes over first), and the
mixed load's accounting.

    .venv/bin/python -m bench.soak --minutes 30          (make soak)

Writes bench/results/soak.{json,md,png}.
"""

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

from bench.chaos_load import ChaosLoad, LoadConfig, Reference
from bench.inflight import RssSampler, ghz_summary, others
from bench.report import cpu_times, machine, process_cpu_s, progress, pyplot, save_figure, write
from bench.workload import ghz_unique_template, run_ghz
from services.launcher.mesh import Mesh, MeshConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
PROBE_CALLERS, PROBE_RPS = 4, 10.0  # the accounted mixed load beside ghz


class OtherLoad:
    """The share of the machine's CPU that neither the mesh nor this benchmark
    (ghz included, as its child) used since the last reading: another program's
    load, which a soak's latency figures must be read against."""

    def __init__(self, mesh: Mesh):
        self._pids = [p.popen.pid for p in mesh.processes.values()]
        self._last = self._reading()

    def _reading(self) -> tuple[list[int] | None, float]:
        ours = sum(_cpu_s(pid) for pid in self._pids)
        times = os.times()
        return cpu_times(), ours + times.user + times.system + times.children_user + times.children_system

    def share(self) -> float | None:
        (before, ours_before), (after, ours_after) = self._last, self._reading()
        self._last = (after, ours_after)
        if before is None or after is None:
            return None
        spent = [b - a for a, b in zip(before, after, strict=True)]
        total_s = sum(spent) / os.sysconf("SC_CLK_TCK")
        busy_s = total_s - (spent[3] + spent[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait
        return max(0.0, busy_s - (ours_after - ours_before)) / total_s if total_s else 0.0


def _cpu_s(pid: int) -> float:
    try:
        return process_cpu_s(pid)
    except OSError:
        return 0.0


def minute_row(index: int, ghz: dict, rss: list[dict[str, int]], other_cpu: float | None = None) -> dict:
    ok = ghz["statuses"].get("OK", {})
    return {
        "minute": index + 1,
        "other_cpu_share": other_cpu,
        "sent": ghz["sent"],
        "ok": ok.get("count", 0),
        "p50_ms": ok.get("p50_ms"),
        "p99_ms": ok.get("p99_ms"),
        "errors": {s: v["count"] for s, v in ghz["statuses"].items() if s != "OK"},
        "rss_bytes": {name: int(statistics.median(s[name] for s in rss)) for name in (rss[0] if rss else {})},
    }


async def soak(mesh: Mesh, rate: float, minutes: int, reference: Reference) -> dict:
    # Light: about PROBE_RPS in all (a pause before each request), so that ghz's share stays the load.
    probe = ChaosLoad(
        mesh.router,
        LoadConfig(callers=PROBE_CALLERS, stream_window=1, timeout_s=10.0, think_s=PROBE_CALLERS / PROBE_RPS),
        {"vip": mesh.credentials("dev-vip"), "standard": mesh.credentials("dev-standard")},
        reference=reference,
    )
    rows = []
    other = OtherLoad(mesh)
    with RssSampler(mesh, period_s=1.0) as rss:
        running = asyncio.create_task(probe.run(60.0 * minutes))
        await probe.started.wait()
        for index in range(minutes):
            began = time.monotonic()
            report = await asyncio.to_thread(
                run_ghz,
                mesh.router,
                ghz_unique_template(f"soak{index}"),
                0,
                256,
                rps=rate - PROBE_RPS,
                timeout_s=10,
                seconds=60,
                key=mesh.keys["dev-standard"],
            )
            row = minute_row(index, ghz_summary(report), [s for t, s in rss.samples if t >= began], other.share())
            rows.append(row)
            progress(
                f"minute {index + 1}/{minutes}: other programs' CPU {_percent(row['other_cpu_share'])}, "
                f"{row['ok']} OK, p99 {row['p99_ms']:.0f} ms, errors "
                f"{row['errors'] or 0}, RSS " + ", ".join(f"{n} {v / MIB:.0f} MiB" for n, v in row["rss_bytes"].items())
            )
        probe.stop()
        result = await running
    return {"minutes": rows, "probe": result.totals}


def _other_line(rows: list[dict]) -> str:
    """What other programs took of the CPU while the soak ran (a measured soak is a quiet one)."""
    shares = [r.get("other_cpu_share") for r in rows]
    if any(share is None for share in shares):
        return "Other programs' CPU use was not measured in this run.\n"
    busy = [r["minute"] for r in rows if r["other_cpu_share"] > 0.05]
    return (
        f"Other programs took {statistics.median(shares):.0%} of the CPU at the median minute, at most "
        f"{max(shares):.0%}"
        + (f" (over 5% in minutes {busy[0]}-{busy[-1]}: read their latency against it)" if busy else "")
        + ".\n"
    )


def _percent(share: float | None) -> str:
    return "?" if share is None else f"{share:.0%}"


def summarise(rows: list[dict]) -> dict:
    first, last = rows[min(1, len(rows) - 1)], rows[-1]
    head = [r["p99_ms"] for r in rows[1:4] if r["p99_ms"] is not None] or [rows[0]["p99_ms"]]
    tail = [r["p99_ms"] for r in rows[-3:] if r["p99_ms"] is not None]
    return {
        "rss_growth_bytes": {n: last["rss_bytes"][n] - first["rss_bytes"][n] for n in last["rss_bytes"]},
        "rss_first_bytes": first["rss_bytes"],
        "rss_last_bytes": last["rss_bytes"],
        "errors": sum(sum(r["errors"].values()) for r in rows),
        "sent": sum(r["sent"] for r in rows),
        "p99_first_ms": statistics.median(head),
        "p99_last_ms": statistics.median(tail),
        "p99_drift": statistics.median(tail) / statistics.median(head),
    }


def markdown(report: dict) -> str:
    s, p = report["summary"], report["probe"]
    lines = [
        f"# Soak: {len(report['minutes'])} minutes at {report['share']:.0%} of saturation",
        "",
        f"Machine: {report['machine']}. Command: `{report['command']}`. One run. Capacity (ghz, 64 callers, "
        f"closed loop): {report['capacity_rps']:.0f} requests/s; the soak sends {report['rate_rps']:.0f}/s open "
        f"loop in all: ghz's distinct minilm texts and about {PROBE_RPS:g}/s from 4 accounted mixed callers.",
        "",
        f"ghz: {s['sent']} sent, **{s['errors']} not OK**. p99 of the first minutes (2-4) {s['p99_first_ms']:.0f} ms, "
        f"of the last three {s['p99_last_ms']:.0f} ms: drift x{s['p99_drift']:.2f}.",
        "",
        f"Mixed load: {p['sent']} sent, {p['ok']} OK, other answers {others(p)}, "
        f"**{p['unanswered']} unanswered, {p['twice']} twice, {p['wrong']} wrong** of {p['checked']} checked.",
        "",
        _other_line(report["minutes"]),
        "| service | RSS in minute 2 | RSS in the last minute | growth |",
        "|---|---|---|---|",
    ]
    for name, growth in s["rss_growth_bytes"].items():
        lines.append(
            f"| {name} | {s['rss_first_bytes'][name] / MIB:.0f} MiB | {s['rss_last_bytes'][name] / MIB:.0f} MiB"
            f" | {growth / MIB:+.1f} MiB |"
        )
    lines += ["", "Per minute: soak.json (`minutes`); RSS and p99 over time: soak.png.", ""]
    return "\n".join(lines)


def plot(report: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    rows = report["minutes"]
    fig, (memory, latency) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    minutes = [r["minute"] for r in rows]
    base = rows[min(1, len(rows) - 1)]["rss_bytes"]  # minute 2: after the warm-up
    for name in rows[0]["rss_bytes"]:
        memory.plot(
            minutes,
            [(r["rss_bytes"][name] - base[name]) / MIB for r in rows],
            label=f"{name} ({base[name] / MIB:.0f} MiB in minute 2)",
        )
    memory.set_ylabel("RSS since minute 2 (MiB)")
    memory.legend(fontsize=8)
    latency.plot(minutes, [r["p99_ms"] for r in rows], label="p99", color="tab:orange")
    latency.plot(minutes, [r["p50_ms"] for r in rows], label="p50", color="tab:blue")
    latency.set(ylabel="ghz latency (ms)", xlabel="minute")
    shares = [r.get("other_cpu_share") for r in rows]
    if all(share is not None for share in shares):
        other = latency.twinx()
        other.fill_between(minutes, [100 * share for share in shares], color="grey", alpha=0.2, step="mid")
        other.set(ylabel="other programs' CPU (%)", ylim=(0, 100))
    latency.legend(fontsize=8)
    save_figure(fig, path, {**report, "runs": 1}, f"soak at {report['share']:.0%} of saturation")


async def measure(minutes: int, share: float) -> dict:
    work = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-soak-"))
    reference = Reference()
    with Mesh(MeshConfig(models=ROOT / "build" / "models", log_dir=work / "logs", l2_path=work / "l2")) as mesh:
        run_ghz(mesh.router, ghz_unique_template("warm"), 300, 16, key=mesh.keys["dev-standard"])
        capacity = ghz_summary(
            run_ghz(
                mesh.router,
                ghz_unique_template("capacity"),
                0,
                64,
                seconds=10,
                timeout_s=10,
                key=mesh.keys["dev-standard"],
            )
        )["ok_rps"]
        progress(f"capacity {capacity:.0f} requests/s; soaking at {share * capacity:.0f}/s for {minutes} min")
        result = await soak(mesh, share * capacity, minutes, reference)
    return {
        "machine": machine(),
        "command": "python -m bench.soak " + " ".join(sys.argv[1:]),
        "capacity_rps": capacity,
        "share": share,
        "rate_rps": share * capacity,
        **result,
        "summary": summarise(result["minutes"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=int, default=30)
    parser.add_argument("--share", type=float, default=0.7, help="of the measured capacity")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    parser.add_argument("--render", type=pathlib.Path, help="render this soak.json again instead of measuring")
    args = parser.parse_args()
    if args.render:
        report = json.loads(args.render.read_text())
        write(args.out, "soak", report, markdown(report), plot)
        return 0
    if args.minutes < 2:
        parser.error("--minutes must be at least 2 (the first is warm-up)")
    report = asyncio.run(measure(args.minutes, args.share))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))  # kept even if rendering fails
    write(args.out, "soak", report, markdown(report), plot)
    p = report["probe"]
    return 0 if report["summary"]["errors"] == p["unanswered"] == p["twice"] == p["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
