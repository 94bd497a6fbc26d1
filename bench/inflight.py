"""10,000 requests in flight at once, then three times saturation.

One mesh as `make run` starts it (router, batcher, model server, cache,
Redis), its batcher's queues sized to hold what this benchmark sends
(--standard-max-queue-size 12000, --vip-max-queue-size 4096: the defaults
refuse past 2048 and 1024 per model, which the overload phase shows).

1. capacity: ghz, 64 callers, closed loop, distinct minilm texts.
2. hold: bench/chaos_load's mixed load with `--streams` streams of
   `--window` outstanding requests each (100 x 100 by default) plus
   `--unary` unary callers, every request accounted for (unanswered, twice,
   wrong against ONNX Runtime in this process), deadline 180 s; the most
   requests in flight at once (sent and not yet answered), p50/p99, and the
   peak RSS of every service, sampled every 0.2 s.
3. overload: ghz open loop at `--overload`x the capacity for `--overload-s`
   seconds (distinct texts, deadline 10 s), beside a small accounted probe
   load (4 callers) that runs before, during and after it: every status
   ghz got and how fast refusals came, the peak RSS of every service, what
   the probe got (nothing unanswered, nothing twice), and the time from the
   overload's end until the probe's p99 over a sliding second is back within
   1.5x of its p99 before the overload.

    .venv/bin/python -m bench.inflight            (make inflight)

Writes bench/results/inflight.{json,md,png}.
"""

import argparse
import asyncio
import dataclasses
import json
import pathlib
import sys
import tempfile
import threading
import time

from bench.chaos_load import ChaosLoad, LoadConfig, Reference, recovery
from bench.report import machine, process_rss_bytes, progress, pyplot, save_figure, write
from bench.workload import ghz_unique_template, run_ghz
from services.launcher.mesh import Mesh, MeshConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVICES = ("router", "batcher", "model_server", "cache", "redis")
P99_FACTOR = 1.5


def rss_bytes(pid: int) -> int:
    """The process's RSS, 0 once it is gone (a sampler outlives a restart)."""
    try:
        return process_rss_bytes(pid)
    except OSError:
        return 0


class RssSampler:
    """Every service's RSS every `period_s` from a thread: the peaks and the samples."""

    def __init__(self, mesh: Mesh, period_s: float = 0.2):
        self._pids = {name: mesh.processes[name].popen.pid for name in SERVICES if name in mesh.processes}
        self._period_s = period_s
        self._stop = threading.Event()
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), {n: rss_bytes(p) for n, p in self._pids.items()}))
            self._stop.wait(self._period_s)

    def peaks(self, since: float = 0.0, until: float = float("inf")) -> dict[str, int]:
        window = [s for t, s in self.samples if since <= t <= until]
        return {name: max((s[name] for s in window), default=0) for name in self._pids}


def most_in_flight(accounting) -> int:
    """The most requests sent and not yet answered (nor ended by their stream) at any moment."""
    changes = []
    for record in accounting.records.values():
        changes.append((record.sent_at, 1))
        end = record.answers[0][0] if record.answers else (record.stream_error_at or None)
        if end is not None:
            changes.append((end, -1))
    changes.sort()
    now = peak = 0
    for _, change in changes:
        now += change
        peak = max(peak, now)
    return peak


def ghz_summary(report: dict) -> dict:
    details = report["details"]

    def pct(values, p):
        return values[min(len(values) - 1, int(p * len(values)))] if values else None

    by_status: dict[str, list[float]] = {}
    for d in details:
        by_status.setdefault(d["status"], []).append(d["latency"] / 1e6)
    out = {"sent": len(details), "seconds": report["total"] / 1e9, "statuses": {}}
    for status, latencies in sorted(by_status.items()):
        latencies.sort()
        out["statuses"][status] = {
            "count": len(latencies),
            "p50_ms": pct(latencies, 0.5),
            "p99_ms": pct(latencies, 0.99),
        }
    out["ok_rps"] = out["statuses"].get("OK", {}).get("count", 0) / out["seconds"] if out["seconds"] else 0.0
    return out


