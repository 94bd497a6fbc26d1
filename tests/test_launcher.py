"""make run's launcher: one ready line, a working router, and SIGTERM stops every
process it started, redis-server included."""

import concurrent.futures
import contextlib
import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.launcher.ports import free_ports
from tests.conftest import ROOT, metric, scrape, wait_until
from tests.oip import output_array, text_request

pytestmark = pytest.mark.e2e


def descendants(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = pathlib.Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry))
    return found


def names_of(pids) -> set[str]:
    return {open(f"/proc/{pid}/cmdline").read().replace("\0", " ") for pid in pids}


def test_launcher_serves_then_drains_and_stops_everything(model_repository, redis_binary, tmp_path):
    port, metrics_port = free_ports(2)
    run_file = tmp_path / "mesh.json"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.launcher",
            "--models",
            str(model_repository),
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--log-dir",
            str(tmp_path),
            "--run-file",
            str(run_file),
            "--l2-path",
            str(tmp_path / "l2"),
            "--tenants-file",
            str(tmp_path / "tenants.yaml"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "INFERMESH_CACHE_ADMIN_TOKEN": "t0ken"},
    )
    try:
        # No registry yet: the launcher makes one and shows its development keys, once, before it starts.
        shown = [launcher.stdout.readline() for _ in range(4)]
        assert shown[0].startswith(f"wrote the tenant registry {tmp_path / 'tenants.yaml'}"), shown
        assert [line.split()[0] for line in shown[1:]] == ["dev-vip", "dev-standard", "dev-admin"]
        assert oct((tmp_path / "tenants.yaml").stat().st_mode & 0o777) == "0o600"
        line = launcher.stdout.readline()
        assert line.startswith(f"infermesh ready: router gRPC 127.0.0.1:{port}"), line
        assert f"http://127.0.0.1:{metrics_port}/metrics" in line
        children = descendants(launcher.pid)
        names = names_of(children)
        assert len(children) == 5, names  # redis, model_server, batcher, cache, router
        assert any("redis-server" in n for n in names)

        running = json.loads(run_file.read_text())
        assert set(running) == {
            "router",
            "batcher",
            "cache",
            "model_server",
            "redis",
            "metrics",
            "launcher",
            "services",
        }
        assert running["launcher"] == launcher.pid
        assert {s["pid"] for s in running["services"].values()} == children
        assert all(s["state"] == "running" and s["ready"] for s in running["services"].values()), running
        assert set(running["metrics"]) == {"router", "batcher", "cache", "model_server"}
        assert "infermesh_batcher_queue_length" in urllib.request.urlopen(running["metrics"]["batcher"]).read().decode()
        purge = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cache.admin",
                "purge",
                "minilm",
                "--run-file",
                str(run_file),
                "--token",
                "t0ken",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert purge.returncode == 0 and "purged model minilm: generation 1" in purge.stdout, purge.stderr
        refused = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cache.admin",
                "purge",
                "minilm",
                "--run-file",
                str(run_file),
                "--token",
                "wrong",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            assert stub.ServerReady(pb.ServerReadyRequest()).ready
            assert "infermesh_grpc_requests_total" in {n for n, _ in scrape(f"http://127.0.0.1:{metrics_port}/metrics")}
            for i in range(4):
                stub.ModelInfer(text_request([f"status check {i}"]), timeout=60)
            # The batcher applies mesh/istio's traffic policy; meshctl reads it back from the running mesh.
            status = subprocess.run(
                [sys.executable, "-m", "services.meshctl", "status", "model-server", "--run-file", str(run_file)],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            assert status.returncode == 0, status.stderr
            blue = next(line.split() for line in status.stdout.splitlines() if line.startswith("blue"))
            assert blue[1:3] == ["100", "1"] and int(blue[3]) >= 4 and blue[4] == "100.00%"
            # An idle stream: the drain ends it at once rather than after the router's 10 s grace.
            outgoing: queue.Queue = queue.Queue()
            stream = stub.ModelStreamInfer(iter(outgoing.get, None), timeout=60)
            outgoing.put(text_request(["before the drain"], request_id="s1"))
            assert next(stream).infer_response.id == "s1"

            def read_to_the_end():
                rest = []
                with contextlib.suppress(grpc.RpcError):  # the status says how it ended
                    rest.extend(stream)
                return rest, time.monotonic()

            stream_ended = concurrent.futures.ThreadPoolExecutor(1).submit(read_to_the_end)
            # The model server is held while a request reaches it, so the request is in flight
            # when the drain begins, however busy the machine; the drain must finish it.
            model_server = next(
                c for c in children if "services.model_server" in pathlib.Path(f"/proc/{c}/cmdline").read_text()
            )
            os.kill(model_server, signal.SIGSTOP)
            try:
                in_flight = stub.ModelInfer.future(text_request([f"in flight {i}" for i in range(8)]), timeout=60)
                wait_until(
                    lambda: metric(running["metrics"]["batcher"], "infermesh_batcher_inflight_batches") >= 1,
                    "the request's batch sent to the model server",
                )
                launcher.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
            finally:
                os.kill(model_server, signal.SIGCONT)
            assert output_array(in_flight.result(), "EMBEDDING").shape == (8, 384)
            rest, ended_at = stream_ended.result(timeout=30)
            # Ended by the drain, not by its caller: UNAVAILABLE, so that whatever was on the wire is sent again.
            assert rest == [] and stream.code() == grpc.StatusCode.UNAVAILABLE and "draining" in stream.details()
            assert ended_at - signalled < 5, "the idle stream was held until the grace ran out"
            outgoing.put(None)
        assert launcher.wait(timeout=60) == 0
        assert "infermesh: stopped" in launcher.stdout.read()
        assert not run_file.exists()
        for child in children:
            assert (
                not os.path.exists(f"/proc/{child}")
                or "zombie" in pathlib.Path(f"/proc/{child}/status").read_text().lower()
            )
    finally:
        if launcher.poll() is None:
            launcher.kill()
