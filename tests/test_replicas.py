"""Several model_server replicas behind one batcher: both get work, and one dying
under load loses no request."""

import asyncio
import signal
import uuid

import grpc
import pytest
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.launcher.mesh import Mesh
from tests.conftest import metric
from tests.oip import output_array, text_request


@pytest.fixture
def two_replicas(model_repository, tmp_path):
    with Mesh(models=model_repository, cache=False, log_dir=tmp_path, model_servers=2,
              batcher_args=("--replica-poll-s", "0.2", "--max-batch-size", "4")) as mesh:
        yield mesh


def batches_run(mesh, name: str) -> float:
    return metric(mesh.metrics_url(name), "infermesh_model_batches_total", model="minilm", outcome="ok")


async def test_both_replicas_get_work_and_one_dying_loses_nothing(two_replicas):
    mesh = two_replicas
    async with grpc.aio.insecure_channel(mesh.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        warm = await asyncio.gather(*(stub.ModelInfer(text_request([f"warm {i} {uuid.uuid4().hex}"]), timeout=60)
                                      for i in range(32)))
        assert all(output_array(r, "EMBEDDING").shape == (1, 384) for r in warm)
        assert batches_run(mesh, "model_server-0") > 0 and batches_run(mesh, "model_server-1") > 0

        # Long texts keep both replicas busy; then one of them dies mid-batch.
        calls = [asyncio.ensure_future(stub.ModelInfer(text_request([f"{uuid.uuid4().hex} " + "long words " * 120] * 2),
                                                       timeout=120)) for _ in range(40)]
        await asyncio.sleep(0.5)
        victim = mesh.processes["model_server-1"].popen
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        results = await asyncio.gather(*calls, return_exceptions=True)
    failures = [r for r in results if isinstance(r, Exception)]
    assert not failures, failures[:3]
    assert all(output_array(r, "EMBEDDING").shape == (2, 384) for r in results)
    assert sorted(mesh.dead()) == ["model_server-1"]
    # The batches that were on the dead replica went to the other one.
    assert metric(mesh.metrics_url("batcher"), "infermesh_batcher_retries_total", code="UNAVAILABLE") >= 1
