"""Chaos: faults under mixed load, and what every caller got.

A supervised mesh as `make run` has it (two routers on one port, two
batchers, two model servers, the cache and Redis), with a delaying TCP proxy
process (tools/delay_proxy.py) in front of each model server, so the batcher
-> model-server hop can be slowed and stalled at the packet level. Mixed load
(bench/chaos_load.py) runs throughout: unary callers and streams, VIP and
standard tenants, minilm and mlp, mostly distinct inputs and a share of
repeats the cache answers. Every `--gap-s` seconds the next fault of the
schedule (in a seeded shuffled order per run):

    batcher-kill         SIGKILL a batcher
    model-server-kill    SIGKILL a model server while a batch is on it
    router-drain         SIGTERM a router (it drains; the supervisor restarts it)
    batcher-drain        SIGTERM a batcher
    cache-drain          SIGTERM the cache service
    model-server-drain   SIGTERM a model server
    redis-kill           SIGKILL Redis
    cache-kill           SIGKILL the cache service
    model-server-stop    SIGSTOP a model server for 5 s (a hang, not a crash)
    hop-delay            50 ms +- 10 ms on every chunk of the batcher -> model-server hop, 10 s
    hop-stall            nothing forwarded either way on that hop for 3 s

For each fault, over the requests sent from it until the next: sent, each
status, unanswered (must be 0), answered twice (0), wrong answers (0; a sample
checked against ONNX Runtime in this process), the time from the fault to the
first good answer, and from the fault's end until the p99 over a sliding
second is back within 1.5x of the p99 of the seconds before it.

    .venv/bin/python -m bench.chaos --runs 2          (make chaos)

Writes bench/results/chaos.{json,md,png}.
"""

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import signal
import sys
import tempfile
import time

