"""A hot swap through the whole mesh: callers keep sending through the router
while the model server loads a new version; no request fails, and traffic
moves to the new version and stays there; a reload that changes only the
config is not answered from the cache of the old one."""

import asyncio
import json
import shutil
import time

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.launcher.mesh import Mesh, MeshConfig
from tests.conftest import MODELS, until
from tests.oip import output_array, tensor_request, text_request
from tests.test_model_repository import ROWS, _add_version, _config, _mlp_outputs, _write_golden

pytestmark = pytest.mark.e2e


async def test_a_swap_under_load_through_the_mesh_fails_no_request(tmp_path, model_repository):
    repo = tmp_path / "repo"
    (repo / "mlp").mkdir(parents=True)
    _config(repo / "mlp", version_policy={"specific": {"versions": [1]}})
    _add_version(repo / "mlp", 1)
    _add_version(repo / "mlp", 2)
    _write_golden(repo / "mlp", _mlp_outputs(MODELS / "mlp" / "1" / "model.onnx", ROWS))
    model = ort.InferenceSession(str(MODELS / "mlp" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    with Mesh(
        MeshConfig(
            models=repo,
            cache=False,
            log_dir=tmp_path,
            batcher_args=("--replica-poll-s", "0.2"),
            router_args=("--catalog-poll-s", "0.2"),
        )
    ) as mesh:
        async with (
            grpc.aio.insecure_channel(mesh.router) as router,
            grpc.aio.insecure_channel(mesh.processes["model_server"].info["grpc"]) as model_server,
        ):
            stub = pb_grpc.GRPCInferenceServiceStub(router)
            control = pb_grpc.GRPCInferenceServiceStub(model_server)
            seen, stop, loading, swapped = [], asyncio.Event(), asyncio.Event(), asyncio.Event()

            def phase() -> str:
                return "after" if swapped.is_set() else "during" if loading.is_set() else "before"

            async def caller(i: int):
                while not stop.is_set():
                    started = phase()
                    # Unique rows: identical requests in flight would share one answer.
                    rows = ROWS[i % len(ROWS) : i % len(ROWS) + 1] + np.float32(len(seen) * 1e-3 + i)
                    response = await stub.ModelInfer(tensor_request(rows), timeout=30)
                    assert np.allclose(
                        output_array(response, "OUTPUT0"), model.run(["OUTPUT0"], {"INPUT0": rows})[0], atol=1e-5
                    )
                    seen.append((started, phase(), response.model_version))

            callers = [asyncio.create_task(caller(i)) for i in range(16)]
            await until(lambda: len(seen) > 50, "answers before the load")
            loading.set()
            override = json.dumps({"version_policy": {"specific": {"versions": [2]}}})
            await control.RepositoryModelLoad(
                pb.RepositoryModelLoadRequest(
                    model_name="mlp", parameters={"config": pb.ModelRepositoryParameter(string_param=override)}
                ),
                timeout=60,
                metadata=mesh.credentials("dev-admin"),
            )
            swapped.set()
            await until(lambda: sum(started == "after" for started, _, _ in seen) > 50, "answers after the load")
            stop.set()
            await asyncio.gather(*callers)  # a failed request raises here
        assert not mesh.dead()
    before = [v for _, ended, v in seen if ended == "before"]  # answered before the load request
    after = [v for started, _, v in seen if started == "after"]  # sent once the load RPC had returned
    assert set(before) == {"1"} and len(before) > 50
    # A request that names no version goes downstream without one, so it runs on
    # whatever serves when it runs: version 2 from the swap on, whatever the
    # router's and batcher's catalogs still say.
    assert set(after) == {"2"} and len(after) > 50
    shutil.rmtree(repo)


def test_a_config_only_reload_that_changes_the_answers_is_not_answered_from_the_cache(tmp_path, model_repository):
    """A reload with the same files but a different tokenizer max_length computes
    other embeddings: the router must stop answering the ones it cached before."""
    repo = tmp_path / "repo"
    shutil.copytree(MODELS / "minilm-lite", repo / "minilm-lite")
    preprocess = json.loads((repo / "minilm-lite" / "config.json").read_text())["preprocess"]
    # Its second half is about something else: cut at 16 tokens, the embedding changes.
    text = "The parcel was due on Monday and never arrived. " + "Quarks are bound by gluons. " * 8

    def ask(stub, bypass: bool = False) -> np.ndarray:
        request = text_request([text], model="minilm-lite")
        if bypass:
            request.parameters["cache_bypass"].bool_param = True
        return output_array(stub.ModelInfer(request, timeout=30), "EMBEDDING")[0]

    with Mesh(
        MeshConfig(
            models=repo,
            log_dir=tmp_path / "logs",
            l2_path=tmp_path / "l2",
            batcher_args=("--replica-poll-s", "0.2"),
            router_args=("--catalog-poll-s", "0.2", "--near-cache-ttl-s", "0", "--cache-min-hit-rate", "0"),
        )
    ) as mesh:
        with (
            grpc.insecure_channel(mesh.router) as router,
            grpc.insecure_channel(mesh.processes["model_server"].info["grpc"]) as model_server,
        ):
            stub = pb_grpc.GRPCInferenceServiceStub(router)
            before = ask(stub)
            assert np.array_equal(ask(stub), before)
            override = json.dumps({"preprocess": {**preprocess, "max_length": 16}})
            pb_grpc.GRPCInferenceServiceStub(model_server).RepositoryModelLoad(
                pb.RepositoryModelLoadRequest(
                    model_name="minilm-lite", parameters={"config": pb.ModelRepositoryParameter(string_param=override)}
                ),
                timeout=60,
                metadata=mesh.credentials("dev-admin"),
            )
            fresh = ask(stub, bypass=True)
            assert not np.allclose(fresh, before, atol=1e-3)
            deadline = time.monotonic() + 10  # the router's and the batcher's catalogs poll every 0.2 s
            while not np.allclose(served := ask(stub), fresh, atol=1e-5) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert np.allclose(served, fresh, atol=1e-5), "the router still answers from the cache of the old config"
        assert not mesh.dead()
