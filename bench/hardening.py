"""Trust and limits, measured: what a hostile caller can make the router do.

Sections (each a function returning its rows, so that more can be added):

- health under flood: a separate pinger process sends ServerLive and
  grpc.health.v1 Check (alternately, 200 a second, each with a 1 s deadline as
  a Kubernetes probe's default timeout) while one client sends back-to-back
  16 MB pathological requests of one kind (tools/pathological.py: millions of
  empty BYTES elements raw and typed, one 15 MB text, a million tiny inputs);
  one phase per kind plus an idle baseline, in a seeded shuffled order, each
  run on a fresh mesh. Per phase: probe p50/p99, failed probes, refusals (each
  must be INVALID_ARGUMENT naming the field), and the router's CPU per refusal
  from /proc (net of the idle phase's rate, which the probes cost). Goal:
  p99 < 50 ms and no failed probe, in every run.
- fuzz counts: tools/fuzz_oip.py's generated requests, in process and through
  a running router: crashes, hangs, refusals naming no field, CPU per refusal.
- fairness: bench/fairness.py, two standard tenants, one at five times its
  share; the other's p99 with the flood over its p99 alone.
- budgets: bench/budgets.py, every service's RSS with the model server
  blocked under maximum-size unary, stream and idle-stream load.

    .venv/bin/python -m bench.hardening --runs 3

Writes bench/results/hardening.{json,md}.
"""

import argparse
import asyncio
import json
import pathlib
import subprocess
import sys
import tempfile
import time

from bench import budgets, fairness
from bench.report import (
    chosen_seed,
    cpu_times,
    goal_verdict,
    machine,
    phase_order,
    process_cpu_s,
    progress,
    seed_argument,
    span,
    spread,
    steal_share,
    write,
)
from services.launcher.mesh import Mesh, MeshConfig
from services.router.limits import RequestLimits
from tools import fuzz_oip, pathological

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOAL_P99_MS = 50.0
PROBE_TIMEOUT_S = 1.0  # Kubernetes' default timeoutSeconds for a probe
PROBE_INTERVAL_S = 0.005
IDLE = "idle"


# ---------------------------------------------------------------- the pinger (its own process)


