"""The local mesh supervises its services as kubelet does: what exits or hangs
is restarted on the address it had, with a backoff that doubles and resets."""

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.launcher.mesh import Mesh, MeshConfig
from services.launcher.supervisor import RestartPolicy, exit_reason
from tests.conftest import ROOT, wait_until
from tests.oip import output_array, text_request

QUICK = RestartPolicy(
    base_delay_s=0.2, max_delay_s=2.0, stable_s=60.0, probe_period_s=0.3, probe_timeout_s=0.5, failure_threshold=3
)


@pytest.mark.unit
def test_the_restart_delay_doubles_up_to_its_bound():
    policy = RestartPolicy(base_delay_s=0.5, max_delay_s=4.0)
    assert [policy.delay_s(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


@pytest.mark.unit
@pytest.mark.parametrize(
    "fields",
    [{"base_delay_s": 0}, {"base_delay_s": 5, "max_delay_s": 1}, {"failure_threshold": 0}, {"probe_period_s": 0}],
)
def test_a_restart_policy_out_of_bounds_is_refused(fields):
    with pytest.raises(ValueError):
        RestartPolicy(**fields)


@pytest.mark.unit
def test_an_exit_is_told_by_its_signal_or_code():
    assert exit_reason(-9) == "killed by SIGKILL"
    assert exit_reason(3) == "exited with code 3"


@pytest.fixture
def supervised(model_repository, tmp_path):
    events: list[str] = []
    with Mesh(
        MeshConfig(
            models=model_repository,
            log_dir=tmp_path,
            l2_path=tmp_path / "l2",
            supervise=True,
            restart_policy=QUICK,
            batcher_args=("--replica-poll-s", "0.2"),
            router_args=("--catalog-poll-s", "0.2"),
        ),
        on_event=events.append,
    ) as mesh:
        yield mesh, events


def embed_until_answered(stub, text: str, timeout_s: float = 60.0):
    """Sends `text` until the mesh answers it (while a service restarts, UNAVAILABLE is its answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return output_array(stub.ModelInfer(text_request([text]), timeout=10), "EMBEDDING")
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def restarted(mesh, name: str, times: int):
    def check():
        state = mesh.status()[name]
        return state["restarts"] >= times and state["state"] == "running" and state["ready"]

    return check


@pytest.mark.e2e
def test_a_killed_batcher_comes_back_on_its_address_and_twice_in_a_row_waits_longer(supervised):
    mesh, events = supervised
    address = mesh.address("batcher")
    with grpc.insecure_channel(mesh.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert embed_until_answered(stub, "before").shape == (1, 384)
        for times in (1, 2):
            pid = mesh.processes["batcher"].popen.pid
            os.kill(pid, signal.SIGKILL)
            wait_until(restarted(mesh, "batcher", times), f"the batcher restarted {times} time(s)")
            assert mesh.processes["batcher"].popen.pid != pid
            assert mesh.address("batcher") == address
            assert embed_until_answered(stub, f"after {times}").shape == (1, 384)
    exits = [e for e in events if e.startswith("batcher") and "killed by SIGKILL" in e]
    assert [e.rsplit("restarting in ", 1)[1] for e in exits] == ["0.2s", "0.4s"], events
    assert mesh.status()["batcher"]["last_exit"] == "killed by SIGKILL"
    assert sum("batcher is back" in e for e in events) == 2


@pytest.mark.e2e
def test_a_hung_model_server_is_killed_after_its_liveness_checks_and_restarted(supervised):
    mesh, events = supervised
    process = mesh.processes["model_server"]
    os.kill(process.popen.pid, signal.SIGSTOP)  # alive to the kernel, answering nothing
    wait_until(restarted(mesh, "model_server", 1), "the hung model server restarted", timeout_s=90)
    assert any("did not answer 3 liveness checks" in e for e in events), events
    with grpc.insecure_channel(mesh.router) as channel:
        assert embed_until_answered(pb_grpc.GRPCInferenceServiceStub(channel), "after the hang").shape == (1, 384)


@pytest.mark.e2e
def test_redis_and_the_cache_killed_come_back_and_the_mesh_serves_from_the_cache_again(supervised):
    mesh, _ = supervised
    for name in ("redis", "cache"):
        os.kill(mesh.processes[name].popen.pid, signal.SIGKILL)
        wait_until(restarted(mesh, name, 1), f"{name} restarted")
    with grpc.insecure_channel(mesh.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert embed_until_answered(stub, "cached after restarts").shape == (1, 384)
    assert not mesh.dead()


@pytest.mark.e2e
def test_make_run_prints_each_restart_and_meshctl_lists_the_services(model_repository, tmp_path):
    run_file = tmp_path / "mesh.json"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.launcher",
            "--models",
            str(model_repository),
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--log-dir",
            str(tmp_path),
            "--run-file",
            str(run_file),
            "--l2-path",
            "",
            "--tenants-file",
            str(tmp_path / "tenants.yaml"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while "infermesh ready" not in (line := launcher.stdout.readline()):
            assert line, f"the launcher ended before it was ready: {launcher.stderr.read()}"
        table = subprocess.run(
            [sys.executable, "-m", "services.meshctl", "services", "--run-file", str(run_file)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert table.returncode == 0, table.stderr
        rows = {line.split()[0]: line.split() for line in table.stdout.splitlines()[1:]}
        assert set(rows) == {"redis", "model_server", "batcher", "cache", "router"}
        batcher_pid = int(rows["batcher"][1])
        os.kill(batcher_pid, signal.SIGKILL)
        told = []
        while not any("batcher is back" in t for t in told):
            told.append(launcher.stderr.readline())
            assert told[-1], f"the launcher's output ended: {told}"
        assert any("batcher (pid" in t and "killed by SIGKILL" in t for t in told), told

        def listed_again():
            out = subprocess.run(
                [sys.executable, "-m", "services.meshctl", "services", "--run-file", str(run_file)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
            row = next((line.split() for line in out.splitlines() if line.startswith("batcher")), None)
            return row if row and row[2] == "running" and row[3] == "1" and row[4] == "yes" else None

        row = wait_until(listed_again, "meshctl lists the batcher restarted once", timeout_s=30, interval_s=0.5)
        assert int(row[1]) != batcher_pid and row[5:] == ["killed", "by", "SIGKILL"]
        assert launcher.poll() is None  # the mesh lives on
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(60)


@pytest.mark.e2e
def test_a_launcher_killed_outright_takes_every_service_with_it_redis_included(model_repository, tmp_path):
    from tests.test_launcher import descendants

    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.launcher",
            "--models",
            str(model_repository),
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--log-dir",
            str(tmp_path),
            "--run-file",
            str(tmp_path / "mesh.json"),
            "--l2-path",
            "",
            "--tenants-file",
            str(tmp_path / "tenants.yaml"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        while "infermesh ready" not in (line := launcher.stdout.readline()):
            assert line, "the launcher ended before it was ready"
        children = descendants(launcher.pid)
        assert len(children) == 5
    finally:
        launcher.kill()  # no drain, no cleanup of its own: the kernel's death signal is all there is
        launcher.wait()

    def gone():
        return not any(
            os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read().lower()
            for pid in children
        )

    wait_until(gone, "every service of the killed launcher ended", timeout_s=30)
