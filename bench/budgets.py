"""Byte budgets under load: does every service stay within its memory while the
model server is blocked and callers send as much as they may?

One mesh per run (router, batcher, cache with Redis, one model server). In
each phase the model server is stopped (SIGSTOP: its batches hang, nothing is
answered), and the load is one of, in a seeded shuffled order:

- unary: callers looping maximum-size ModelInfer requests (minilm, long texts);
- stream: ModelStreamInfer streams writing maximum-size messages, a few in flight each;
- idle_streams: many ModelStreamInfer streams that asked once and then sit open;
- combined: all three at once.

Meanwhile a probe on a connection of its own asks ServerLive and a small
ModelInfer whose answer was cached before the block, twice a second. Every
service's RSS (VmRSS from /proc) and held bytes (its metrics) are sampled; a
refusal honours its retry hint. After the phase the model server resumes, and
the next phase starts once nothing is held anywhere.

Goals: each service's peak RSS stays under its byte budget plus its stated
baseline (the `baseline_bytes` of its config); the excess is answered
RESOURCE_EXHAUSTED (nothing else but deadlines of the requests held); every
probe succeeds.

    .venv/bin/python -m bench.budgets --runs 3

Writes bench/results/budgets.{json,md}. `rows(settings, runs, seed)` gives the
figures to another benchmark (one row per phase and service).
"""

import argparse
import asyncio
import dataclasses
import itertools
import os
import pathlib
import re
import signal
import sys
import tempfile
import time

import grpc
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from bench.report import (
    chosen_seed,
    goal_verdict,
    machine,
    phase_order,
    process_rss_bytes,
    progress,
    seed_argument,
    span,
    spread,
    write,
)
from services.batcher.config import BatcherConfig
from services.cache.config import CacheConfig
from services.common import errors
from services.common.budget import MIB
from services.common.metrics import scrape
from services.common.tensors import pack_bytes_elements
from services.launcher.mesh import Mesh, MeshConfig
from services.model_server.config import ModelServerConfig
from services.router.config import RouterConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVICES = ("router", "batcher", "cache", "model_server")
BASELINES = {
    "router": RouterConfig.baseline_bytes,
    "batcher": BatcherConfig.baseline_bytes,
    "cache": CacheConfig.baseline_bytes,
    "model_server": ModelServerConfig.baseline_bytes,
}
PHASES = ("unary", "stream", "idle_streams", "combined")
MODEL = "minilm"
TEXTS_PER_REQUEST = 16  # minilm takes up to 64 rows; 16 long texts make one maximum-size request
OWN_CONNECTION = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
]
SAMPLE_S = 0.2
EXPECTED_CODES = {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}


@dataclasses.dataclass(frozen=True)
class Settings:
    seconds: float = 20.0  # of each phase's load
    request_mib: int = 16  # the router's max_request_bytes and max_stream_message_bytes (its default)
    unary_callers: int = 16
    streams: int = 4
    stream_window: int = 4  # messages in flight per stream
    idle_streams: int = 256
    # Each service's memory limit, as its pod states it (mesh/kubernetes/base); the budgets derive from them.
    router_memory_mib: int = 1024
    batcher_memory_mib: int = 1024
    cache_memory_mib: int = 1024
    model_server_memory_mib: int = 6144

    def memory_bytes(self, service: str) -> int:
        return getattr(self, f"{service}_memory_mib") * MIB


def held_bytes(mesh: Mesh, service: str) -> float:
    values = scrape(mesh.metrics_url(service))
    return values.get(("infermesh_held_request_bytes", (("service", service),)), 0.0)


def budget_bytes(mesh: Mesh, service: str) -> float:
    values = scrape(mesh.metrics_url(service))
    return values.get(("infermesh_request_budget_bytes", (("service", service),)), float("nan"))


def text_request(texts: list[bytes], request_id: str = "") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=MODEL, id=request_id)
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[len(texts)])
    request.raw_input_contents.append(pack_bytes_elements(texts))
    return request


