"""The batcher under load, in one run, on one machine:

A. Batching on vs off (max batch 1) through the mesh at 64 callers, beside the
   same ratio for in-process ONNX Runtime (best batch vs batch 1), on the texts
   ghz sends. The two gains are not comparable as a share (unbatched, the mesh
   pays every hop per request, which batching also amortises), so the report
   gives each, and what batched mesh traffic reaches of in-process ORT at its
   best batch, with their spreads.
B. Overload isolation: standard traffic at 2x the mesh's saturation rate plus
   VIP traffic at 10% of it. Goals: VIP p99 under that load <= 1.5x VIP p99
   alone; no VIP request rejected; excess standard requests rejected in under
   5 ms instead of timing out. The standard load is open loop (ghz has enough
   workers to keep its rate while every request waits its full deadline), and
   what the mesh still serves of it is reported beside the saturation rate.
   40 requests/s of it come from a second, light caller (4 workers), whose
   refusals show what a caller sees that is not itself queued behind ~750
   ghz workers on the mesh's own cores. Refusals are reported as their p50,
   p99 and the share that came in under 5 ms.
   Measured on four layouts side by side: one model server with one session
   instance of minilm for everything (the layout before the defaults changed);
   the same with --slice-ms, so that a VIP batch waits for one slice of a
   running standard batch instead of all of it; the defaults: one model
   server, two instances of minilm, the second for VIP batches only; and the
   Kubernetes layout on one machine: a VIP pool of its own (mesh/istio's
   x-user-tier route) beside the standard pool (one instance each), which runs
   at a lower CPU priority (nice 10) as a pod with smaller CPU requests would
   get less of a shared node. The CPU the hypervisor took meanwhile is
   reported with each run.
C. What the VIP-only instance costs standard traffic when no VIP traffic comes:
   A's 64 callers on the defaults, once the reservation is lent out
   (lend_reserved_after_s), beside one instance; and what it costs while VIP
   traffic trickles in (one request a second) and so keeps the reservation.

    .venv/bin/python -m bench.batching --runs 3

Within each run the independent measurements of A and C, and then the four
overloads, go in an order shuffled by --seed (recorded in the report); the
saturation that sizes the overloads is measured before them. Closed-loop
phases last --seconds. Writes bench/results/batching.{json,md,png}.
"""

import argparse
import concurrent.futures
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

from bench.report import (
    bucket_quantile,
    chosen_seed,
    cpu_times,
    machine,
    phase_order,
    progress,
    pyplot,
    save_figure,
    seed_argument,
    span,
    spread,
    steal_share,
    write,
)
from bench.workload import InProcessMinilm, ghz_texts, ghz_unique_template, minilm_instances_repository, run_ghz
from services.common.metrics import scrape
from services.launcher.mesh import Mesh, MeshConfig
from services.model_server.repository import LEND_RESERVED_AFTER_S

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = ROOT / "build" / "models" / "minilm" / "1"
STANDARD_TIMEOUT_S = 2  # the overload's standard callers' deadline
# A light standard caller beside the heavy one, as one of many callers on machines of their
# own would be: ~750 ghz workers on the mesh's own two cores wait for a core themselves, and
# what they see is partly their own queue. Its rate is taken off the heavy caller's.
LIGHT_CALLER_RPS = 40
TRICKLE_VIP_REQUESTS = 8  # at one a second: about as long as the standard traffic beside them
# A refusal slower than this came after the request had waited (in the batcher's queue once too
# little time was left, or at the model server), not from the router's or the batcher's admission.
LATE_REFUSAL_MS = 100
REFUSAL_GOAL_MS = 5  # the bound on a refusal as the caller sees it
SLICE_MS = 30  # the sliced layout's --slice-ms (a scratch A/B of 30 and 60 ms favoured 30)
LAYOUTS = {  # overload layouts: report key -> column title
    "one": "one instance",
    "sliced": f"one instance, --slice-ms {SLICE_MS}",
    "reserved": "defaults: 2 instances, 1 VIP-only",
    "pools": "VIP pool + standard pool (nice 10)",
}