async def hold(mesh: Mesh, streams: int, window: int, unary: int, seconds: float, reference: Reference) -> dict:
    callers = streams + unary
    config = LoadConfig(
        callers=callers,
        stream_share=streams / callers,
        stream_window=window,
        vip_share=0.1,
        timeout_s=180.0,
        answer_grace_s=10.0,
        channels=4,
        check_every=50,
    )
    load = ChaosLoad(
        mesh.router,
        config,
        {"vip": mesh.credentials("dev-vip"), "standard": mesh.credentials("dev-standard")},
        reference=reference,
    )
    with RssSampler(mesh) as rss:
        result = await load.run(seconds)
    ok = sorted(
        at - r.sent_at for r in result.accounting.records.values() for at, status in r.answers[:1] if status == "OK"
    )
    return {
        "config": dataclasses.asdict(config),
        "seconds": seconds,
        "totals": result.totals,
        "most_in_flight": most_in_flight(result.accounting),
        "p50_ms": 1000 * ok[len(ok) // 2] if ok else None,
        "p99_ms": 1000 * ok[min(len(ok) - 1, int(0.99 * len(ok)))] if ok else None,
        "peak_rss_bytes": rss.peaks(),
        "timeline": result.buckets,
    }


async def overload(mesh: Mesh, capacity: float, factor: float, seconds: float, reference: Reference) -> dict:
    probe = ChaosLoad(
        mesh.router,
        LoadConfig(callers=4, timeout_s=10.0),
        {"vip": mesh.credentials("dev-vip"), "standard": mesh.credentials("dev-standard")},
        reference=reference,
    )
    before_s, after_s = 10.0, 20.0
    running = asyncio.create_task(probe.run(before_s + seconds + after_s))
    await probe.started.wait()
    await asyncio.sleep(before_s)
    with RssSampler(mesh) as rss:
        began = time.monotonic()
        report = await asyncio.to_thread(
            run_ghz,
            mesh.router,
            ghz_unique_template("overload"),
            0,
            1000,
            rps=factor * capacity,
            timeout_s=10,
            seconds=seconds,
            key=mesh.keys["dev-standard"],
        )
        ended = time.monotonic()
        result = await running
    back = recovery(result.accounting, ended, factor=P99_FACTOR, baseline_s=before_s, baseline_until=began)
    return {
        "factor": factor,
        "offered_rps": factor * capacity,
        "seconds": seconds,
        "ghz": ghz_summary(report),
        "peak_rss_bytes": rss.peaks(),
        "peak_rss_during_bytes": rss.peaks(began, ended),
        "probe": result.totals,
        "probe_p99_before_ms": back["p99_before_ms"],
        "p99_back_after_end_s": back["p99_back_s"],
        "probe_first_ok_after_end_s": back["first_ok_s"],
        "timeline": result.buckets,
        "overload_at_s": began - result.started,
        "overload_end_s": ended - result.started,
    }


def others(totals: dict) -> str:
    """The answers that were not OK, as 'n STATUS, ...' (or 'none')."""
    counts = {k: v for k, v in (totals["by_status"] | totals["stream_failed"]).items() if k != "OK"}
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])) or "none"


def markdown(report: dict) -> str:
    h, o = report["hold"], report["overload"]
    mib = 1024 * 1024

    def rss(peaks):
        return ", ".join(f"{name} {value / mib:.0f} MiB" for name, value in peaks.items())

    t = h["totals"]
    g = o["ghz"]
    statuses = "; ".join(
        f"{status}: {s['count']} (p50 {s['p50_ms']:.1f} ms, p99 {s['p99_ms']:.1f} ms)"
        for status, s in g["statuses"].items()
    )
    p = o["probe"]
    back = o["p99_back_after_end_s"]
    return "\n".join(
        [
            "# 10,000 requests in flight, then three times saturation",
            "",
            f"Machine: {report['machine']}. Command: `{report['command']}`. One run (each phase is one long "
            f"measurement; rerun to see its spread).",
            "",
            f"Capacity (ghz, 64 callers, closed loop, distinct minilm texts): {report['capacity_rps']:.0f} requests/s.",
            "",
            "## Holding them",
            f"{h['config']['callers'] - round(h['config']['callers'] * (1 - h['config']['stream_share']))} streams of "
            f"{h['config']['stream_window']} outstanding requests and "
            f"{round(h['config']['callers'] * (1 - h['config']['stream_share']))} unary callers for {h['seconds']:g} s: "
            f"**{h['most_in_flight']} requests in flight at most**; {t['sent']} sent, {t['ok']} OK, other answers "
            f"{others(t)}, **{t['unanswered']} unanswered, {t['twice']} twice, "
            f"{t['wrong']} wrong** of {t['checked']} checked; OK latency p50 {h['p50_ms']:.0f} ms, p99 "
            f"{h['p99_ms']:.0f} ms (a request waits behind every one sent before it).",
            "",
            f"Peak RSS: {rss(h['peak_rss_bytes'])}.",
            "",
            "## Three times saturation",
            f"ghz open loop at {o['factor']:g}x capacity ({o['offered_rps']:.0f} requests/s) for {o['seconds']:g} s: "
            f"{g['sent']} sent; {statuses}.",
            "",
            f"Peak RSS during the overload: {rss(o['peak_rss_during_bytes'])}.",
            "",
            f"The probe (4 accounted callers before, during and after): {p['sent']} sent, {p['ok']} OK, other answers "
            f"{others(p)}, **{p['unanswered']} unanswered, {p['twice']} twice, {p['wrong']} "
            f"wrong**; its p99 before the overload {o['probe_p99_before_ms']:.0f} ms, back within 1.5x of it "
            + (
                f"**{back:.1f} s** after the overload ended."
                if back is not None
                else "**not within the 20 s watched**."
            ),
            "",
            "The probe's timeline is in inflight.png.",
            "",
        ]
    )