class Load:
    """The callers of one phase and what they were answered."""

    def __init__(self, address: str, settings: Settings):
        self.address = address
        self.settings = settings
        self.codes: dict[str, int] = {}
        self.probes = {"ok": 0, "failed": 0}
        self.probe_failures: list[str] = []
        self.refusals: dict[str, str] = {}  # the first message of each kind of refusal (its first words)
        self._serial = itertools.count()
        # A little under the limit: the message's own framing fits beside the texts.
        self._text_bytes = (settings.request_mib * MIB - 4096) // TEXTS_PER_REQUEST

    def big(self) -> pb.ModelInferRequest:
        """A maximum-size request unlike any other (identical ones would share one computation)."""
        serial = next(self._serial)
        texts = [b"%d-%d " % (serial, i) + b"a" * self._text_bytes for i in range(TEXTS_PER_REQUEST)]
        for i, text in enumerate(texts):
            texts[i] = text[: self._text_bytes]
        return text_request(texts, f"big-{serial}")

    def count(self, code: str, message: str = "") -> None:
        self.codes[code] = self.codes.get(code, 0) + 1
        if message and len(self.refusals) < 8:
            self.refusals.setdefault(f"{code}: {re.sub(r'[0-9]+', 'N', message)[:60]}", message[:300])

    async def unary_caller(self, channel) -> None:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while True:
            try:
                await stub.ModelInfer(self.big(), timeout=self.settings.seconds)
                self.count("OK")
            except grpc.aio.AioRpcError as exc:
                self.count(exc.code().name, exc.details() or "")
                hint = errors.retry_after_ms(exc.trailing_metadata())
                if hint:
                    await asyncio.sleep(hint / 1000)

    async def streamer(self, channel) -> None:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
        window = asyncio.Semaphore(self.settings.stream_window)

        async def write() -> None:
            while True:
                await window.acquire()
                await call.write(self.big())

        writer = asyncio.create_task(write())
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    return
                code = response.infer_response.parameters["grpc_status"].string_param or "OK"
                self.count(code, response.error_message)
                hint = response.infer_response.parameters["retry_after_ms"].int64_param
                if hint:
                    await asyncio.sleep(hint / 1000)
                window.release()
        finally:
            writer.cancel()
            call.cancel()

    async def idle_stream(self, channel, index: int) -> None:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
        try:
            await call.write(pb.ModelInferRequest(model_name="no-such-model", id=f"idle-{index}"))
            await call.read()  # answered at once (NOT_FOUND): the stream is open and now sits idle
            await call.read()
        finally:
            call.cancel()

    async def probe(self, channel, cached: pb.ModelInferRequest) -> None:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while True:
            try:
                await stub.ServerLive(pb.ServerLiveRequest(), timeout=5)
                await stub.ModelInfer(cached, timeout=5)
                self.probes["ok"] += 1
            except grpc.aio.AioRpcError as exc:
                self.probes["failed"] += 1
                if len(self.probe_failures) < 5:
                    self.probe_failures.append(f"{exc.code().name}: {exc.details()}")
            await asyncio.sleep(0.5)