def ghz(
    router: str,
    tag: str,
    total: int,
    concurrency: int,
    rps: float = 0,
    key: str | None = None,
    timeout_s: float = 20,
    seconds: float | None = None,
) -> dict:
    """`total` calls (or, closed loop, `seconds` of them) with a text distinct on
    every call, as the tenant whose bearer `key` is given (VIP traffic: the mesh's
    development VIP tenant)."""
    report = run_ghz(router, ghz_unique_template(tag), total, concurrency, rps, timeout_s, key, seconds=seconds)
    ok = sorted(d["latency"] / 1e6 for d in report["details"] if d["status"] == "OK")
    rejected = sorted(d["latency"] / 1e6 for d in report["details"] if d["status"] == "ResourceExhausted")

    def pct(values, p):
        return values[min(len(values) - 1, int(p * len(values)))] if values else float("nan")

    return {
        "rps": report["rps"],
        "ok": len(ok),
        "ok_rps": len(ok) / (report["total"] / 1e9),
        "count": report["count"],
        "statuses": report["statusCodeDistribution"],
        "p50_ms": pct(ok, 0.5),
        "p99_ms": pct(ok, 0.99),
        "rejected": len(rejected),
        "rejected_p50_ms": pct(rejected, 0.5),
        "rejected_p99_ms": pct(rejected, 0.99),
        "rejected_late": sum(1 for ms in rejected if ms > LATE_REFUSAL_MS),
        "rejected_within_goal": sum(1 for ms in rejected if ms < REFUSAL_GOAL_MS),
    }


def in_process(
    seconds: float, seed: int, sizes: tuple[int, ...] = (1, 8, 16, 32, 64), threads: int | None = None
) -> dict[int, float]:
    """Sentences per second of minilm on ONNX Runtime itself, by batch size
    (threads: its intra-op threads, one per core unless given)."""
    model = InProcessMinilm(MODEL, threads)
    pool = ghz_texts(f"ort{seed}", 4000)  # the texts ghz sends the mesh
    rates = {}
    for batch in sizes:
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            start = done % (len(pool) - batch)
            model.embed(pool[start : start + batch])
            done += batch
        rates[batch] = done / (time.perf_counter() - started)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each measurement")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    seed_argument(parser)
    args = parser.parse_args()
    seed = chosen_seed(args.seed)
    work = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-batching-"))
    policy = work / "traffic.yaml"
    shutil.copy(ROOT / "mesh" / "istio" / "model-server-traffic.yaml", policy)
    one_instance = minilm_instances_repository(work, 1)  # minilm with one session, every core
    with (
        Mesh(MeshConfig(models=ROOT / "build" / "models", cache=False, log_dir=work / "on")) as on,
        Mesh(
            MeshConfig(
                models=ROOT / "build" / "models",
                cache=False,
                log_dir=work / "off",
                batcher_args=("--max-batch-size", "1"),
            )
        ) as off,
        Mesh(MeshConfig(models=one_instance, cache=False, log_dir=work / "one")) as one,
        Mesh(
            MeshConfig(
                models=one_instance,
                cache=False,
                log_dir=work / "sliced",
                model_server_args=("--slice-ms", str(SLICE_MS)),
            )
        ) as sliced,
        Mesh(
            MeshConfig(
                models=one_instance,
                cache=False,
                log_dir=work / "pools",
                model_servers=2,
                model_server_labels=("version=blue", "pool=vip"),
                model_server_nice=(10, 0),
                batcher_args=("--traffic-policy", str(policy)),
            )
        ) as pools,
    ):
        progress("meshes up (defaults, batching off, one instance, sliced, VIP pool); warming up")
        for mesh in (on, off, one, sliced, pools):
            ghz(mesh.router, "warm", 200, 16)
        for mesh in (on, sliced, pools):
            ghz(mesh.router, "warmvip", 100, 8, key=mesh.keys["dev-vip"])
        on_vip_at = time.monotonic()  # the latest VIP traffic on the defaults
        runs, orders = [], []
        for run in range(args.runs):
            run_started = cpu_times()
            r: dict = {}
            seconds = args.seconds

            def lull() -> None:  # the defaults' VIP instance is lent out only after a lull in VIP traffic
                time.sleep(max(0.0, on_vip_at + LEND_RESERVED_AFTER_S + 1 - time.monotonic()))

            def trickle_defaults() -> None:
                nonlocal on_vip_at
                r["trickle_defaults"] = trickle(on, f"on{run}", seconds)
                on_vip_at = time.monotonic()

            independent = {
                "ort": lambda: r.__setitem__("ort", in_process(seconds / 3, seed=run)),
                "on": lambda: (lull(), r.__setitem__("on", standard_only(on, f"on{run}", seconds))),
                "off": lambda: r.__setitem__("off", ghz(off.router, f"off{run}", 0, 64, seconds=seconds)),
                "one_instance": lambda: r.__setitem__(
                    "one_instance", ghz(one.router, f"one{run}", 0, 64, seconds=seconds)
                ),
                "trickle_defaults": trickle_defaults,
                "trickle_one_instance": lambda: r.__setitem__(
                    "trickle_one_instance", trickle(one, f"one{run}", seconds)
                ),
            }
            order = phase_order(list(independent), run, seed)
            for name in order:
                independent[name]()
            # Saturation at the overload's own concurrency: batches fill better at 256 callers
            # than at 64, so the 64-caller rate would put "2x" at hardly more than capacity.
            r["saturation"] = ghz(on.router, f"sat{run}", 0, 256, seconds=seconds)
            saturation = r["saturation"]["rps"]
            overloads = phase_order([("one", one), ("sliced", sliced), ("reserved", on), ("pools", pools)], run, seed)
            for layout, mesh in overloads:
                r[layout] = overload(mesh, f"{layout}{run}", saturation, args.seconds)
                if mesh is on:
                    on_vip_at = time.monotonic()
            orders.append([*order, "saturation", *(layout for layout, _ in overloads)])
            r["steal"] = steal_share(run_started, cpu_times())
            runs.append(r)
            ort_gain = max(r["ort"].values()) / r["ort"][1]
            mesh_gain = r["on"]["rps"] / r["off"]["rps"]
            progress(
                f"run {run + 1}/{args.runs} ({', '.join(orders[-1])}): ORT x{ort_gain:.2f}, mesh x{mesh_gain:.2f}, "
                f"mesh batched {r['on']['rps'] / max(r['ort'].values()):.2f} of ORT's best; "
                f"defaults {r['on']['rps']:.0f} req/s "
                f"({r['on']['lent_batches']:.0f} batches on loan), one instance {r['one_instance']['rps']:.0f}; "
                f"VIP trickling in: defaults {r['trickle_defaults']['standard']['rps']:.0f} req/s, VIP p99 "
                f"{r['trickle_defaults']['vip']['p99_ms']:.0f} ms; one instance "
                f"{r['trickle_one_instance']['standard']['rps']:.0f} req/s, VIP p99 "
                f"{r['trickle_one_instance']['vip']['p99_ms']:.0f} ms"
            )
            for layout in LAYOUTS:
                o = r[layout]
                progress(
                    f"  {layout}: VIP p99 {o['vip_alone']['p99_ms']:.0f} -> {o['vip_loaded']['p99_ms']:.0f} ms, "
                    f"VIP rejected {o['vip_loaded']['count'] - o['vip_loaded']['ok']}; standard "
                    f"{o['standard']['statuses']}, rejections p99 {o['standard']['rejected_p99_ms']:.1f} ms "
                    f"(light caller {o['light']['rejected_p99_ms']:.1f} ms)"
                )
    report = summarise(runs)
    report.update(seed=seed, orders=orders)
    write(args.out, "batching", report, markdown(report), plot)
    return 0


