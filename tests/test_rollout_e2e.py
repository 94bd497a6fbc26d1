"""meshctl rollout on a local mesh under load: green serving minilm version 2
(INT8) is raised step by step and promoted; a green that cannot serve is rolled
back by itself, with client-visible errors only from the first step."""

import asyncio
import json
import pathlib
import shutil
import sys
import uuid

import grpc
import pytest
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.launcher.mesh import Mesh
from services.meshctl import core
from tests.oip import text_request

POLICY = pathlib.Path(__file__).resolve().parent.parent / "mesh" / "istio" / "model-server-traffic.yaml"


@pytest.fixture
def blue_green(model_repository, tmp_path):
    policy = tmp_path / "traffic.yaml"
    shutil.copy(POLICY, policy)
    with Mesh(models=model_repository, cache=False, log_dir=tmp_path, model_servers=2,
              model_server_labels=("version=blue,pool=vip", "version=green"),
              batcher_args=("--replica-poll-s", "0.2", "--traffic-policy", str(policy)),
              router_args=("--catalog-poll-s", "0.2")) as mesh:
        yield mesh, policy


async def rollout_under_load(mesh, policy, step: int) -> tuple[int, list, list]:
    """Runs meshctl rollout while 8 callers send texts; returns its exit code, the answers and the errors."""
    answers, failures, stop = [], [], asyncio.Event()

    async def caller(stub):
        while not stop.is_set():
            try:
                answers.append(await stub.ModelInfer(text_request([f"rollout {uuid.uuid4().hex}"]), timeout=30))
            except grpc.aio.AioRpcError as exc:
                failures.append(exc.code())

    async with grpc.aio.insecure_channel(mesh.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        callers = [asyncio.create_task(caller(stub)) for _ in range(8)]
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.meshctl", "--file", str(policy), "rollout", "model-server", "green",
            "--step", str(step), "--max-weight", "50", "--interval-s", "1.5", "--max-p99-ms", "5000",
            "--metrics", mesh.metrics_url("batcher"), stdout=asyncio.subprocess.PIPE)
        out, _ = await process.communicate()
        await asyncio.sleep(0.6)  # the batcher follows the last edit
        stop.set()
        await asyncio.gather(*callers)
    print(out.decode())
    return process.returncode, answers, failures


async def green_control(mesh) -> pb_grpc.GRPCInferenceServiceStub:
    return grpc.aio.insecure_channel(mesh.processes["model_server-1"].info["grpc"])


async def test_a_healthy_version_2_is_rolled_out_and_promoted(blue_green):
    mesh, policy = blue_green
    async with grpc.aio.insecure_channel(mesh.processes["model_server-1"].info["grpc"]) as channel:
        control = pb_grpc.GRPCInferenceServiceStub(channel)
        override = json.dumps({"version_policy": {"specific": {"versions": [2]}}})
        await control.RepositoryModelLoad(pb.RepositoryModelLoadRequest(
            model_name="minilm", parameters={"config": pb.ModelRepositoryParameter(string_param=override)}), timeout=120)
    code, answers, failures = await rollout_under_load(mesh, policy, step=25)
    assert code == 0 and not failures
    assert core.weights(policy, "model-server") == {"blue": 0, "green": 100}
    assert answers[-1].model_version == "2"  # green's INT8 version answers now
    assert {a.model_version for a in answers} == {"1", "2"}


async def test_a_green_that_cannot_serve_is_rolled_back_by_itself(blue_green):
    mesh, policy = blue_green
    async with grpc.aio.insecure_channel(mesh.processes["model_server-1"].info["grpc"]) as channel:
        control = pb_grpc.GRPCInferenceServiceStub(channel)
        await control.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="minilm"), timeout=30)
    await asyncio.sleep(0.5)
    code, answers, failures = await rollout_under_load(mesh, policy, step=10)
    assert code == 1
    assert core.weights(policy, "model-server") == {"blue": 100, "green": 0}
    # Only batches picked for green during the first step (10% of traffic for 1.5 s) could fail.
    assert len(failures) <= 0.25 * (len(answers) + len(failures))
    assert set(failures) <= {grpc.StatusCode.UNAVAILABLE}
