"""meshctl rollout on a local mesh under load: green serving minilm version 2
(INT8) is raised step by step and promoted; a deliberately faulty version 2,
and a green that cannot serve at all, are rolled back by themselves, with
client-visible errors only from the first step."""

import asyncio
import json
import pathlib
import re
import shutil
import sys
import uuid

import grpc
import pytest
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.launcher.mesh import Mesh, MeshConfig
from services.meshctl import core
from tests.conftest import metric, until
from tests.faulty import faulty_repository
from tests.oip import text_request

pytestmark = pytest.mark.e2e

POLICY = pathlib.Path(__file__).resolve().parent.parent / "mesh" / "istio" / "model-server-traffic.yaml"
# Each weight is judged this long: at 10% and a few dozen batches a second it
# must be long enough that green surely gets some (1.5 s left it none about
# once in twenty runs, and "no evidence" fails the check).
INTERVAL_S = "3"


@pytest.fixture
def blue_green(request, model_repository, tmp_path):
    policy = tmp_path / "traffic.yaml"
    shutil.copy(POLICY, policy)
    if getattr(request, "param", "") == "faulty":
        model_repository = faulty_repository(model_repository, tmp_path / "models")
    with Mesh(
        MeshConfig(
            models=model_repository,
            cache=False,
            log_dir=tmp_path,
            model_servers=2,
            model_server_labels=("version=blue,pool=vip", "version=green"),
            batcher_args=("--replica-poll-s", "0.2", "--traffic-policy", str(policy)),
            router_args=("--catalog-poll-s", "0.2"),
        )
    ) as mesh:
        yield mesh, policy


def follows(mesh, policy) -> bool:
    """Whether the batcher's latest applied policy (it logs each) has the file's weights now."""
    applied = [
        line
        for line in (mesh.log_dir / "batcher.log").read_text().splitlines()
        if "traffic policy for model-server:" in line
    ]
    weights = core.weights(policy, "model-server")
    return bool(applied) and all(
        re.search(rf"\b{subset}={weight}\b", applied[-1]) for subset, weight in weights.items()
    )


def rollout_text() -> str:
    return (
        f"rollout {uuid.uuid4().hex}: where is my parcel? It was due on Monday, the tracking page has "
        "said 'in transit' for a week, and nobody answers the phone or the emails I have sent. "
        "Could you tell me where it is, when it will arrive, and whom I should ask about a refund?"
    )


async def rollout_under_load(mesh, policy, step: int) -> tuple[int, list, list]:
    """Runs meshctl rollout while 8 callers send texts, until the batcher follows
    the file meshctl left; returns its exit code, the answers and the errors."""
    answers, failures, stop = [], [], asyncio.Event()

    async def caller(stub):
        while not stop.is_set():
            try:
                answers.append(await stub.ModelInfer(text_request([rollout_text()]), timeout=30))
            except grpc.aio.AioRpcError as exc:
                failures.append(exc.code())

    async with grpc.aio.insecure_channel(mesh.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        callers = [asyncio.create_task(caller(stub)) for _ in range(8)]
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.meshctl",
            "--file",
            str(policy),
            "rollout",
            "model-server",
            "green",
            "--step",
            str(step),
            "--max-weight",
            "50",
            "--interval-s",
            INTERVAL_S,
            "--max-p99-ms",
            "5000",
            "--metrics",
            mesh.metrics_url("batcher"),
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await process.communicate()
        await until(lambda: follows(mesh, policy), "the batcher applying the file meshctl left")
        stop.set()
        await asyncio.gather(*callers)
    print(out.decode())
    return process.returncode, answers, failures


async def green_control(mesh) -> pb_grpc.GRPCInferenceServiceStub:
    return grpc.aio.insecure_channel(mesh.processes["model_server-1"].info["grpc"])


async def serve_version_2_on_green(mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.processes["model_server-1"].info["grpc"]) as channel:
        control = pb_grpc.GRPCInferenceServiceStub(channel)
        override = json.dumps({"version_policy": {"specific": {"versions": [2]}}})
        await control.RepositoryModelLoad(
            pb.RepositoryModelLoadRequest(
                model_name="minilm", parameters={"config": pb.ModelRepositoryParameter(string_param=override)}
            ),
            timeout=120,
            metadata=mesh.credentials("dev-admin"),
        )


async def test_a_healthy_version_2_is_rolled_out_and_promoted(blue_green):
    mesh, policy = blue_green
    await serve_version_2_on_green(mesh)
    code, answers, failures = await rollout_under_load(mesh, policy, step=25)
    assert code == 0 and not failures
    assert core.weights(policy, "model-server") == {"blue": 0, "green": 100}
    assert {a.model_version for a in answers} == {"1", "2"}
    async with grpc.aio.insecure_channel(mesh.router) as channel:  # green's INT8 version answers now
        now = await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(text_request([rollout_text()]), timeout=30)
    assert now.model_version == "2"


async def test_a_green_that_cannot_serve_is_rolled_back_by_itself(blue_green):
    mesh, policy = blue_green

    def polls_of_green() -> float:
        return metric(mesh.metrics_url("model_server-1"), "infermesh_grpc_requests_total", method="ListModels")

    async with grpc.aio.insecure_channel(mesh.processes["model_server-1"].info["grpc"]) as channel:
        control = pb_grpc.GRPCInferenceServiceStub(channel)
        await control.RepositoryModelUnload(
            pb.RepositoryModelUnloadRequest(model_name="minilm"), timeout=30, metadata=mesh.credentials("dev-admin")
        )
    # The batcher knows: it has polled green since (two answers, so the first has surely been read).
    polled = polls_of_green()
    await until(lambda: polls_of_green() >= polled + 2, "the batcher polling green after the unload")
    code, answers, failures = await rollout_under_load(mesh, policy, step=10)
    assert code == 1
    assert core.weights(policy, "model-server") == {"blue": 100, "green": 0}
    # Only batches picked for green during the first step (10% of traffic for 3 s) could fail.
    assert len(failures) <= 0.25 * (len(answers) + len(failures))
    assert set(failures) <= {grpc.StatusCode.UNAVAILABLE}


@pytest.mark.parametrize("blue_green", ["faulty"], indirect=True)
async def test_a_faulty_version_2_is_rolled_back_by_itself(blue_green):
    mesh, policy = blue_green
    await serve_version_2_on_green(mesh)  # it loads: warm-up and the golden probe pass
    code, answers, failures = await rollout_under_load(mesh, policy, step=10)
    assert code == 1
    assert core.weights(policy, "model-server") == {"blue": 100, "green": 0}
    # Green's batches did fail inside ONNX Runtime ...
    assert (
        metric(
            mesh.metrics_url("batcher"), "infermesh_batcher_upstream_requests_total", subset="green", code="INTERNAL"
        )
        >= 1
    )
    # ... but callers saw few errors: green took 10% of the batches for one interval,
    # the batcher retried a failed batch's requests one by one (each weighed again),
    # and once minilm failed often enough the router's breaker answered from its
    # fallback (answers marked degraded, for every caller while the breaker is open).
    assert len(failures) <= 0.10 * (len(answers) + len(failures))
    degraded = [a for a in answers if "infermesh_degraded" in a.parameters]
    assert all(a.parameters["infermesh_degraded"].string_param.startswith("fallback minilm-lite") for a in degraded)
    # INTERNAL from the faulty batches (green's only replica is never ejected:
    # maxEjectionPercent 50 keeps a subset of one), or UNAVAILABLE from the breaker's
    # fallback when it had no answer either.
    assert set(failures) <= {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}