def standard_only(mesh: Mesh, tag: str, seconds: float) -> dict:
    """Standard traffic at 64 callers, with the batches that ran on a lent VIP instance meanwhile."""
    name, model = "infermesh_model_lent_batches_total", (("model", "minilm"),)
    before = scrape(mesh.metrics_url("model_server")).get((name, model), 0.0)
    result = ghz(mesh.router, tag, 0, 64, seconds=seconds)
    result["lent_batches"] = scrape(mesh.metrics_url("model_server")).get((name, model), 0.0) - before
    return result


def trickle(mesh: Mesh, tag: str, seconds: float) -> dict:
    """`seconds` of standard requests from 64 callers while one VIP request a second comes beside them."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        standard = pool.submit(ghz, mesh.router, f"ts{tag}", 0, 64, seconds=seconds)
        vip = pool.submit(ghz, mesh.router, f"tv{tag}", TRICKLE_VIP_REQUESTS, 1, rps=1, key=mesh.keys["dev-vip"])
        return {"standard": standard.result(), "vip": vip.result()}


def overload(mesh: Mesh, tag: str, saturation: float, seconds: float) -> dict:
    """VIP traffic at 10% of `saturation` alone, then beside standard traffic at 2x it."""
    vip_rps = 0.1 * saturation
    vip_key = mesh.keys["dev-vip"]
    result = {"vip_alone": ghz(mesh.router, f"va{tag}", int(vip_rps * seconds), 8, rps=vip_rps, key=vip_key)}
    # Open loop: enough ghz workers that the rate holds even while every request waits out
    # its 2 s deadline (with fewer, ghz sends only as fast as answers come back).
    workers = int(2 * saturation * STANDARD_TIMEOUT_S * 1.25)
    before, machine_before, counters_before = scrape(mesh.router_metrics), cpu_times(), service_counters(mesh)
    heavy_rps = max(2 * saturation - LIGHT_CALLER_RPS, 1.0)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        standard = pool.submit(
            ghz, mesh.router, f"st{tag}", int(heavy_rps * seconds), workers, rps=heavy_rps, timeout_s=STANDARD_TIMEOUT_S
        )
        light = pool.submit(
            ghz,
            mesh.router,
            f"sl{tag}",
            int(LIGHT_CALLER_RPS * seconds),
            4,
            rps=LIGHT_CALLER_RPS,
            timeout_s=STANDARD_TIMEOUT_S,
        )
        vip = pool.submit(ghz, mesh.router, f"vl{tag}", int(vip_rps * seconds), 8, rps=vip_rps, key=vip_key)
        result["standard"], result["light"], result["vip_loaded"] = standard.result(), light.result(), vip.result()
    # The same latencies as the router measured them, from receipt to answer: on two shared
    # cores the load generator's own wait for a core is part of what ghz sees.
    after = scrape(mesh.router_metrics)
    result["steal"] = steal_share(machine_before, cpu_times())
    counters = service_counters(mesh)
    result["batch_timeouts"] = counters["batch_timeouts"] - counters_before["batch_timeouts"]
    result["full_gc"] = {
        role: [now - then for now, then in zip(counts, counters_before["full_gc"][role], strict=True)]
        for role, counts in counters["full_gc"].items()
    }
    seconds_name = "infermesh_router_request_duration_seconds"
    result["router"] = {
        "refused_p99_ms": 1000
        * bucket_quantile(before, after, seconds_name, 0.99, tier="standard", code="RESOURCE_EXHAUSTED"),
        "vip_p99_ms": 1000 * bucket_quantile(before, after, seconds_name, 0.99, tier="vip", code="OK"),
    }
    time.sleep(10)  # measured: the mesh needs a few seconds after such a load before it is quiet again
    return result


def service_counters(mesh: Mesh) -> dict:
    """One scrape of each service so far: its full garbage collections and the
    seconds they held it, by role (the router, the batcher, the model servers
    together; each one stalls every call in flight there at once), and the
    batches that ran out of time at a model server after the batcher sent them."""
    full_gc, timed_out = {}, 0.0
    for name in mesh.processes:
        role = "model_server" if name.startswith("model_server") else name
        if role not in ("router", "batcher", "model_server"):
            continue
        samples = scrape(mesh.router_metrics if name == "router" else mesh.metrics_url(name))
        count, spent = full_gc.get(role, (0.0, 0.0))
        full_gc[role] = (
            count + samples.get(("infermesh_gc_pause_seconds_count", (("generation", "2"),)), 0.0),
            spent + samples.get(("infermesh_gc_pause_seconds_sum", (("generation", "2"),)), 0.0),
        )
        timed_out += sum(
            value for (sample, _), value in samples.items() if sample == "infermesh_batcher_batch_timeouts_total"
        )
    return {"full_gc": full_gc, "batch_timeouts": timed_out}


def summarise_overload(runs: list[dict], layout: str) -> dict:
    med = statistics.median
    rs = [r[layout] for r in runs]
    ratios = [r["vip_loaded"]["p99_ms"] / r["vip_alone"]["p99_ms"] for r in rs]
    return {
        "vip_alone_p99_ms": med(r["vip_alone"]["p99_ms"] for r in rs),
        "vip_loaded_p99_ms": med(r["vip_loaded"]["p99_ms"] for r in rs),
        "vip_p99_ratio": med(ratios),
        "vip_rejected": sum(r["vip_loaded"]["count"] - r["vip_loaded"]["ok"] for r in rs),
        "standard_rejected_share": med(r["standard"]["rejected"] / r["standard"]["count"] for r in rs),
        "standard_rejected_p50_ms": med(r["standard"]["rejected_p50_ms"] for r in rs),
        "standard_rejected_p99_ms": med(r["standard"]["rejected_p99_ms"] for r in rs),
        "light_rejected_p50_ms": med(r["light"]["rejected_p50_ms"] for r in rs),
        "light_rejected_p99_ms": med(r["light"]["rejected_p99_ms"] for r in rs),
        "light_rejected_share": med(r["light"]["rejected"] / r["light"]["count"] for r in rs),
        "standard_rejected_late": sum(r[caller]["rejected_late"] for r in rs for caller in ("standard", "light")),
        "standard_rejected_total": sum(r[caller]["rejected"] for r in rs for caller in ("standard", "light")),
        "standard_rejected_within_goal": sum(
            r[caller]["rejected_within_goal"] for r in rs for caller in ("standard", "light")
        ),
        "standard_timeouts": sum(
            r[caller]["statuses"].get("DeadlineExceeded", 0) for r in rs for caller in ("standard", "light")
        ),
        "standard_served_p99_ms": med(r["standard"]["p99_ms"] for r in rs),
        "standard_served_rps": med(_served_rps(r) for r in rs),
        "router_refused_p99_ms": med(r["router"]["refused_p99_ms"] for r in rs),
        "router_vip_p99_ms": med(r["router"]["vip_p99_ms"] for r in rs),
        "standard_served_share_of_saturation": med(_served_rps(r[layout]) / r["saturation"]["rps"] for r in runs),
        "vip_p99_ratio_per_run": ratios,
        "steal_per_run": [r.get("steal") for r in rs],
        "batch_timeouts": sum(r.get("batch_timeouts", 0) for r in rs),
        "full_gc": {
            role: [sum(r["full_gc"][role][i] for r in rs) for i in (0, 1)]
            for role in ("router", "batcher", "model_server")
        },
    }


def _served_rps(overload: dict) -> float:
    """Standard requests served per second, to the heavy and the light caller together."""
    return sum(overload[caller]["ok_rps"] for caller in ("standard", "light"))


def summarise(runs: list[dict]) -> dict:
    med = statistics.median
    return {
        "machine": machine(),
        "command": "python -m bench.batching " + " ".join(sys.argv[1:]),
        "runs": len(runs),
        "date": time.strftime("%Y-%m-%d"),
        "summary": {
            "ort_batch1": med(r["ort"][1] for r in runs),
            "ort_best": med(max(r["ort"].values()) for r in runs),
            "ort_gain": med(max(r["ort"].values()) / r["ort"][1] for r in runs),
            "mesh_on": med(r["on"]["rps"] for r in runs),
            "mesh_off": med(r["off"]["rps"] for r in runs),
            "mesh_gain": med(r["on"]["rps"] / r["off"]["rps"] for r in runs),
            "saturation": med(r["saturation"]["rps"] for r in runs),
            "one_instance": med(r["one_instance"]["rps"] for r in runs),
            "defaults_over_one_instance": med(r["on"]["rps"] / r["one_instance"]["rps"] for r in runs),
            "lent_batches": med(r["on"]["lent_batches"] for r in runs),
            **{
                f"trickle_{layout}_{key}": med(r[f"trickle_{layout}"][caller][field] for r in runs)
                for layout in ("defaults", "one_instance")
                for key, caller, field in (("standard_rps", "standard", "rps"), ("vip_p99_ms", "vip", "p99_ms"))
            },
            "trickle_vip_failed": sum(
                r[f"trickle_{layout}"]["vip"]["count"] - r[f"trickle_{layout}"]["vip"]["ok"]
                for r in runs
                for layout in ("defaults", "one_instance")
            ),
            "ort_gain_spread": spread([max(r["ort"].values()) / r["ort"][1] for r in runs]),
            "mesh_gain_spread": spread([r["on"]["rps"] / r["off"]["rps"] for r in runs]),
            "mesh_over_ort_best": spread([r["on"]["rps"] / max(r["ort"].values()) for r in runs]),
            **{layout: summarise_overload(runs, layout) for layout in LAYOUTS},
            "steal_per_run": [r.get("steal") for r in runs],
        },
        "raw": runs,
    }


def markdown(report: dict) -> str:
    s = report["summary"]
    overloads = [s[layout] for layout in LAYOUTS]
    return "\n".join(
        [
            f"Machine: {report['machine']}. Command: `{report['command']}`. Medians of {report['runs']} runs on "
            f"{report['date']}; ratios taken within each run; load from ghz.",
            "",
            "| batching | in-process ORT (sentences/s) | mesh at 64 callers (requests/s) |",
            "|---|---|---|",
            f"| off (batch 1) | {s['ort_batch1']:.0f} | {s['mesh_off']:.0f} |",
            f"| on (ORT: best batch; mesh: defaults) | {s['ort_best']:.0f} | {s['mesh_on']:.0f} |",
            f"| gain | × {s['ort_gain']:.2f} | × {s['mesh_gain']:.2f} |",
            "",
            f"Gains over runs (min–max): ORT × {span(s['ort_gain_spread'])}, mesh × {span(s['mesh_gain_spread'])}. "
            "They are not comparable as a share: unbatched, the mesh pays every hop per request, which batching also "
            f"amortises. Batched, the mesh serves {span(s['mesh_over_ort_best'])} of in-process ORT at its best batch "
            "(one session, a thread per core), in the same run.",
            "",
            f"Without VIP traffic, the defaults (two instances of minilm, the VIP one lent out after "
            f"{LEND_RESERVED_AFTER_S:g} s without VIP batches) served {s['mesh_on']:.0f} requests/s at 64 callers, "
            f"one instance {s['one_instance']:.0f}: × {s['defaults_over_one_instance']:.2f} in the same run "
            f"({s['lent_batches']:.0f} batches on loan per measurement).",
            "",
            f"While VIP traffic trickles in (one request a second beside the same 64 standard callers) the "
            f"reservation holds: the defaults served {s['trickle_defaults_standard_rps']:.0f} standard requests/s "
            f"against {s['trickle_one_instance_standard_rps']:.0f} with one instance, for a VIP p99 of "
            f"{s['trickle_defaults_vip_p99_ms']:.0f} against {s['trickle_one_instance_vip_p99_ms']:.0f} ms "
            f"({TRICKLE_VIP_REQUESTS} VIP requests a run, so the p99 is about their slowest; "
            f"{s['trickle_vip_failed']} failed).",
            "",
            f"Saturation of the defaults (the VIP instance lent out), measured in each run at the overload's 256 "
            f"callers (closed loop): {s['saturation']:.0f} requests/s; the overload's standard traffic runs open loop "
            "at twice that on every layout.",
            "",
            "| overload (standard at 2× saturation, VIP at 10% of it) | " + " | ".join(LAYOUTS.values()) + " | goal |",
            "|---|" + "---|" * len(LAYOUTS) + "---|",
            "| VIP p99 alone → under load | "
            + " | ".join(
                f"{o['vip_alone_p99_ms']:.0f} → {o['vip_loaded_p99_ms']:.0f} ms (× {o['vip_p99_ratio']:.2f})"
                for o in overloads
            )
            + " | ≤ × 1.5 |",
            "| VIP requests rejected | " + " | ".join(str(o["vip_rejected"]) for o in overloads) + " | 0 |",
            "| standard requests rejected | "
            + " | ".join(
                f"{o['standard_rejected_share']:.0%}, p50 {o['standard_rejected_p50_ms']:.2f} ms, p99 "
                f"{o['standard_rejected_p99_ms']:.2f} ms"
                for o in overloads
            )
            + " | < 5 ms |",
            f"| the same refusals as a light standard caller saw them ({LIGHT_CALLER_RPS} of the requests/s, "
            "4 workers) | "
            + " | ".join(
                f"{o['light_rejected_share']:.0%}, p50 {o['light_rejected_p50_ms']:.2f} ms, p99 "
                f"{o['light_rejected_p99_ms']:.2f} ms"
                for o in overloads
            )
            + " | < 5 ms |",
            "| the same two p99s as the router measured them (upper bound of the histogram bucket): VIP served; "
            "standard refused | "
            + " | ".join(f"≤ {o['router_vip_p99_ms']:.1f} ms; ≤ {o['router_refused_p99_ms']:.1f} ms" for o in overloads)
            + " | |",
            f"| standard refusals answered in under {REFUSAL_GOAL_MS} ms as ghz saw them (all runs, both callers) | "
            + " | ".join(
                f"{o['standard_rejected_within_goal'] / max(o['standard_rejected_total'], 1):.1%}" for o in overloads
            )
            + " | 100% |",
            f"| standard refusals that came late, after waiting (slower than {LATE_REFUSAL_MS} ms; all runs, both callers) | "
            + " | ".join(f"{o['standard_rejected_late']} of {o['standard_rejected_total']}" for o in overloads)
            + " | |",
            "| standard requests that timed out instead (all runs; in brackets, batches that ran out of time at the "
            "model server after they were sent) | "
            + " | ".join(f"{o['standard_timeouts']} ({o['batch_timeouts']:.0f})" for o in overloads)
            + " | 0 |",
            "| standard requests served: p99 (deadline 2 s) | "
            + " | ".join(f"{o['standard_served_p99_ms']:.0f} ms" for o in overloads)
            + " | |",
            "| standard requests served per second (share of saturation) | "
            + " | ".join(
                f"{o['standard_served_rps']:.0f} ({o['standard_served_share_of_saturation']:.0%})" for o in overloads
            )
            + " | |",
            "| full garbage collections during the overloads (all runs), and the mean pause: router; batcher; "
            "model server(s) | "
            + " | ".join(
                "; ".join(
                    f"{count:.0f} ({1000 * spent / count:.1f} ms)" if count else "0"
                    for count, spent in (o["full_gc"][role] for role in ("router", "batcher", "model_server"))
                )
                for o in overloads
            )
            + " | |",
            "| VIP p99 ratio in each run (CPU taken by the hypervisor during that overload) | "
            + " | ".join(
                ", ".join(
                    f"× {ratio:.2f} ({_share(steal)})"
                    for ratio, steal in zip(o["vip_p99_ratio_per_run"], o["steal_per_run"], strict=True)
                )
                for o in overloads
            )
            + " | |",
            "",
            "CPU time the hypervisor gave to other guests (steal) over each whole run: "
            + ", ".join(_share(steal) for steal in s["steal_per_run"])
            + ".",
            "",
        ]
    )


def _share(steal: float | None) -> str:
    return "steal unknown" if steal is None else f"steal {steal:.0%}"


def plot(report: dict, path: pathlib.Path) -> None:
    plt = pyplot()

    s = report["summary"]
    fig, (left, right, served) = plt.subplots(1, 3, figsize=(14, 4), gridspec_kw={"width_ratios": [4, 4, 2.2]})
    left.bar(
        ["ORT\nbatch 1", "ORT\nbest batch", "mesh\nbatch 1", "mesh\nbatching"],
        [s["ort_batch1"], s["ort_best"], s["mesh_off"], s["mesh_on"]],
        color=["#8c8c8c", "#c44e52", "#8c8c8c", "#4c72b0"],
    )
    left.set_ylabel("per second")
    left.set_title(f"batching gain: ORT x{s['ort_gain']:.2f}, mesh x{s['mesh_gain']:.2f}")
    labels = ["VIP alone", "VIP under\noverload", "standard\nrejections"]
    keys = ["vip_alone_p99_ms", "vip_loaded_p99_ms", "standard_rejected_p99_ms"]
    xs = range(len(labels))
    width = 0.8 / len(LAYOUTS)
    colors = dict(zip(LAYOUTS, ("#8c8c8c", "#dd8452", "#55a868", "#4c72b0"), strict=True))
    for i, (layout, color) in enumerate(colors.items()):
        right.bar(
            [x + (i - (len(LAYOUTS) - 1) / 2) * width for x in xs],
            [s[layout][k] for k in keys],
            width=width,
            color=color,
            label=LAYOUTS[layout],
        )
    right.set_xticks(list(xs), labels)
    right.set_yscale("log")
    right.set_ylim(top=6 * max(s[layout][k] for layout in LAYOUTS for k in keys))  # room for the legend
    plain = plt.FuncFormatter(lambda value, _: f"{value:g}")
    right.yaxis.set_major_formatter(plain)
    right.yaxis.set_minor_formatter(plt.NullFormatter())
    right.legend(fontsize=7, loc="upper left")
    right.set_ylabel("p99 latency, ms (log scale)")
    right.set_title("overload isolation")
    served.bar(
        range(len(LAYOUTS)), [s[layout]["standard_served_rps"] for layout in LAYOUTS], color=list(colors.values())
    )
    served.axhline(s["saturation"], color="grey", linewidth=0.8, linestyle=":")
    served.set_xticks(range(len(LAYOUTS)), ["one", "sliced", "defaults", "pools"])
    served.set_ylabel("standard served per second")
    served.set_ylim(0, 1.1 * s["saturation"])
    served.set_title("goodput under overload\n(dotted: saturation)", fontsize=10)
    save_figure(fig, path, report)


if __name__ == "__main__":
    sys.exit(main())