def pinger(address: str, seconds: float) -> dict:
    """Probes `address` for `seconds`; latencies in ms of each kind, and failures."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from inference import grpc_predict_v2_pb2 as pb
    from inference import grpc_predict_v2_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        live = pb_grpc.GRPCInferenceServiceStub(channel).ServerLive
        check = health_pb2_grpc.HealthStub(channel).Check
        probes = {
            "ServerLive": (live, pb.ServerLiveRequest(), lambda r: r.live),
            "Check": (
                check,
                health_pb2.HealthCheckRequest(),
                lambda r: r.status == health_pb2.HealthCheckResponse.SERVING,
            ),
        }
        for method, request, _ in probes.values():
            method(request, timeout=10)  # the connection is up before the clock starts
        out = {name: {"ms": [], "failed": 0} for name in probes}
        print("ready", flush=True)
        sys.stdin.readline()  # go
        end = time.perf_counter() + seconds
        turn = 0
        while time.perf_counter() < end:
            name = ("ServerLive", "Check")[turn % 2]
            turn += 1
            method, request, good = probes[name]
            started = time.perf_counter()
            try:
                answer = method(request, timeout=PROBE_TIMEOUT_S)
                out[name]["ms"].append(1000 * (time.perf_counter() - started))
                if not good(answer):
                    out[name]["failed"] += 1
            except grpc.RpcError:
                out[name]["failed"] += 1
            time.sleep(max(0.0, PROBE_INTERVAL_S - (time.perf_counter() - started)))
    return out


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---------------------------------------------------------------- section: health under flood


async def _flood(address: str, attack: pathological.Attack | None, seconds: float) -> dict:
    """Back-to-back requests of `attack` for `seconds` (none for the idle phase)."""
    import grpc
    from inference import grpc_predict_v2_pb2 as pb

    codes: dict[str, int] = {}
    unnamed = 0
    if attack is None:
        await asyncio.sleep(seconds)
        return {"codes": codes, "unnamed": unnamed, "sent": 0}
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=None,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        end = time.perf_counter() + seconds
        sent = 0
        while time.perf_counter() < end:
            sent += 1
            try:
                await infer(attack.raw, timeout=60)
                code, details = "OK", ""
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code().name, exc.details() or ""
            codes[code] = codes.get(code, 0) + 1
            if code != "INVALID_ARGUMENT" or attack.names not in details:
                unnamed += 1
    return {"codes": codes, "unnamed": unnamed, "sent": sent}


def _phase(address: str, router_pid: int, attack: pathological.Attack | None, seconds: float) -> dict:
    probe = subprocess.Popen(
        [sys.executable, "-m", "bench.hardening", "--pinger", address, "--seconds", str(seconds)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert probe.stdout.readline().strip() == "ready"
    cpu_before, machine_before, started = process_cpu_s(router_pid), cpu_times(), time.perf_counter()
    probe.stdin.write("go\n")
    probe.stdin.flush()
    flood = asyncio.run(_flood(address, attack, seconds))
    probes = json.loads(probe.stdout.read())
    probe.wait()
    wall_s = time.perf_counter() - started
    cpu_s = process_cpu_s(router_pid) - cpu_before
    row = {
        "kind": attack.kind if attack else IDLE,
        "wall_s": wall_s,
        "router_cpu_s": cpu_s,
        "steal": steal_share(machine_before, cpu_times()),
        **flood,
    }
    for name, got in probes.items():
        row[f"{name}_p50_ms"] = _quantile(got["ms"], 0.5)
        row[f"{name}_p99_ms"] = _quantile(got["ms"], 0.99)
        row[f"{name}_answered"] = len(got["ms"])
        row[f"{name}_failed"] = got["failed"]
    return row


def health_under_flood(runs: int, seconds: float, seed: int, scale: float, models: pathlib.Path) -> list[dict]:
    """One row per run and phase (see the module's docstring)."""
    attacks = {a.kind: a for a in pathological.all_attacks(scale)}
    rows = []
    for run in range(runs):
        order = phase_order([IDLE, *attacks], run, seed)
        with (
            tempfile.TemporaryDirectory() as logs,
            Mesh(MeshConfig(models=models, log_dir=pathlib.Path(logs), cache=False)) as mesh,
        ):
            pid = mesh.processes["router"].popen.pid
            run_rows = []
            for kind in order:
                progress(f"run {run + 1}/{runs}: {kind}")
                run_rows.append(_phase(mesh.router, pid, attacks.get(kind), seconds))
            idle = next(r for r in run_rows if r["kind"] == IDLE)
            idle_rate = idle["router_cpu_s"] / idle["wall_s"]
            for position, row in enumerate(run_rows):
                refused = row["codes"].get("INVALID_ARGUMENT", 0)
                net = row["router_cpu_s"] - idle_rate * row["wall_s"]
                row.update(
                    run=run,
                    position=position,
                    order=order,
                    cpu_ms_per_refusal=1000 * net / refused if refused else None,
                )
            rows.extend(run_rows)
    return rows


def _worst_p99(row: dict) -> float | None:
    values = [row[k] for k in ("ServerLive_p99_ms", "Check_p99_ms") if row[k] is not None]
    return max(values) if values else None


def summarise_health(rows: list[dict]) -> list[dict]:
    kinds = list(dict.fromkeys(r["kind"] for r in sorted(rows, key=lambda r: r["kind"] != IDLE)))
    summary = []
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        failed = sum(r["ServerLive_failed"] + r["Check_failed"] for r in mine)
        worst = [_worst_p99(r) for r in mine]
        summary.append(
            {
                "kind": kind,
                "ServerLive_p99_ms": spread(r["ServerLive_p99_ms"] for r in mine),
                "Check_p99_ms": spread(r["Check_p99_ms"] for r in mine),
                "ServerLive_p50_ms": spread(r["ServerLive_p50_ms"] for r in mine),
                "probes": sum(r["ServerLive_answered"] + r["Check_answered"] for r in mine),
                "failed_probes": failed,
                "requests": sum(r["sent"] for r in mine),
                "refused_naming_field": sum(r["codes"].get("INVALID_ARGUMENT", 0) for r in mine)
                - sum(r["unnamed"] for r in mine),
                "other_answers": sum(r["unnamed"] for r in mine),
                "cpu_ms_per_refusal": spread(r["cpu_ms_per_refusal"] for r in mine),
                "goal": goal_verdict(
                    [
                        w if not (r["ServerLive_failed"] + r["Check_failed"]) else float("inf")
                        for w, r in zip(worst, mine, strict=True)
                    ],
                    lambda v: v < GOAL_P99_MS,
                ),
            }
        )
    return summary


# ---------------------------------------------------------------- section: fuzz counts


def fuzz_counts(in_process: int, through_router: int, seed: int) -> list[dict]:
    """One row per place the generated requests went: tools.fuzz_oip's summary."""
    rows = []
    if in_process:
        started = time.perf_counter()
        summary = fuzz_oip.run_in_process(in_process, RequestLimits(), seed).summary()
        rows.append({"where": "in process (decode and validation)", "wall_s": time.perf_counter() - started, **summary})
    if through_router:
        with fuzz_oip.running_router() as (address, pid):
            started = time.perf_counter()
            summary = fuzz_oip.run_against(address, through_router, seed, pid).summary()
        rows.append({"where": "through a running router", "wall_s": time.perf_counter() - started, **summary})
    return rows


# ---------------------------------------------------------------- the report


def markdown(report: dict) -> str:
    lines = [
        "# Trust and limits\n",
        f"Machine: {report['machine']}. Command: `{report['command']}`. "
        f"{report['runs']} run(s), {report['seconds']} s per phase, seed {report['seed']} "
        f"(phase orders: {'; '.join(' → '.join(o) for o in report['orders'])}).\n",
    ]
    if report.get("health"):
        lines += [
            "## Health checks under back-to-back 16 MB pathological requests\n",
            f"A pinger process probes every {PROBE_INTERVAL_S * 1000:.0f} ms (ServerLive and grpc.health.v1 "
            f"Check in turn, {PROBE_TIMEOUT_S:.0f} s deadline each) while one client sends requests of one "
            f"kind back to back. Medians over runs (min–max). Goal: p99 < {GOAL_P99_MS:.0f} ms and no failed "
            "probe, in every run. CPU per refusal is the router process's, net of the idle phase's rate.\n",
            "| phase | ServerLive p50 ms | ServerLive p99 ms | Check p99 ms | probes | failed | requests | "
            "refused naming the field | other answers | router CPU ms per refusal | goal |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in report["health"]["summary"]:
            lines.append(
                f"| {row['kind']} | {span(row['ServerLive_p50_ms'], '{:.1f}')} | "
                f"{span(row['ServerLive_p99_ms'], '{:.1f}')} | {span(row['Check_p99_ms'], '{:.1f}')} | "
                f"{row['probes']} | {row['failed_probes']} | {row['requests']} | {row['refused_naming_field']} | "
                f"{row['other_answers']} | {span(row['cpu_ms_per_refusal'], '{:.1f}')} | "
                f"{row['goal'] if row['kind'] != IDLE else '–'} |"
            )
        lines.append("")
    if report.get("fuzz"):
        lines += [
            "## Protocol fuzzing (tools/fuzz_oip.py)\n",
            "| where | requests | accepted | refused | crashes | hangs | refusals naming no field | "
            "peak traced memory per request, max | wall s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in report["fuzz"]:
            peak = row["peak_traced_bytes"]["max"]
            lines.append(
                f"| {row['where']} | {row['requests']} | {row['accepted']} | {row['refused']} | "
                f"{row['crashes']} | {row['hangs']} | {row['unnamed_refusals']} | "
                f"{'–' if peak is None else f'{peak / 1024:.0f} KiB'} | {row['wall_s']:.0f} |"
            )
        lines.append(
            "\nThrough a router, CPU is the router process's from /proc, in 10 ms ticks: a kind's figure "
            "means something only over many refusals."
        )
        for row in report["fuzz"]:
            lines += [
                f"\nCPU per refusal by kind, {row['where']} (the ten most frequent):\n",
                "| refusals | CPU µs each | kind |",
                "|---|---|---|",
            ]
            for kind, counted in list(row["refusal_kinds"].items())[:10]:
                lines.append(f"| {counted['count']} | {counted['cpu_us_each']:.0f} | {kind} |")
        lines.append("")
    if report.get("fairness"):
        lines += ["## Two tenants of one tier (bench/fairness.py)\n", fairness.markdown(report["fairness"])]
    if report.get("budgets"):
        lines += [
            "## RSS under the byte-budget load (bench/budgets.py)\n",
            budgets.markdown(report["budgets"]).split("\n", 2)[2],
        ]  # under this heading, not its own
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each flood phase")
    parser.add_argument("--scale", type=float, default=1.0, help="size of the pathological requests (1: 16 MB)")
    parser.add_argument("--fuzz-in-process", type=int, default=100_000)
    parser.add_argument("--fuzz-router", type=int, default=10_000)
    parser.add_argument(
        "--sections",
        default="health,fuzz,fairness,budgets",
        help="comma-separated: health, fuzz, fairness (bench.fairness), budgets (bench.budgets)",
    )
    parser.add_argument("--models", type=pathlib.Path, default=ROOT / "build" / "models")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    parser.add_argument("--pinger", help=argparse.SUPPRESS)  # internal: run as the pinger process
    seed_argument(parser)
    args = parser.parse_args()
    if args.pinger:
        print(json.dumps(pinger(args.pinger, args.seconds)), flush=True)
        return 0
    seed = chosen_seed(args.seed)
    sections = set(args.sections.split(","))
    report = {
        "machine": machine(),
        "command": " ".join(["python -m bench.hardening", *sys.argv[1:]]),
        "runs": args.runs,
        "seconds": args.seconds,
        "scale": args.scale,
        "seed": seed,
        "orders": [phase_order([IDLE, *pathological.KINDS], run, seed) for run in range(args.runs)],
    }
    if "health" in sections:
        rows = health_under_flood(args.runs, args.seconds, seed, args.scale, args.models)
        report["health"] = {"summary": summarise_health(rows), "raw": rows}
    if "fuzz" in sections:
        progress("fuzzing")
        report["fuzz"] = fuzz_counts(args.fuzz_in_process, args.fuzz_router, seed)
    if "fairness" in sections:
        progress("two tenants of one tier (bench.fairness)")
        report["fairness"] = fairness.measure(args.runs, args.seconds, seed)
    if "budgets" in sections:
        progress("RSS under the byte-budget load (bench.budgets)")
        report["budgets"] = budgets.measure(budgets.Settings(), args.runs, seed)
    write(args.out, "hardening", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