async def run_phase(mesh: Mesh, phase: str, settings: Settings, cached: pb.ModelInferRequest) -> dict:
    """One phase with the model server stopped; peak RSS and held bytes per service."""
    pids = {name: mesh.processes[name].popen.pid for name in SERVICES}
    load = Load(mesh.router, settings)
    channels = [grpc.aio.insecure_channel(mesh.router, options=OWN_CONNECTION) for _ in range(4)]
    probe_channel = grpc.aio.insecure_channel(mesh.router, options=OWN_CONNECTION)
    peaks = {name: {"rss_bytes": process_rss_bytes(pid), "held_bytes": 0.0} for name, pid in pids.items()}
    os.kill(pids["model_server"], signal.SIGSTOP)
    tasks = [asyncio.create_task(load.probe(probe_channel, cached))]
    if phase in ("unary", "combined"):
        tasks += [asyncio.create_task(load.unary_caller(channels[i % 2])) for i in range(settings.unary_callers)]
    if phase in ("stream", "combined"):
        tasks += [asyncio.create_task(load.streamer(channels[2])) for _ in range(settings.streams)]
    if phase in ("idle_streams", "combined"):
        tasks += [asyncio.create_task(load.idle_stream(channels[3], i)) for i in range(settings.idle_streams)]
    loop = asyncio.get_running_loop()
    ends = loop.time() + settings.seconds
    samples = 0
    try:
        while loop.time() < ends:
            await asyncio.sleep(SAMPLE_S)
            samples += 1
            for name, pid in pids.items():
                peaks[name]["rss_bytes"] = max(peaks[name]["rss_bytes"], process_rss_bytes(pid))
                if samples % 3 == 0 and name != "model_server":  # a stopped process serves no metrics
                    peaks[name]["held_bytes"] = max(
                        peaks[name]["held_bytes"], await asyncio.to_thread(held_bytes, mesh, name)
                    )
            dead = mesh.dead()
            if dead:
                raise RuntimeError(f"{', '.join(dead)} died during phase {phase}")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        os.kill(pids["model_server"], signal.SIGCONT)
        for channel in [*channels, probe_channel]:
            await channel.close()
    drained_at = loop.time()
    while any([await asyncio.to_thread(held_bytes, mesh, name) for name in SERVICES]):
        if loop.time() - drained_at > 120:
            raise RuntimeError(f"bytes still held two minutes after phase {phase}")
        await asyncio.sleep(0.5)
    return {
        "phase": phase,
        "peaks": peaks,
        "codes": load.codes,
        "probes": load.probes,
        "probe_failures": load.probe_failures,
        "refusals": load.refusals,
        "drain_s": loop.time() - drained_at,
        "dead": mesh.dead(),
    }


def mesh_arguments(settings: Settings) -> dict:
    size = str(settings.request_mib * MIB)
    memory = {name: ("--memory-limit-bytes", str(settings.memory_bytes(name))) for name in SERVICES}
    return {
        # Texts as long as the load's (the default limit is 64 KiB a text): the requests must be
        # accepted and held, not refused at the edge, for the budgets to be what bounds them.
        "router_args": (
            *memory["router"],
            "--max-request-bytes",
            size,
            "--max-stream-message-bytes",
            size,
            "--max-text-bytes",
            size,
        ),
        # Polls far apart: a stopped model server stays a ready replica, so its batches hang rather than
        # being refused UNAVAILABLE once its polls fail.
        "batcher_args": (*memory["batcher"], "--replica-poll-s", "60"),
        "cache_args": memory["cache"],
        "model_server_args": memory["model_server"],
    }


async def one_run(settings: Settings, run: int, seed: int) -> dict:
    with (
        tempfile.TemporaryDirectory(prefix="budgets-") as logs,
        Mesh(MeshConfig(models=ROOT / "build" / "models", log_dir=logs, **mesh_arguments(settings))) as mesh,
    ):
        pids = {name: mesh.processes[name].popen.pid for name in SERVICES}
        async with grpc.aio.insecure_channel(mesh.router, options=OWN_CONNECTION) as channel:
            cached = text_request([b"a small request, answered from the cache"], "small")
            await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(cached, timeout=60)  # computed and stored
        idle = {name: process_rss_bytes(pid) for name, pid in pids.items()}
        budgets = {name: await asyncio.to_thread(budget_bytes, mesh, name) for name in SERVICES}
        phases = []
        for phase in phase_order(PHASES, run, seed):
            progress(f"run {run + 1}: phase {phase}")
            phases.append(await run_phase(mesh, phase, settings, cached))
        return {"run": run, "idle_rss_bytes": idle, "budget_bytes": budgets, "phases": phases}


def rows(settings: Settings = Settings(), runs: int = 1, seed: int | None = None) -> list[dict]:
    """One row per phase and service, over `runs` runs: peak RSS, budget,
    baseline, their sum and whether the peak stayed under it, the answers'
    codes and the probes. For bench/hardening and this benchmark's report."""
    report = measure(settings, runs, seed)
    return report["rows"]


