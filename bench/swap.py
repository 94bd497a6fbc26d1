"""Hot swap under load through the whole mesh: minilm version 1 -> 2 (INT8) and
back, each a fresh load (warm-up, golden probe, swap), while 16 callers keep
sending unique texts through the router. Per swap: failed requests, p99
before vs during the swap, and the time from the load request to the first
answer from the new version.

    .venv/bin/python -m bench.swap --runs 3

Writes bench/results/swap.{json,md,png}.
"""

import argparse
import asyncio
import json
import pathlib
import shutil
import statistics
import tempfile
import time

import grpc
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from bench.report import machine, progress, pyplot, write
from bench.workload import texts
from services.launcher.mesh import Mesh, MeshConfig
from tests.oip import text_request

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ROOT / "build" / "models"
CALLERS = 16
SETTLE_S = 8.0  # steady load before each swap, and the window "before" is measured over


def _repository(work: pathlib.Path) -> pathlib.Path:
    """minilm versions 1 and 2 of the built repository, version 1 serving."""
    source = MODELS / "minilm"
    for version in ("1", "2"):
        if not (source / version / "model.onnx").is_file():
            raise SystemExit(f"{source / version} is missing: run 'make setup'")
    target = work / "repo" / "minilm"
    target.mkdir(parents=True)
    for item in source.iterdir():
        if item.is_dir():
            (target / item.name).symlink_to(item.resolve(), target_is_directory=True)
        else:
            shutil.copy(item, target / item.name)
    config = json.loads((target / "config.json").read_text())
    config["version_policy"] = {"specific": {"versions": [1]}}
    config.pop("fallback", None)  # minilm-lite is not part of this repository
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return work / "repo"


def _p99(values: list[float]) -> float:
    values = sorted(values)
    return 1000 * values[min(len(values) - 1, int(0.99 * len(values)))] if values else float("nan")