def plot(report: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    o = report["overload"]
    fig, (rate, latency) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    t = [row["t_s"] for row in o["timeline"]]
    rate.plot(t, [row["ok"] for row in o["timeline"]], label="OK")
    rate.plot(t, [sum(row["status"].values()) for row in o["timeline"]], label="other answers", color="tab:red")
    rate.set_ylabel("probe answers / s")
    rate.legend(fontsize=8)
    latency.plot(t, [row["p99_ms"] for row in o["timeline"]], color="tab:orange")
    latency.set_yscale("log")
    latency.set(ylabel="probe p99 (ms)", xlabel="seconds into the overload phase")
    for axis in (rate, latency):
        axis.axvspan(o["overload_at_s"], o["overload_end_s"], color="grey", alpha=0.25)
    report = {**report, "runs": 1}
    save_figure(fig, path, report, f"a probe through {o['factor']:g}x saturation (grey)")


async def measure(args) -> dict:
    work = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-inflight-"))
    reference = Reference()
    with Mesh(
        MeshConfig(
            models=ROOT / "build" / "models",
            log_dir=work / "logs",
            l2_path=work / "l2",
            batcher_args=("--standard-max-queue-size", "12000", "--vip-max-queue-size", "4096"),
        )
    ) as mesh:
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
        progress(f"capacity {capacity:.0f} requests/s")
        progress(
            f"hold: {args.streams} streams x {args.window} outstanding + {args.unary} unary callers, {args.hold_s:g} s"
        )
        held = await hold(mesh, args.streams, args.window, args.unary, args.hold_s, reference)
        progress(
            f"hold: {held['most_in_flight']} in flight at most; {held['totals']['sent']} sent, "
            f"{held['totals']['unanswered']} unanswered, {held['totals']['twice']} twice"
        )
        progress(f"overload: {args.overload:g}x capacity for {args.overload_s:g} s")
        over = await overload(mesh, capacity, args.overload, args.overload_s, reference)
        progress(f"overload: probe back within 1.5x {over['p99_back_after_end_s']} s after it ended")
    return {
        "machine": machine(),
        "command": "python -m bench.inflight " + " ".join(sys.argv[1:]),
        "capacity_rps": capacity,
        "hold": held,
        "overload": over,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--window", type=int, default=100, help="requests outstanding per stream")
    parser.add_argument("--unary", type=int, default=16)
    parser.add_argument("--hold-s", type=float, default=30.0)
    parser.add_argument("--overload", type=float, default=3.0, help="times the capacity")
    parser.add_argument("--overload-s", type=float, default=60.0)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    report = asyncio.run(measure(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "inflight.json").write_text(json.dumps(report, indent=1))  # kept even if rendering fails
    write(args.out, "inflight", report, markdown(report), plot)
    h, p = report["hold"]["totals"], report["overload"]["probe"]
    return 0 if h["unanswered"] == h["twice"] == h["wrong"] == p["unanswered"] == p["twice"] == p["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