def measure(settings: Settings, runs: int, seed: int | None) -> dict:
    seed = chosen_seed(seed)
    results = [asyncio.run(one_run(settings, run, seed)) for run in range(runs)]
    table = []
    for phase in PHASES:
        per_run = [next(p for p in r["phases"] if p["phase"] == phase) for r in results]
        codes: dict[str, int] = {}
        for p in per_run:
            for code, n in p["codes"].items():
                codes[code] = codes.get(code, 0) + n
        for service in SERVICES:
            peaks = [p["peaks"][service]["rss_bytes"] for p in per_run]
            bounds = [r["budget_bytes"][service] + BASELINES[service] for r in results]
            table.append(
                {
                    "phase": phase,
                    "service": service,
                    "peak_rss_mib": spread([v / MIB for v in peaks]),
                    "peak_held_mib": spread([p["peaks"][service]["held_bytes"] / MIB for p in per_run]),
                    "budget_mib": results[0]["budget_bytes"][service] / MIB,
                    "baseline_mib": BASELINES[service] / MIB,
                    "idle_rss_mib": spread([r["idle_rss_bytes"][service] / MIB for r in results]),
                    "under_budget_and_baseline": goal_verdict(
                        [b - v for v, b in zip(peaks, bounds, strict=True)], lambda m: m >= 0
                    ),
                    "codes": codes,
                    "probes_failed": sum(p["probes"]["failed"] for p in per_run),
                    "probes_ok": sum(p["probes"]["ok"] for p in per_run),
                    # The excess is refused, and what was taken waits out its deadline: nothing else.
                    "unexpected_codes": sorted(set(codes) - EXPECTED_CODES),
                }
            )
    return {
        "machine": machine(),
        "runs": runs,
        "seed": seed,
        "settings": dataclasses.asdict(settings),
        "command": "python -m bench.budgets " + " ".join(sys.argv[1:]),
        "results": results,
        "rows": table,
    }


def markdown(report: dict) -> str:
    lines = [
        "# Byte budgets under a blocked model server",
        "",
        f"Machine: {report['machine']}; {report['runs']} run(s), phase order seed {report['seed']}; "
        f"command: `{report['command']}`.",
        "",
        f"Settings: {report['settings']}.",
        "",
        "Peak RSS per service and phase, median (min–max) over runs, against the byte budget plus the "
        "stated baseline (the service's config).",
        "",
        "| phase | service | peak RSS MiB | idle RSS MiB | peak held MiB | budget MiB | baseline MiB | "
        "under budget + baseline | probes ok / failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['phase']} | {row['service']} | {span(row['peak_rss_mib'], '{:.0f}')} | "
            f"{span(row['idle_rss_mib'], '{:.0f}')} | {span(row['peak_held_mib'], '{:.1f}')} | "
            f"{row['budget_mib']:.0f} | {row['baseline_mib']:.0f} | {row['under_budget_and_baseline']} | "
            f"{row['probes_ok']} / {row['probes_failed']} |"
        )
    lines += ["", "Answers to the load, by code (all runs; requests cut at a phase's end are not counted):", ""]
    for phase in PHASES:
        row = next(r for r in report["rows"] if r["phase"] == phase)
        codes = ", ".join(f"{code} {n}" for code, n in sorted(row["codes"].items())) or "none answered"
        unexpected = f" (unexpected: {', '.join(row['unexpected_codes'])})" if row["unexpected_codes"] else ""
        lines.append(f"- {phase}: {codes}{unexpected}")
    lines += ["", "Refusals, a message of each kind (first run):", ""]
    for phase in report["results"][0]["phases"]:
        for message in phase["refusals"].values():
            lines.append(f"- {phase['phase']}: {message}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    for field in dataclasses.fields(Settings):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), default=field.default)
    seed_argument(parser)
    args = parser.parse_args()
    settings = Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)})
    started = time.monotonic()
    report = measure(settings, args.runs, args.seed)
    report["wall_s"] = time.monotonic() - started
    write(args.out, "budgets", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