from bench.chaos_load import ChaosLoad, LoadConfig, Reference, recovery
from bench.report import (
    chosen_seed,
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
from services.common.metrics import scrape
from services.launcher.mesh import Mesh, MeshConfig
from services.launcher.supervisor import RestartPolicy
from tools.delay_proxy import DelayProxy

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAULTS = (
    "batcher-kill",
    "model-server-kill",
    "router-drain",
    "batcher-drain",
    "cache-drain",
    "model-server-drain",
    "redis-kill",
    "cache-kill",
    "model-server-stop",
    "hop-delay",
    "hop-stall",
)
STOP_S = 5.0
DELAY_MS, JITTER_MS, DELAY_S = 50.0, 10.0, 10.0
STALL_S = 3.0
P99_FACTOR = 1.5
BASELINE_S = 8.0
MUST_BE_ZERO = ("unanswered", "twice", "wrong", "stray", "late")
# The restarts the mesh is dealt its faults under unless told: the launcher's own policy.
LAUNCHER_RESTARTS = RestartPolicy()


@dataclasses.dataclass
class Fault:
    name: str
    started: float  # time.monotonic()
    ended: float  # when the fault was lifted (its start, for a signal)
    note: str


class Chaos:
    """The mesh under test, its proxies, and the faults it can be dealt."""

    def __init__(
        self,
        work: pathlib.Path,
        restart_policy: RestartPolicy = LAUNCHER_RESTARTS,
        stop_s: float = STOP_S,
        delay_s: float = DELAY_S,
        stall_s: float = STALL_S,
    ):
        self.stop_s, self.delay_s, self.stall_s = stop_s, delay_s, stall_s  # how long those faults last
        self.proxies: list[DelayProxy] = []
        self.events: list[tuple[float, str]] = []

        def via(address: str) -> str:
            proxy = DelayProxy(log_path=work / f"proxy-{len(self.proxies)}.log")
            self.proxies.append(proxy)
            return proxy.start(address)

        # The cache is asked for every request (no automatic bypass, no near cache in the
        # router): its faults are then on every request's path.
        self.mesh = Mesh(
            MeshConfig(
                models=ROOT / "build" / "models",
                log_dir=work / "logs",
                l2_path=work / "l2",
                model_servers=2,
                batchers=2,
                routers=2,
                supervise=True,
                restart_policy=restart_policy,
                router_args=("--cache-min-hit-rate", "0", "--near-cache-ttl-s", "0"),
            ),
            model_server_via=via,
            on_event=lambda m: self.events.append((time.monotonic(), m)),
        )

    def start(self) -> "Chaos":
        try:
            self.mesh.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.mesh.stop()
        for proxy in self.proxies:
            proxy.stop()

    def pid(self, name: str) -> int:
        return self.mesh.processes[name].popen.pid

    def signal(self, name: str, sig: signal.Signals) -> str:
        pid = self.pid(name)
        os.kill(pid, sig)
        return f"{sig.name} {name} (pid {pid})"

    def on_a_batch(self, timeout_s: float = 5.0) -> str:
        """The model server a batch is on now (by the batchers' in-flight gauge), or the first one."""
        addresses = {proxy.listen: f"model_server-{i}" for i, proxy in enumerate(self.proxies)}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for batcher in self.mesh.batcher_names():
                try:
                    samples = scrape(self.mesh.metrics_url(batcher), timeout_s=1)
                except (OSError, ValueError):
                    continue
                for (name, labels), value in samples.items():
                    replica = dict(labels).get("replica")
                    if name == "infermesh_batcher_inflight_batches" and value >= 1 and replica in addresses:
                        return addresses[replica]
            time.sleep(0.01)
        return "model_server-0"

    def deal(self, name: str) -> Fault:
        """Deals one fault; returns once it is lifted (at once for a signal)."""
        started = time.monotonic()
        if name == "batcher-kill":
            note = self.signal("batcher", signal.SIGKILL)
        elif name == "model-server-kill":
            note = self.signal(self.on_a_batch(), signal.SIGKILL) + ", a batch on it"
        elif name.endswith("-drain"):
            service = {
                "router-drain": "router",
                "batcher-drain": "batcher",
                "cache-drain": "cache",
                "model-server-drain": "model_server-1",
            }[name]
            note = self.signal(service, signal.SIGTERM)
        elif name == "redis-kill":
            note = self.signal("redis", signal.SIGKILL)
        elif name == "cache-kill":
            note = self.signal("cache", signal.SIGKILL)
        elif name == "model-server-stop":
            note = self.signal("model_server-0", signal.SIGSTOP) + f" for {self.stop_s:g} s"
            time.sleep(self.stop_s)
            os.kill(self.pid("model_server-0"), signal.SIGCONT)
        elif name == "hop-delay":
            for proxy in self.proxies:
                proxy.delay(DELAY_MS, JITTER_MS)
            time.sleep(self.delay_s)
            for proxy in self.proxies:
                proxy.clear()
            note = f"{DELAY_MS:g} ms +- {JITTER_MS:g} ms on the batcher -> model-server hop for {self.delay_s:g} s"
        elif name == "hop-stall":
            for proxy in self.proxies:
                proxy.stall(self.stall_s)
            time.sleep(self.stall_s)
            note = f"the batcher -> model-server hop stalled for {self.stall_s:g} s"
        else:
            raise ValueError(f"no fault {name!r}; the faults are {', '.join(FAULTS)}")
        return Fault(name, started, time.monotonic(), note)

    def settled(self) -> bool:
        """Every service runs and is ready (the supervisor's view)."""
        return all(s["state"] == "running" and s["ready"] for s in self.mesh.status().values())


async def run_schedule(
    chaos: Chaos,
    faults: list[str],
    gap_s: float,
    warm_s: float,
    config: LoadConfig,
    reference: Reference | None = None,
    say=progress,
) -> dict:
    """Mixed load from `warm_s` before the first fault until `gap_s` after the
    last; returns the accounting per fault and in all, and the timeline."""
    mesh = chaos.mesh
    load = ChaosLoad(
        mesh.router,
        config,
        {"vip": mesh.credentials("dev-vip"), "standard": mesh.credentials("dev-standard")},
        reference=reference,
    )
    running = asyncio.create_task(load.run(warm_s + gap_s * len(faults)))
    await load.started.wait()
    await asyncio.sleep(warm_s)
    dealt: list[Fault] = []
    for index, name in enumerate(faults):
        slot_ends = load.accounting.started + warm_s + gap_s * (index + 1)
        fault = await asyncio.to_thread(chaos.deal, name)
        dealt.append(fault)
        say(f"  {name}: {fault.note}")
        await asyncio.sleep(max(0.0, slot_ends - time.monotonic()))
    result = await running
    accounting = result.accounting
    rows = []
    for index, fault in enumerate(dealt):
        until = dealt[index + 1].started if index + 1 < len(dealt) else result.ended
        totals = accounting.totals(fault.started, until, late_after_s=config.timeout_s + config.answer_grace_s)
        baseline_s = min(BASELINE_S, gap_s / 2)  # the seconds just before the fault, after the last one's recovery
        first = recovery(accounting, fault.started, factor=P99_FACTOR, baseline_s=baseline_s)
        back = recovery(accounting, fault.ended, factor=P99_FACTOR, baseline_s=baseline_s, baseline_until=fault.started)
        rows.append(
            {
                "fault": fault.name,
                "note": fault.note,
                "at_s": fault.started - accounting.started,
                "lasted_s": fault.ended - fault.started,
                **totals,
                "first_ok_s": first["first_ok_s"],
                "p99_before_ms": first["p99_before_ms"],
                "p99_back_s": back["p99_back_s"],
            }
        )
    return {
        "faults": rows,
        "totals": result.totals,
        "timeline": result.buckets,
        "events": [(at - accounting.started, message) for at, message in chaos.events if at >= accounting.started],
    }


def summarise(runs: list[dict]) -> dict:
    by_fault = {}
    for name in FAULTS:
        rows = [row for run in runs for row in run["faults"] if row["fault"] == name]
        if not rows:
            continue
        by_fault[name] = {
            "note": rows[0]["note"],
            "runs": len(rows),
            "sent": sum(r["sent"] for r in rows),
            "ok": sum(r["ok"] for r in rows),
            "statuses": _merge([r["by_status"] for r in rows] + [r["stream_failed"] for r in rows], skip="OK"),
            "unanswered": sum(r["unanswered"] for r in rows),
            "twice": sum(r["twice"] for r in rows),
            "wrong": sum(r["wrong"] for r in rows),
            "checked": sum(r["checked"] for r in rows),
            "status_lost": sum(r["status_lost"] for r in rows),
            "unsent": sum(r["unsent"] for r in rows),
            "stray": sum(r["stray"] for r in rows),
            "late": sum(r["late"] for r in rows),
            "first_ok_s": spread(r["first_ok_s"] for r in rows),
            "p99_before_ms": spread(r["p99_before_ms"] for r in rows),
            "p99_back_s": spread(r["p99_back_s"] for r in rows),
            "p99_never_back": sum(r["p99_back_s"] is None for r in rows),
        }
    totals = {
        key: sum(run["totals"][key] for run in runs)
        for key in ("sent", "ok", "checked", "unsent", "status_lost", *MUST_BE_ZERO)
    }
    return {"by_fault": by_fault, "totals": totals}


def _merge(counts: list[dict], skip: str = "") -> dict:
    merged: dict[str, int] = {}
    for count in counts:
        for key, value in count.items():
            if key != skip:
                merged[key] = merged.get(key, 0) + value
    return dict(sorted(merged.items(), key=lambda kv: -kv[1]))


def markdown(report: dict) -> str:
    s = report["summary"]
    t = s["totals"]
    lines = [
        "# Chaos: faults under mixed load",
        "",
        f"Machine: {report['machine']}. Command: `{report['command']}`. Runs: {report['runs']} (seed "
        f"{report['seed']}, fault order shuffled per run), {report['gap_s']:g} s between faults, load: "
        f"{report['load']['callers']} callers ({report['load']['stream_share']:.0%} streams of "
        f"{report['load']['stream_window']} outstanding, {report['load']['vip_share']:.0%} VIP, "
        f"{report['load']['mlp_share']:.0%} mlp, {report['load']['repeat_share']:.0%} repeats), "
        f"deadline {report['load']['timeout_s']:g} s.",
        "",
        f"In all: {t['sent']} requests sent, {t['ok']} answered OK, **{t['unanswered']} unanswered, "
        f"{t['twice']} answered twice, {t['wrong']} wrong** of {t['checked']} checked against ONNX Runtime; "
        f"{t['status_lost']} on a stream whose status the client library lost (grpc/grpc#36066), "
        f"{t['stray']} answers to no request sent, {t['late']} answered past their deadline and grace; "
        f"{t['unsent']} whose write failed as their stream ended (never sent).",
        "",
        "Per fault, over the requests sent from it until the next fault (sums over the runs; times: median, "
        "least and greatest across runs; the first good answer counts from the fault, the p99's return from "
        "the fault's end, against the p99 of the seconds before it began, over a sliding second):",
        "",
        "| fault | sent | OK | other answers | unanswered | twice | wrong (checked) | first good answer | "
        "p99 before | p99 back within 1.5x |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in s["by_fault"].items():
        others = ", ".join(f"{count} {status}" for status, count in row["statuses"].items()) or "none"
        never = f" ({row['p99_never_back']} runs: not within the slot)" if row["p99_never_back"] else ""
        lines.append(
            f"| {name}: {row['note']} | {row['sent']} | {row['ok']} | {others} | {row['unanswered']} | "
            f"{row['twice']} | {row['wrong']} ({row['checked']}) | {span(row['first_ok_s'], '{:.2f} s')} | "
            f"{span(row['p99_before_ms'], '{:.0f} ms')} | {span(row['p99_back_s'], '{:.1f} s')}{never} |"
        )
    lines += [
        "",
        "The timeline of the first run is in chaos.png (answers per second, p99, other answers, the "
        "faults marked); every restart the supervisor made is in chaos.json (`events`).",
        "",
    ]
    return "\n".join(lines)


def plot(report: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    run = report["raw"][0]
    timeline = run["timeline"]
    fig, (rate, latency, errors) = plt.subplots(3, 1, figsize=(11, 7), sharex=True)
    t = [row["t_s"] for row in timeline]
    rate.plot(t, [row["ok"] for row in timeline], lw=1)
    rate.set_ylabel("OK answers / s")
    latency.plot(t, [row["p99_ms"] for row in timeline], lw=1, color="tab:orange")
    latency.set_yscale("log")
    latency.set_ylabel("p99 of OK (ms)")
    errors.bar(t, [sum(row["status"].values()) for row in timeline], width=1.0, color="tab:red")
    errors.set_ylabel("other answers / s")
    errors.set_ylim(0, max(1, *(sum(row["status"].values()) for row in timeline)) * 1.1)
    errors.set_xlabel("seconds into the run")
    for fault in run["faults"]:
        for axis in (rate, latency, errors):
            axis.axvspan(fault["at_s"], fault["at_s"] + max(fault["lasted_s"], 0.3), color="grey", alpha=0.25)
        rate.annotate(fault["fault"], (fault["at_s"], rate.get_ylim()[1]), fontsize=7, rotation=60, va="top", ha="left")
    save_figure(fig, path, {**report, "runs": 1}, f"chaos, the first of {report['runs']} runs")


async def measure(
    runs: int, gap_s: float, warm_s: float, seed: int, config: LoadConfig, faults: tuple[str, ...] = FAULTS
) -> dict:
    reference = Reference()
    raw = []
    for run in range(runs):
        order = phase_order(faults, run, seed)
        work = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-chaos-"))
        progress(f"run {run + 1}/{runs}: starting the mesh ({work})")
        chaos = Chaos(work).start()
        try:
            progress(f"run {run + 1}/{runs}: {len(order)} faults, {gap_s:g} s apart: {', '.join(order)}")
            result = await run_schedule(chaos, order, gap_s, warm_s, config, reference)
        finally:
            chaos.stop()
        t = result["totals"]
        progress(
            f"run {run + 1}/{runs}: {t['sent']} sent, {t['ok']} OK, {t['unanswered']} unanswered, "
            f"{t['twice']} twice, {t['wrong']} wrong of {t['checked']} checked"
        )
        raw.append(result)
    report = {
        "machine": machine(),
        "runs": runs,
        "seed": seed,
        "gap_s": gap_s,
        "warm_s": warm_s,
        "load": dataclasses.asdict(config),
        "raw": raw,
        "summary": summarise(raw),
        "command": "python -m bench.chaos " + " ".join(sys.argv[1:]),
    }
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--gap-s", type=float, default=20.0, help="seconds from one fault to the next")
    parser.add_argument("--warm-s", type=float, default=15.0, help="load before the first fault")
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--faults", default=",".join(FAULTS), help="which faults, comma-separated")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    seed_argument(parser)
    args = parser.parse_args()
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = set(faults) - set(FAULTS)
    if unknown:
        parser.error(f"no fault {sorted(unknown)}; the faults are {', '.join(FAULTS)}")
    report = asyncio.run(
        measure(args.runs, args.gap_s, args.warm_s, chosen_seed(args.seed), LoadConfig(callers=args.callers), faults)
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chaos.json").write_text(json.dumps(report, indent=1))  # kept even if rendering fails
    write(args.out, "chaos", report, markdown(report), plot)
    t = report["summary"]["totals"]
    return 0 if not any(t[key] for key in MUST_BE_ZERO) else 1


if __name__ == "__main__":
    sys.exit(main())