async def _one_run(mesh: Mesh, run: int) -> list[dict]:
    router, model_server = mesh.router, mesh.address("model_server")
    records: list[tuple[float, float, str, str]] = []  # start, latency, version, error code
    stop = asyncio.Event()
    sequence = iter(texts(200_000, seed=run + 1))

    async with grpc.aio.insecure_channel(router) as channel, grpc.aio.insecure_channel(model_server) as control_channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        control = pb_grpc.GRPCInferenceServiceStub(control_channel)

        async def caller():
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    response = await stub.ModelInfer(text_request([f"{run} {next(sequence)}"]), timeout=30)
                    records.append((started, time.perf_counter() - started, response.model_version, ""))
                except grpc.aio.AioRpcError as exc:
                    records.append((started, time.perf_counter() - started, "", exc.code().name))

        callers = [asyncio.create_task(caller()) for _ in range(CALLERS)]
        swaps = []
        for target in ("2", "1"):
            await asyncio.sleep(SETTLE_S)
            override = json.dumps({"version_policy": {"specific": {"versions": [int(target)]}}})
            requested = time.perf_counter()
            await control.RepositoryModelLoad(
                pb.RepositoryModelLoadRequest(
                    model_name="minilm", parameters={"config": pb.ModelRepositoryParameter(string_param=override)}
                ),
                timeout=300,
                metadata=mesh.credentials("dev-admin"),
            )
            swaps.append((target, requested, time.perf_counter()))
        await asyncio.sleep(SETTLE_S)
        stop.set()
        await asyncio.gather(*callers)

    results = []
    for target, requested, loaded in swaps:
        first_new = min((s + lat for s, lat, v, _ in records if v == target and s >= requested), default=float("nan"))
        settled = first_new + 2.0  # the router's and batcher's catalogs poll once a second
        before = [lat for s, lat, _, err in records if requested - SETTLE_S <= s < requested and not err]
        during = [lat for s, lat, _, err in records if requested <= s < settled and not err]
        window = [r for r in records if requested - SETTLE_S <= r[0] < settled + SETTLE_S / 2]
        results.append(
            {
                "to_version": target,
                "load_rpc_s": loaded - requested,
                "to_traffic_s": first_new - requested,
                "requests": len(window),
                "failed": sum(1 for r in window if r[3]),
                "failed_codes": sorted({r[3] for r in window if r[3]}),
                "p99_before_ms": _p99(before),
                "p99_during_ms": _p99(during),
                "p50_before_ms": 1000 * statistics.median(before),
                "p50_during_ms": 1000 * statistics.median(during) if during else float("nan"),
            }
        )
    results.append(
        {
            "timeline": [
                (round(s - records[0][0], 3), round(1000 * lat, 2), v or err)
                for s, lat, v, err in records[:: max(1, len(records) // 4000)]
            ],
            "swap_marks": [(t, round(a - records[0][0], 3), round(b - records[0][0], 3)) for t, a, b in swaps],
        }
    )
    return results


def _plot(report: dict, path: pathlib.Path) -> None:
    plt = pyplot()

    last = report["runs"][-1]
    timeline = last["timeline"]
    fig, ax = plt.subplots(figsize=(10, 4))
    for label, color in (("1", "tab:blue"), ("2", "tab:orange")):
        points = [(t, ms) for t, ms, v in timeline if v == label]
        ax.scatter(
            [p[0] for p in points], [p[1] for p in points], s=3, color=color, label=f"answered by version {label}"
        )
    failed = [(t, ms) for t, ms, v in timeline if v not in ("1", "2")]
    if failed:
        ax.scatter([p[0] for p in failed], [p[1] for p in failed], s=12, color="red", marker="x", label="failed")
    for target, requested, loaded in last["swap_marks"]:
        ax.axvspan(requested, loaded, color="grey", alpha=0.2)
        ax.annotate(f"load v{target}", (requested, ax.get_ylim()[1] * 0.9), fontsize=8)
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"minilm hot swap under load ({CALLERS} callers); grey: load request to swap")
    ax.legend(loc="lower right", markerscale=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-swap-"))
    repo = _repository(work)
    runs = []
    # No rollback standby, so every swap (both directions, every run) is a fresh load.
    with Mesh(
        MeshConfig(models=repo, cache=False, log_dir=work, model_server_args=("--rollback-grace-s", "0"))
    ) as mesh:
        for run in range(args.runs):
            results = asyncio.run(_one_run(mesh, run))
            detail = results.pop()
            runs.append({"swaps": results, **detail})
            for r in results:
                progress(
                    f"run {run + 1}/{args.runs} -> v{r['to_version']}: {r['failed']} failed of {r['requests']}, "
                    f"load RPC {r['load_rpc_s']:.2f}s, first answer from v{r['to_version']} after "
                    f"{r['to_traffic_s']:.2f}s, p99 {r['p99_before_ms']:.0f} -> {r['p99_during_ms']:.0f} ms"
                )
        dead = mesh.dead()
    shutil.rmtree(work, ignore_errors=True)

    swaps = [s for run in runs for s in run["swaps"]]

    def med(key: str, to: str | None = None) -> float:
        return statistics.median(s[key] for s in swaps if to is None or s["to_version"] == to)

    summary = {
        "failed_total": sum(s["failed"] for s in swaps),
        "requests_total": sum(s["requests"] for s in swaps),
        "swaps": len(swaps),
        **{f"{key}_median": med(key) for key in ("load_rpc_s", "to_traffic_s", "p99_before_ms", "p99_during_ms")},
    }
    report = {
        "machine": machine(),
        "command": f"python -m bench.swap --runs {args.runs}",
        "callers": CALLERS,
        "dead_services": dead,
        "summary": summary,
        "runs": runs,
    }
    rows = "\n".join(
        f"| {i // 2 + 1} | v{3 - int(s['to_version'])} → v{s['to_version']} | {s['failed']} / {s['requests']} | "
        f"{s['load_rpc_s']:.2f} | {s['to_traffic_s']:.2f} | {s['p99_before_ms']:.0f} | {s['p99_during_ms']:.0f} |"
        for i, s in enumerate(swaps)
    )
    markdown = f"""# Hot swap under load

`{report["command"]}` on {report["machine"]}; the mesh (router, batcher, model server, no cache) and the
{CALLERS} closed-loop callers share the machine. Each swap is a fresh load: the new version is loaded beside
the serving one, warmed up, checked against minilm's golden probe, then swapped in; the rollback standby is
off (`--rollback-grace-s 0`) so going back is a fresh load too.

| run | swap | failed / requests | load RPC (s) | load request → first answer from the new version (s) | p99 before (ms) | p99 during (ms) |
|---|---|---|---|---|---|---|
{rows}

Medians over {len(swaps)} swaps: load RPC {summary["load_rpc_s_median"]:.2f} s, first answer from the new version
{summary["to_traffic_s_median"]:.2f} s after the request; p99 {summary["p99_before_ms_median"]:.0f} ms before vs
{summary["p99_during_ms_median"]:.0f} ms during (the load, warm-up and probe share the 2 cores with serving).
Failed requests in all: **{summary["failed_total"]} of {summary["requests_total"]}**.
"""
    write(args.out, "swap", report, markdown, _plot)
    return 0 if summary["failed_total"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
