"""The model repository at run time, against a real model server on a loopback
port: loads, verified hot swaps under load, rollback, unload in use, poll mode,
the correctness probe, and every failure a load can meet."""

import asyncio
import concurrent.futures
import contextlib
import json
import pathlib
import shutil
import sys
import threading
import time

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from inference import grpc_predict_v2_pb2 as oip
from inference import grpc_predict_v2_pb2_grpc as oip_grpc
from infermesh.model_server.v1 import model_server_pb2, model_server_pb2_grpc

from services.common import errors, identity
from services.common.latency import LatencyProfile
from services.common.protoconv import tensors_from_proto, tensors_to_proto
from services.common.tensors import TensorData, from_numpy, to_numpy
from services.model_server import execution, metrics
from services.model_server.config import ModelServerConfig
from services.model_server.core import ControlMode, ManagerConfig, ModelManager
from services.model_server.repository import LEND_RESERVED_AFTER_S, ConfigError, load_config
from services.model_server.server import Readiness, build_server
from tests.conftest import MODELS, settle, until

ADMIN_KEY, APP_KEY = identity.new_key(), identity.new_key()
ADMIN = identity.bearer_metadata(ADMIN_KEY)
ROWS = np.random.default_rng(7).standard_normal((4, 64), dtype=np.float32)


def _mlp_outputs(model_file: pathlib.Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    return session.run(["OUTPUT0"], {"INPUT0": x})[0]


def _write_golden(model_dir: pathlib.Path, expected: np.ndarray) -> None:
    (model_dir / "golden.json").write_text(
        json.dumps(
            {
                "inputs": [
                    {"name": "INPUT0", "datatype": "FP32", "shape": list(ROWS.shape), "data": ROWS.ravel().tolist()}
                ],
                "outputs": [
                    {
                        "name": "OUTPUT0",
                        "datatype": "FP32",
                        "shape": list(expected.shape),
                        "data": expected.ravel().tolist(),
                    }
                ],
            }
        )
    )


def _config(model_dir: pathlib.Path, **fields) -> None:
    doc = json.loads((MODELS / "mlp" / "config.json").read_text())
    doc.update(
        {"version_policy": {"latest": {"num_versions": 1}}, "golden_probe": {"file": "golden.json", "max_abs": 1e-4}},
        **fields,
    )
    (model_dir / "config.json").write_text(json.dumps(doc))


def _add_version(model_dir: pathlib.Path, version: int, scale: float = 1.0) -> None:
    """A copy of mlp version 1; scale != 1 multiplies its first weight matrix (a wrong model)."""
    folder = model_dir / str(version)
    folder.mkdir()
    source = MODELS / "mlp" / "1" / "model.onnx"
    if scale == 1.0:
        shutil.copy(source, folder / "model.onnx")
        return
    model = onnx.load(str(source))
    weights = max(model.graph.initializer, key=lambda t: len(t.raw_data) or len(t.float_data))
    array = onnx.numpy_helper.to_array(weights) * np.float32(scale)
    weights.CopyFrom(onnx.numpy_helper.from_array(array, weights.name))
    onnx.save(model, str(folder / "model.onnx"))


@pytest.fixture
def repo(tmp_path, model_repository) -> pathlib.Path:
    """A repository holding mlp version 1 with a golden probe made from it."""
    model_dir = tmp_path / "repo" / "mlp"
    model_dir.mkdir(parents=True)
    _config(model_dir)
    _add_version(model_dir, 1)
    _write_golden(model_dir, _mlp_outputs(model_dir / "1" / "model.onnx", ROWS))
    return tmp_path / "repo"


@pytest.mark.service
async def test_repository_rpcs_need_an_admin_tenant(repo):
    async with model_server(repo) as ms:
        request = oip.RepositoryModelUnloadRequest(model_name="mlp")
        for metadata, code, complaint in (
            ((), grpc.StatusCode.UNAUTHENTICATED, "unload model 'mlp' needs an admin credential"),
            (identity.bearer_metadata("imk_guessed"), grpc.StatusCode.UNAUTHENTICATED, "bearer key is not known"),
            (
                identity.bearer_metadata(APP_KEY),
                grpc.StatusCode.PERMISSION_DENIED,
                "tenant 'app' may not unload model 'mlp': it has no admin rights",
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await ms.oip.RepositoryModelUnload(request, metadata=metadata, timeout=10)
            assert refused.value.code() == code and complaint in refused.value.details()
        assert await ms.ready()  # nothing was unloaded
        await ms.oip.RepositoryModelUnload(request, metadata=ADMIN, timeout=30)
        assert not await ms.ready()


@pytest.mark.service
async def test_without_a_registry_repository_rpcs_are_refused(repo):
    manager = ModelManager(ManagerConfig(str(repo), "cpu", 1, probe_interval_s=0))
    await manager.start()
    server, port, _ = await build_server(ModelServerConfig(model_repository=str(repo)), manager, port=0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await oip_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(
                    oip.RepositoryModelLoadRequest(model_name="mlp"), metadata=ADMIN, timeout=10
                )
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "has no tenant registry to check one against" in refused.value.details()
    finally:
        await server.stop(0)
        await manager.close()


class Running:
    def __init__(self, manager, channel, address: str):
        self.manager = manager
        self.address = address
        self.models = model_server_pb2_grpc.ModelServerStub(channel)
        self.oip = oip_grpc.GRPCInferenceServiceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    async def execute(self, version: str = "", rows: np.ndarray = ROWS) -> tuple[str, np.ndarray]:
        request = model_server_pb2.ExecuteRequest(
            model="mlp", version=version, inputs=tensors_to_proto([from_numpy("INPUT0", rows, "FP32")])
        )
        response = await self.models.Execute(request, timeout=30)
        return response.version, to_numpy(tensors_from_proto(response.outputs)[0])

    async def load(self, model: str = "mlp", config: dict | None = None):
        parameters = {} if config is None else {"config": oip.ModelRepositoryParameter(string_param=json.dumps(config))}
        return await self.oip.RepositoryModelLoad(
            oip.RepositoryModelLoadRequest(model_name=model, parameters=parameters), timeout=120, metadata=ADMIN
        )

    async def index(self) -> list[tuple[str, str, str, str]]:
        response = await self.oip.RepositoryIndex(oip.RepositoryIndexRequest(), timeout=10)
        return [(m.name, m.version, m.state, m.reason) for m in response.models]

    async def ready(self, model: str = "mlp", version: str = "") -> bool:
        return (await self.oip.ModelReady(oip.ModelReadyRequest(name=model, version=version))).ready

    async def health_of(self, service: str) -> int:
        return (await self.health.Check(health_pb2.HealthCheckRequest(service=service))).status


@contextlib.asynccontextmanager
async def model_server(repository: pathlib.Path, **options):
    readiness = Readiness()
    options.setdefault("probe_interval_s", 0)
    manager = ModelManager(ManagerConfig(str(repository), "cpu", 1, **options), on_readiness=readiness)
    await manager.start()
    tenants = repository.parent / "tenants.yaml"  # its repository RPCs are an admin's (ADMIN_KEY)
    identity.write_registry(
        tenants,
        {
            "tenants": {
                "ops": {"admin": True, "keys": [identity.hash_key(ADMIN_KEY)]},
                "app": {"keys": [identity.hash_key(APP_KEY)]},
            }
        },
        replace=True,
    )
    config = ModelServerConfig(model_repository=str(repository), tenants_file=str(tenants))
    server, port, _ = await build_server(config, manager, port=0, readiness=readiness)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Running(manager, channel, f"127.0.0.1:{port}")
    finally:
        await channel.close()
        await server.stop(0)
        await manager.close()


def _loads(outcome: str) -> float:
    return metrics.LOADS.labels("mlp", outcome)._value.get()


# ---------------------------------------------------------------- configs


@pytest.mark.unit
@pytest.mark.parametrize(
    "fields, complaint",
    [
        ({"versoin_policy": {}}, "unknown field(s) ['versoin_policy']"),
        # An unknown field is an error at every level, so a typo cannot pass silently.
        (
            {"version_policy": {"latest": {"num_versions": 1, "num_version": 2}}},
            "version_policy.latest: unknown field(s) ['num_version']; known: ['num_versions']",
        ),
        (
            {"version_policy": {"all": {"num_versions": 2}}},
            "version_policy.all: unknown field(s) ['num_versions']; known: []",
        ),
        (
            {"version_policy": {"specific": {"version": [1]}}},
            "version_policy.specific: unknown field(s) ['version']; known: ['versions']",
        ),
        (
            {"golden_probe": {"file": "golden.json", "max_abs": 1e-4, "min_cosin": 0.9999}},
            "golden_probe: unknown field(s) ['min_cosin']; known: ['file', 'min_cosine', 'max_abs']",
        ),
        ({"warmup": {"batch_size": [1, 256]}}, "warmup: unknown field(s) ['batch_size']; known: ['batch_sizes']"),
        (
            {
                "preprocess": {
                    "kind": "text_tokenizer",
                    "tokenizer_file": "tokenizer.json",
                    "max_length": 256,
                    "max_lenght": 64,
                }
            },
            "preprocess: unknown field(s) ['max_lenght']; known: ['kind', 'tokenizer_file', 'max_length', 'max_text_tokens']",
        ),
        (
            {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 64], "dims": [64]}]},
            "inputs[0]: unknown field(s) ['dims']; known: ['name', 'datatype', 'shape']",
        ),
        (
            {"instances": {"count": 1, "gpu": [1]}},
            "instances: unknown field(s) ['gpu']; known: ['count', 'gpus', 'reserved_for_vip', 'lend_reserved_after_s']",
        ),
        ({"execution": {"intra_threads": 2}}, "execution: unknown field(s) ['intra_threads']; known: ['providers', "),
        ({"version_policy": {"newest": {}}}, "version_policy is {'newest': {}}"),
        ({"version_policy": {"latest": {"num_versions": 0}}}, "'num_versions' must be >= 1, got 0"),
        ({"version_policy": {"specific": {"versions": ["2"]}}}, "field 'versions' is ['2']"),
        ({"golden_probe": {"file": "golden.json"}}, "give a tolerance"),
        ({"golden_probe": {"file": "golden.json", "min_cosine": 2}}, "'min_cosine' must be in [-1, 1], got 2"),
        ({"instances": {"count": 0}}, "instances: field 'count' must be 1..64, got 0"),
        ({"instances": {"count": 2, "reserved_for_vip": 2}}, "field 'reserved_for_vip' must be 0..count-1 (1), got 2"),
        (
            {"instances": {"count": 2, "reserved_for_vip": 1, "lend_reserved_after_s": -1}},
            "field 'lend_reserved_after_s' must be a finite number of seconds >= 0, or null (never lend), got -1",
        ),
        ({"instances": {"lend_reserved_after_s": float("nan")}}, "or null (never lend), got nan"),
        (
            {"instances": {"lend_reserved_after_s": "10s"}},
            "field 'lend_reserved_after_s' must be int or float, got '10s'",
        ),
        (
            {"instances": {"lend_reserved_after_s": True}},
            "field 'lend_reserved_after_s' must be int or float, got True",
        ),
        ({"golden_probe": {"file": "golden.json", "max_abs": True}}, "field 'max_abs' must be int or float, got True"),
        # Numbers too large for what reads them: named, never an OverflowError or a TypeError from ORT.
        (
            {"instances": {"count": 2, "reserved_for_vip": 1, "lend_reserved_after_s": 10**400}},
            "field 'lend_reserved_after_s' is an integer of 1329 bits, too large",
        ),
        ({"golden_probe": {"file": "golden.json", "max_abs": 10**400}}, "field 'max_abs' is an integer of 1329 bits"),
        (
            {"execution": {"intra_op_threads": 2**40}},
            "intra_op_threads must be 0..1024 and inter_op_threads 1..1024, got 1099511627776 and 1",
        ),
        (
            {"preprocess": {"kind": "text_tokenizer", "tokenizer_file": "tokenizer.json", "max_length": 2**70}},
            "field 'max_length' must be 2..32768, got 1180591620717411303424",
        ),
        (
            {
                "preprocess": {
                    "kind": "text_tokenizer",
                    "tokenizer_file": "tokenizer.json",
                    "max_length": 256,
                    "max_text_tokens": 100,
                }
            },
            "field 'max_text_tokens' must be 256 (max_length)..32768, got 100",
        ),
        ({"execution": {"providers": ["tpu"]}}, "field 'providers' is ['tpu']"),
        ({"tp_degree": 0}, "field 'tp_degree' must be 1..64, got 0"),
        ({"warmup": {"batch_sizes": [512]}}, "field 'batch_sizes' is [512]"),
        ({"max_batch_size": "8"}, "field 'max_batch_size' must be int, got '8'"),
        ({"fallback": "mlp"}, "field 'fallback' names the model itself"),
    ],
)
def test_every_malformed_config_field_is_named(repo, fields, complaint):
    _config(repo / "mlp", **fields)
    with pytest.raises(ConfigError) as raised:
        load_config(repo / "mlp")
    assert str(repo / "mlp" / "config.json") in str(raised.value)
    assert complaint in str(raised.value)


@pytest.mark.unit
def test_version_policies_pick_versions(repo):
    for version in (2, 3):
        _add_version(repo / "mlp", version)
    for policy, expected in (
        ({"latest": {"num_versions": 2}}, ["3", "2"]),
        ({"all": {}}, ["3", "2", "1"]),
        ({"specific": {"versions": [1, 3]}}, ["3", "1"]),
    ):
        _config(repo / "mlp", version_policy=policy)
        assert load_config(repo / "mlp").versions() == expected


# ---------------------------------------------------------------- loads and swaps


@pytest.mark.service
async def test_a_new_version_swaps_in_under_load_without_a_failed_request(repo):
    async with model_server(repo) as ms:
        assert await ms.ready() and await ms.health_of("mlp") == health_pb2.HealthCheckResponse.SERVING
        _add_version(repo / "mlp", 2)
        want = _mlp_outputs(repo / "mlp" / "1" / "model.onnx", ROWS)
        seen, stop, swapped = [], asyncio.Event(), asyncio.Event()

        async def caller():
            while not stop.is_set():
                after_swap = swapped.is_set()
                version, out = await ms.execute()
                assert np.allclose(out, want, atol=1e-5)
                seen.append((after_swap, version))

        callers = [asyncio.create_task(caller()) for _ in range(8)]
        await until(lambda: len(seen) >= 16, "answers before the swap")
        await ms.load()
        swapped.set()
        await until(lambda: sum(after for after, _ in seen) >= 16, "answers after the swap")
        stop.set()
        await asyncio.gather(*callers)  # any failed request raises here
        assert seen[0] == (False, "1")
        assert {version for after, version in seen if after} == {"2"}  # once swapped, never back
        index = await ms.index()
        assert ("mlp", "2", "READY", "") in index
        assert any(entry[:3] == ("mlp", "1", "UNAVAILABLE") and "standby" in entry[3] for entry in index)
        # A request routed to version 1 before the swap still gets its answer.
        assert (await ms.execute(version="1"))[0] == "1"
        assert not await ms.ready(version="1")


@pytest.mark.service
async def test_rollback_to_the_standby_version_is_instant_and_grace_ends_it(repo):
    async with model_server(repo, rollback_grace_s=3.0) as ms:
        _add_version(repo / "mlp", 2)
        await ms.load()
        assert (await ms.execute())[0] == "2"
        loaded_before = _loads("ok")
        await ms.load(config={"version_policy": {"specific": {"versions": [1]}}})
        assert (await ms.execute())[0] == "1"
        assert _loads("ok") == loaded_before + 1
        assert ms.manager.models()[0][1] == ["2", "1"]  # version 2 is the standby now
        for _ in range(100):
            if ms.manager.models()[0][1] == ["1"]:
                break
            await asyncio.sleep(0.1)
        assert ms.manager.models()[0][1] == ["1"], "the standby outlived its grace period"


@pytest.mark.service
async def test_a_version_that_fails_verification_never_gets_traffic(repo):
    async with model_server(repo) as ms:
        _add_version(repo / "mlp", 2, scale=1.5)
        failed_before = _loads("verification")
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await ms.load()
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "version 2 fails its golden probe" in raised.value.details()
        assert "max_abs 0.0001" in raised.value.details() and "before (['1']) keep serving" in raised.value.details()
        assert _loads("verification") == failed_before + 1
        assert (await ms.execute())[0] == "1" and await ms.ready()
        assert any(e[2] == "UNAVAILABLE" and "fails its golden probe" in e[3] for e in await ms.index())


@pytest.mark.service
@pytest.mark.parametrize(
    "damage, code, complaint",
    [
        ("corrupt", grpc.StatusCode.FAILED_PRECONDITION, "ONNX Runtime cannot load it"),
        ("missing", grpc.StatusCode.FAILED_PRECONDITION, "missing model.onnx"),
        ("bad-config", grpc.StatusCode.INVALID_ARGUMENT, "field 'max_batch_size' must be 1..4096, got 0"),
        ("bad-override", grpc.StatusCode.INVALID_ARGUMENT, "parameter 'config' is not valid JSON"),
        ("no-version", grpc.StatusCode.INVALID_ARGUMENT, "selects none of the version folders"),
        ("bad-golden", grpc.StatusCode.INVALID_ARGUMENT, "golden.json: inputs[0]: the model has no input named 'X'"),
        (
            "huge-golden",
            grpc.StatusCode.INVALID_ARGUMENT,
            "golden.json: inputs[0]: field 'data' does not hold [4, 64] FP32",
        ),
    ],
)
async def test_a_failed_load_is_reported_and_the_old_version_keeps_serving(repo, damage, code, complaint):
    async with model_server(repo) as ms:
        model_dir = repo / "mlp"
        config = None
        if damage == "corrupt":
            (model_dir / "2").mkdir()
            (model_dir / "2" / "model.onnx").write_bytes(b"\x08\x07 this is not a protobuf" * 100)
        elif damage == "missing":
            (model_dir / "2").mkdir()
        elif damage == "bad-config":
            _config(model_dir, max_batch_size=0)
        elif damage == "no-version":
            config = {"version_policy": {"specific": {"versions": [9]}}}
        elif damage == "bad-golden":
            golden = json.loads((model_dir / "golden.json").read_text())
            golden["inputs"][0]["name"] = "X"
            (model_dir / "golden.json").write_text(json.dumps(golden))
        elif damage == "huge-golden":
            golden = json.loads((model_dir / "golden.json").read_text())
            golden["inputs"][0]["data"][0] = 10**400
            (model_dir / "golden.json").write_text(json.dumps(golden))
        try:
            if damage == "bad-override":
                await ms.oip.RepositoryModelLoad(
                    oip.RepositoryModelLoadRequest(
                        model_name="mlp", parameters={"config": oip.ModelRepositoryParameter(string_param="{nope")}
                    ),
                    metadata=ADMIN,
                )
            else:
                await ms.load(config=config)
            pytest.fail("the load should have failed")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == code, exc.details()
            assert complaint in exc.details()
        assert (await ms.execute())[0] == "1" and await ms.ready()


def _shard_set(folder: pathlib.Path) -> dict:
    """A two-shard manifest of the right form over small files (not graphs: a
    damaged manifest must be refused before any session is made)."""
    import hashlib

    shards = []
    for index in range(2):
        files = []
        for segment in ("embed", "pool")[: 2 - index]:
            name = f"shard{index}/{segment}.onnx"
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(name.encode())
            files.append(
                {
                    "segment": segment,
                    "file": name,
                    "bytes": len(name),
                    "sha256": hashlib.sha256(name.encode()).hexdigest(),
                }
            )
        shards.append({"index": index, "files": files, "bytes": sum(f["bytes"] for f in files)})
    return {
        "format": "infermesh-tp/1",
        "degree": 2,
        "shape": {"hidden": 64},
        "segments": ["embed", "pool"],
        "shards": shards,
    }


@pytest.mark.unit
@pytest.mark.parametrize(
    "damage, complaint",
    [
        (lambda m: m.pop("shards"), "missing field 'shards'"),
        (lambda m: m.update(shards={"0": {}, "1": {}}), "field 'shards' must be list"),
        (lambda m: m.pop("shape"), "missing field 'shape'"),
        (lambda m: m.update(segments=["embed"]), "field 'segments' is ['embed']; expected two or more"),
        (lambda m: m["shards"][1].update(index=0), "shards[1] must be an object with 'index' 1"),
        (lambda m: m["shards"][0].pop("bytes"), "shards[0]: missing field 'bytes'"),
        (lambda m: m["shards"][0]["files"][0].pop("sha256"), "shards[0].files[0]: missing field 'sha256'"),
        (
            lambda m: m["shards"][0]["files"][1].update(segment="head"),
            "field 'segment' is 'head', not one of 'segments'",
        ),
        (lambda m: m["shards"][0]["files"].pop(), "shards[0] has no file for segment(s) ['pool']"),
    ],
)
def test_a_damaged_shard_manifest_is_refused_by_field(tmp_path, damage, complaint):
    from services.model_server.shards import ShardError, read_manifest

    manifest = _shard_set(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    read_manifest(tmp_path, 2)  # the undamaged form passes
    damage(manifest)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError) as raised:
        read_manifest(tmp_path, 2)
    assert str(tmp_path / "manifest.json") in str(raised.value) and complaint in str(raised.value)


@pytest.mark.service
async def test_a_model_whose_shard_manifest_is_damaged_is_left_unloaded_and_the_server_starts(repo):
    """It was a KeyError: the load RPC answered with no reason and a server
    loading the model at startup died."""
    _config(repo / "mlp", tp_degree=2)
    manifest = _shard_set(repo / "mlp" / "1" / "tp2")
    del manifest["shards"]
    (repo / "mlp" / "1" / "tp2" / "manifest.json").write_text(json.dumps(manifest))
    async with model_server(repo) as ms:  # loads mlp at startup
        assert not await ms.ready() and (await ms.oip.ServerReady(oip.ServerReadyRequest())).ready
        assert any(e[0] == "mlp" and "missing field 'shards'" in e[3] for e in await ms.index())
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await ms.load()
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "failed to load model 'mlp'" in raised.value.details()
        assert "tp2/manifest.json: missing field 'shards'" in raised.value.details()


@pytest.mark.service
@pytest.mark.parametrize("stage", ["config", "version"])
async def test_an_unforeseen_error_in_a_load_fails_that_model_alone(repo, monkeypatch, stage):
    """Whatever a load raises, no check having foreseen it, it is that model's
    failed load, named, with the traceback in the log: never an RPC with no
    reason, never a server that dies at startup, and what served keeps serving."""
    from services.model_server import versions as core  # where loads read configs and load versions

    real = {"config": core.load_config, "version": core.load_version}[stage]
    armed = False

    def faulty(*args):
        if armed:
            raise KeyError("a case no check foresaw")
        return real(*args)

    monkeypatch.setattr(core, {"config": "load_config", "version": "load_version"}[stage], faulty)
    async with model_server(repo) as ms:
        armed = True
        errors_before = _loads("error")
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await ms.load(config={"instances": {"count": 2}})  # a reload, not a reuse
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "failed to load model 'mlp'" in raised.value.details()
        assert "KeyError: 'a case no check foresaw'" in raised.value.details()
        assert _loads("error") == errors_before + 1
        assert (await ms.execute())[0] == "1" and await ms.ready()
    async with model_server(repo) as ms:  # at startup
        assert not await ms.ready() and (await ms.oip.ServerReady(oip.ServerReadyRequest())).ready


@pytest.mark.service
async def test_a_version_replaced_in_place_gets_a_new_revision(repo):
    async with model_server(repo) as ms:
        listed = await ms.models.ListModels(model_server_pb2.ListModelsRequest())
        before = dict(listed.models[0].revisions)
        assert set(before) == {"1"} and before["1"]
        shutil.rmtree(repo / "mlp" / "1")
        _add_version(repo / "mlp", 1, scale=1.0 + 1e-7)  # new files, same version number, still within the probe
        await ms.load()
        listed = await ms.models.ListModels(model_server_pb2.ListModelsRequest())
        assert dict(listed.models[0].revisions)["1"] not in ("", before["1"])
        assert (await ms.execute())[0] == "1"


@pytest.mark.service
async def test_a_reload_that_changes_the_answers_changes_the_revision_and_one_that_does_not_keeps_it(
    tmp_path, model_repository
):
    """The router keys its cache by the revision: a config-only reload that
    changes what a version computes (the tokenizer's max_length) must change it,
    or callers get answers cached under the old config; one that changes only how
    it runs (instances) must not, or the cache empties for nothing."""
    repo = tmp_path / "repo"
    shutil.copytree(MODELS / "minilm-lite", repo / "minilm-lite")
    preprocess = json.loads((repo / "minilm-lite" / "config.json").read_text())["preprocess"]
    long_text = np.array([b"The parcel was due on Monday and never arrived. " * 8], dtype=object)

    async with model_server(repo) as ms:

        async def revision_and_answer() -> tuple[str, np.ndarray]:
            listed = await ms.models.ListModels(model_server_pb2.ListModelsRequest())
            request = model_server_pb2.ExecuteRequest(
                model="minilm-lite", inputs=tensors_to_proto([from_numpy("TEXT", long_text, "BYTES")])
            )
            response = await ms.models.Execute(request, timeout=30)
            return dict(listed.models[0].revisions)["1"], to_numpy(tensors_from_proto(response.outputs)[0])

        revision, answer = await revision_and_answer()
        await ms.load("minilm-lite", config={"instances": {"count": 2}})
        assert ms.manager.instances("minilm-lite")[0] == 2  # reloaded ...
        same_revision, same = await revision_and_answer()
        assert same_revision == revision and np.allclose(same, answer, atol=1e-6)  # ... same answers, same key
        await ms.load("minilm-lite", config={"preprocess": {**preprocess, "max_length": 16}})
        truncated_revision, truncated = await revision_and_answer()
        assert not np.allclose(truncated, answer, atol=1e-3)  # the reload changed the answer ...
        assert truncated_revision not in ("", revision)  # ... so the cache key changes with it


@pytest.mark.service
async def test_unknown_models_and_parameters_are_refused(repo):
    async with model_server(repo) as ms:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await ms.load(model="nope")
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND and "no model folder 'nope'" in raised.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await ms.oip.RepositoryModelLoad(
                oip.RepositoryModelLoadRequest(
                    model_name="mlp", parameters={"file:1/model.onnx": oip.ModelRepositoryParameter(bytes_param=b"x")}
                ),
                metadata=ADMIN,
            )
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'file:1/model.onnx' is not supported" in raised.value.details()


@pytest.mark.service
async def test_unloading_a_version_in_use_lets_running_batches_finish(repo):
    async with model_server(repo) as ms:
        loaded = ms.manager.resolve("mlp", "")
        big = np.ones((256, 64), dtype=np.float32)
        running = [asyncio.create_task(ms.execute(rows=big)) for _ in range(12)]
        while loaded.in_flight == 0:
            await asyncio.sleep(0.001)
        await ms.oip.RepositoryModelUnload(oip.RepositoryModelUnloadRequest(model_name="mlp"), metadata=ADMIN)
        results = await asyncio.gather(*running, return_exceptions=True)
        finished = [r for r in results if not isinstance(r, Exception)]
        refused = [r for r in results if isinstance(r, Exception)]
        assert finished, "no batch was in flight when the model was unloaded"
        assert all(version == "1" and out.shape == (256, 64) for version, out in finished)
        assert all(r.code() == grpc.StatusCode.NOT_FOUND for r in refused)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await ms.execute()
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND and "not loaded" in raised.value.details()
        assert not await ms.ready()
        assert await ms.health_of("mlp") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert ("mlp", "", "UNAVAILABLE", "unloaded") in await ms.index()
        await loaded.wait_idle()
        await ms.load()
        assert (await ms.execute())[0] == "1"


@pytest.mark.service
async def test_the_correctness_probe_withdraws_readiness_on_drift(repo):
    async with model_server(repo) as ms:
        golden_file = repo / "mlp" / "golden.json"
        truth = golden_file.read_text()
        drifted = json.loads(truth)
        drifted["outputs"][0]["data"][0] += 0.5  # the model no longer gives what is expected of it
        golden_file.write_text(json.dumps(drifted))
        await ms.manager.probe_all()
        assert not await ms.ready()
        assert await ms.health_of("mlp") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not (await ms.oip.ServerReady(oip.ServerReadyRequest())).ready
        assert any(
            e[:3] == ("mlp", "1", "UNAVAILABLE") and "correctness probe failed" in e[3] for e in await ms.index()
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await ms.execute()
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        golden_file.write_text(truth)
        await ms.manager.probe_all()
        assert await ms.ready() and await ms.health_of("mlp") == health_pb2.HealthCheckResponse.SERVING


def _recording_runs(loaded, monkeypatch):
    """Makes `loaded` record (first value, rows) of each run and hold the first run
    until released; returns (order, first_running, release). A held run on the
    event loop would hold everything else too, so every run goes to its
    instance's thread."""
    monkeypatch.setattr(execution, "INLINE_RUN_S", 0.0)
    real_run, first_running, release = loaded.run, threading.Event(), threading.Event()
    order = []

    def run(instance, inputs, outputs):
        tensor = next(iter(inputs.values()))
        order.append((float(to_numpy(tensor).reshape(-1)[0]), tensor.rows))
        if len(order) == 1:
            first_running.set()
            release.wait(10)
        return real_run(instance, inputs, outputs)

    loaded.run = run
    return order, first_running, release


def _learned(loaded, *observations: tuple[int, float]):
    """Gives `loaded` a fresh latency profile that has seen batches of (rows, seconds)."""
    loaded.profile = LatencyProfile()
    for rows, seconds in observations:
        loaded.profile.observe(rows, seconds)
    return loaded


def _mlp(value: float, rows: int) -> list:
    return [from_numpy("INPUT0", np.full((rows, 64), value, dtype=np.float32), "FP32")]


@pytest.mark.service
async def test_a_batch_arriving_during_the_probe_waits_for_one_probe_row_not_the_whole_probe(repo, monkeypatch):
    """Execution is not preemptive, so the golden probe runs a row at a time at
    the lowest priority: a caller's batch that arrives while it runs goes next."""
    async with model_server(repo) as ms:
        loaded = ms.manager.resolve("mlp", "")
        order, first_row_running, release = _recording_runs(loaded, monkeypatch)  # holds the probe's first row
        probe = asyncio.create_task(ms.manager.probe_all())
        await asyncio.get_running_loop().run_in_executor(None, first_row_running.wait, 10)
        caller = asyncio.create_task(ms.execute(rows=np.ones((8, 64), dtype=np.float32)))
        while loaded.gate.waiting == 0:
            await asyncio.sleep(0.001)
        release.set()
        await asyncio.gather(probe, caller)
        assert [rows for _, rows in order] == [1, 8] + [1] * (len(ROWS) - 1)
        assert await ms.ready()  # and the probe, run in pieces, still passes


@pytest.mark.service
async def test_poll_mode_follows_the_repository_and_refuses_rpc_control(repo):
    async with model_server(repo, control_mode=ControlMode.POLL) as ms:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await ms.load()
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "model control mode is 'poll'" in raised.value.details()
        _add_version(repo / "mlp", 2)
        await ms.manager.poll_once()
        assert (await ms.execute())[0] == "2"
        _add_version(repo / "mlp", 3, scale=2.0)  # fails verification: 2 keeps serving
        await ms.manager.poll_once()
        assert (await ms.execute())[0] == "2"
        shutil.rmtree(repo / "mlp" / "3")
        shutil.move(repo / "mlp", repo.parent / "mlp-away")
        await ms.manager.poll_once()
        assert not await ms.ready()
        shutil.move(repo.parent / "mlp-away", repo / "mlp")
        await ms.manager.poll_once()
        assert (await ms.execute())[0] == "2"


@pytest.mark.service
async def test_control_mode_none_refuses_changes(repo):
    async with model_server(repo, control_mode=ControlMode.NONE) as ms:
        for call in (
            ms.load(),
            ms.oip.RepositoryModelUnload(oip.RepositoryModelUnloadRequest(model_name="mlp"), metadata=ADMIN),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call
            assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "model control mode is 'none'" in raised.value.details()


@pytest.mark.service
async def test_a_version_with_two_instances_answers_correctly_under_concurrency(repo):
    _config(repo / "mlp", instances={"count": 2})
    async with model_server(repo) as ms:
        loaded = ms.manager.resolve("mlp", "")
        assert len(loaded.instances) == 2
        results = await asyncio.gather(*(ms.execute() for _ in range(20)))
        want = _mlp_outputs(repo / "mlp" / "1" / "model.onnx", ROWS)
        assert all(np.allclose(out, want, atol=1e-5) for _, out in results)


@pytest.mark.service
async def test_tritonclient_drives_the_repository_rpcs(repo):
    _add_version(repo / "mlp", 2)
    _config(repo / "mlp", version_policy={"specific": {"versions": [1]}})
    async with model_server(repo) as ms:
        address = ms.address
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(pathlib.Path(__file__).parent / "triton_repository_run.py"),
            address,
            ADMIN_KEY,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), timeout=120)
        assert process.returncode == 0, err.decode()
        seen = json.loads(out)
    assert seen["live"] and seen["ready"]
    assert seen["anonymous_load"]["status"] == "StatusCode.UNAUTHENTICATED"
    assert "load model 'mlp' needs an admin credential" in seen["anonymous_load"]["message"]
    assert {"name": "mlp", "version": "1", "state": "READY"} in seen["index"]
    assert seen["ready_v2"]
    states = {(m["version"], m["state"]) for m in seen["index_after_load"]}
    assert ("2", "READY") in states and ("1", "UNAVAILABLE") in states
    assert seen["bad_load"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "field 'max_batch_size' must be 1..4096, got -3" in seen["bad_load"]["message"]
    assert seen["ready_after_unload"] is False


@pytest.mark.service
@pytest.mark.parametrize("damage", ["corrupt-file", "bad-config"])
@pytest.mark.parametrize("startup", [("*",), ("mlp",)], ids=["failed-at-startup-too", "by-request-only"])
async def test_a_failed_load_of_a_model_that_never_served_leaves_the_server_ready(repo, damage, startup):
    """Strict readiness counts loaded models: one that failed to load serves nobody
    and keeps nobody waiting, and ServerReady and grpc.health('') agree throughout."""
    serving = health_pb2.HealthCheckResponse.SERVING

    async def server_ready() -> bool:
        ready = (await ms.oip.ServerReady(oip.ServerReadyRequest())).ready
        await settle()  # health follows readiness from a task
        assert (await ms.health_of("") == serving) == ready, "ServerReady and grpc.health('') disagree"
        return ready

    broken = repo / "broken"
    broken.mkdir()
    _config(broken, name="broken", max_batch_size=0 if damage == "bad-config" else 8)
    (broken / "1").mkdir()
    (broken / "1" / "model.onnx").write_bytes(b"not an onnx file")
    shutil.copy(repo / "mlp" / "golden.json", broken / "golden.json")
    async with model_server(repo, startup_models=startup) as ms:
        assert await server_ready() and await ms.ready()
        with pytest.raises(grpc.aio.AioRpcError):
            await ms.load(model="broken")
        assert await server_ready() and not await ms.ready("broken")
        assert any(e[0] == "broken" and e[2] == "UNAVAILABLE" and e[3] for e in await ms.index())  # the reason stays
        with pytest.raises(grpc.aio.AioRpcError) as raised:  # nothing to unload
            await ms.oip.RepositoryModelUnload(oip.RepositoryModelUnloadRequest(model_name="broken"), metadata=ADMIN)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        # A model that served, was unloaded and then fails to load again is not loaded either.
        await ms.oip.RepositoryModelUnload(oip.RepositoryModelUnloadRequest(model_name="mlp"), metadata=ADMIN)
        _config(repo / "mlp", max_batch_size=0)
        with pytest.raises(grpc.aio.AioRpcError):
            await ms.load()
        assert await server_ready()


@pytest.mark.service
async def test_a_batch_that_would_wait_past_its_deadline_is_refused_before_it(repo, monkeypatch):
    """Refused with RESOURCE_EXHAUSTED (HTTP 429 to Envoy: no failure of the
    replica) instead of left to time out (504: counted, and a busy replica ejected)."""
    # A wider margin than the 25 ms default: on a loaded test machine the refusal
    # must still beat the caller's own deadline for this test to see it.
    monkeypatch.setattr(errors, "REFUSAL_MARGIN_S", 0.2)
    async with model_server(repo) as running:
        loaded = running.manager.resolve("mlp", "")
        shed_before = metrics.SHED.labels("mlp")._value.get()
        request = model_server_pb2.ExecuteRequest(
            model="mlp", inputs=tensors_to_proto([from_numpy("INPUT0", ROWS, "FP32")])
        )
        async with loaded.gate.turn(0):  # the only instance is busy for as long as this holds
            started = asyncio.get_running_loop().time()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await running.models.Execute(request, timeout=1.0)
            waited = asyncio.get_running_loop().time() - started
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "would not finish before its deadline" in refused.value.details()
        assert 0.5 < waited < 1.0  # it waited while it still could finish, then said so in time
        assert metrics.SHED.labels("mlp")._value.get() == shed_before + 1
        assert loaded.gate.waiting == 0
        assert (await running.execute())[0] == "1"  # the gate is free and serving again


@pytest.mark.service
async def test_run_times_are_estimated_per_batch_size(repo):
    async with model_server(repo) as running:
        loaded = running.manager.resolve("mlp", "")
        for rows, seconds in ((1, 0.01), (32, 0.3)):
            loaded.profile.observe(rows, seconds)
        assert [loaded.estimate_s(rows) for rows in (1, 20, 32)] == [0.01, 0.3, 0.3]
        assert loaded.estimate_s(64) == 0.6  # from the nearest size measured, scaled up
        assert loaded.estimate_s(2) == 0.02


@pytest.mark.service
async def test_a_large_batch_is_judged_by_its_own_size_not_by_the_average_batch(repo):
    """Many quick one-row VIP batches pull the average down; a large batch
    behind a running one is still refused at once when its own size says so."""
    async with model_server(repo) as running:
        loaded = running.manager.resolve("mlp", "")
        for rows, seconds in ((1, 0.01), (len(ROWS), 0.5)):
            loaded.profile.observe(rows, seconds)
        request = model_server_pb2.ExecuteRequest(
            model="mlp", inputs=tensors_to_proto([from_numpy("INPUT0", ROWS, "FP32")])
        )
        async with loaded.gate.turn(0):  # a batch of unknown size runs: assumed as large as this one
            started = asyncio.get_running_loop().time()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await running.models.Execute(request, timeout=0.8)
            assert asyncio.get_running_loop().time() - started < 0.3  # at once, not at its deadline
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"a batch of {len(ROWS)} takes about 500 ms" in refused.value.details()


@pytest.mark.service
async def test_a_batch_is_refused_at_its_turn_when_batches_now_take_longer_than_it_has_left(repo, monkeypatch):
    """The batch ahead ran far past its estimate and taught the profile so: the
    batch that waited for it is refused when its turn comes, not run late; so is
    one that arrives with less time than its run now takes."""
    async with model_server(repo) as ms:
        loaded = _learned(ms.manager.resolve("mlp", ""), (4, 0.1))
        shed_before = metrics.SHED.labels("mlp")._value.get()
        order, _, release = _recording_runs(loaded, monkeypatch)
        release.set()
        async with loaded.gate.turn(0):  # the batch ahead: about 100 ms, as far as anyone knows
            waiting = asyncio.create_task(ms.manager.execute("mlp", "", _mlp(1.0, 4), [], timeout_s=5.0))
            while loaded.gate.waiting < 1:
                await asyncio.sleep(0.001)
            for _ in range(10):  # ... but batches of its size now take 8 s
                loaded.profile.observe(4, 8.0)
        with pytest.raises(errors.ResourceExhausted) as refused:
            await waiting
        assert "would not finish before its deadline" in refused.value.message
        assert refused.value.retry_after_ms > 2000  # it lacked about 3 s
        with pytest.raises(errors.ResourceExhausted):
            await ms.manager.execute("mlp", "", _mlp(2.0, 4), [], timeout_s=5.0)  # the gate is free
        assert order == []  # neither ran
        assert metrics.SHED.labels("mlp")._value.get() == shed_before + 2
        assert loaded.gate.waiting == 0 and loaded.gate.in_use() == 0
        assert (await ms.manager.execute("mlp", "", _mlp(3.0, 4), []))[0] == "1"  # no deadline: it runs
        assert order == [(3.0, 4)]


@pytest.mark.service
async def test_a_batch_that_finishes_after_its_deadline_is_counted_late(repo, monkeypatch):
    """The estimates behind the deadline checks were too optimistic: operators see it."""
    async with model_server(repo) as ms:
        loaded = _learned(ms.manager.resolve("mlp", ""), (4, 0.001))
        late_before = metrics.LATE.labels("mlp")._value.get()
        _order, first_running, release = _recording_runs(loaded, monkeypatch)
        running = asyncio.create_task(ms.manager.execute("mlp", "", _mlp(1.0, 4), [], timeout_s=0.1))
        await asyncio.get_running_loop().run_in_executor(None, first_running.wait, 10)
        await asyncio.sleep(0.15)  # the run outlasts the batch's deadline
        release.set()
        assert (await running)[0] == "1"
        assert metrics.LATE.labels("mlp")._value.get() == late_before + 1
        assert (await ms.manager.execute("mlp", "", _mlp(2.0, 4), [], timeout_s=5.0))[0] == "1"
        assert metrics.LATE.labels("mlp")._value.get() == late_before + 1


@pytest.mark.service
async def test_a_batch_with_no_time_for_the_queue_ahead_is_refused_at_once(repo):
    async with model_server(repo) as running:
        loaded = running.manager.resolve("mlp", "")
        loaded.run_s = 0.4  # as if each batch took 400 ms
        request = model_server_pb2.ExecuteRequest(
            model="mlp", inputs=tensors_to_proto([from_numpy("INPUT0", ROWS, "FP32")])
        )
        async with loaded.gate.turn(0):  # one batch running: about 400 ms more before this one could start
            started = asyncio.get_running_loop().time()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await running.models.Execute(request, timeout=0.6)
            assert asyncio.get_running_loop().time() - started < 0.3  # told at once, not at its deadline
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The hint is the time it lacked: 400 ms ahead, 400 ms of its own, under 600 ms left (less the margin).
        hint = int(dict(refused.value.trailing_metadata())["retry-after-ms"])
        assert 200 <= hint <= 300, hint


@pytest.mark.service
async def test_while_vip_batches_come_a_standard_batch_runs_in_slices_and_a_vip_batch_goes_between(repo, monkeypatch):
    """A VIP batch waits for one slice of the running standard batch, not all of it;
    a standard batch that came later does not cut in; the answer is the whole batch's."""
    async with model_server(repo, slice_s=0.025) as ms:
        loaded = ms.manager.resolve("mlp", "")
        whole = (await ms.manager.execute("mlp", "", _mlp(3.0, 4), []))[1][0]  # no VIP yet: one run of 4
        _learned(loaded, (2, 0.02), (4, 0.04))  # slices of 2 rows fit in 25 ms, 4 rows do not
        await ms.manager.execute("mlp", "", _mlp(9.0, 1), [], tier=1)  # VIP traffic, lately
        sliced_before = metrics.SLICED.labels("mlp")._value.get()
        aside_before = metrics.STEPPED_ASIDE.labels("mlp")._value.get()
        order, first_running, release = _recording_runs(loaded, monkeypatch)
        standard = asyncio.create_task(ms.manager.execute("mlp", "", _mlp(3.0, 4), []))
        await asyncio.get_running_loop().run_in_executor(None, first_running.wait, 10)
        later = asyncio.create_task(ms.manager.execute("mlp", "", _mlp(5.0, 4), []))
        vip = asyncio.create_task(ms.manager.execute("mlp", "", _mlp(9.0, 1), [], tier=1))
        while loaded.gate.waiting < 2:
            await asyncio.sleep(0.001)
        release.set()
        (_, outputs), _, _ = await asyncio.gather(standard, later, vip)
        assert order == [(3.0, 2), (9.0, 1), (3.0, 2), (5.0, 2), (5.0, 2)]
        np.testing.assert_allclose(to_numpy(outputs[0]), to_numpy(whole), rtol=1e-6)
        assert metrics.SLICED.labels("mlp")._value.get() == sliced_before + 2
        assert metrics.STEPPED_ASIDE.labels("mlp")._value.get() == aside_before + 1


@pytest.mark.service
async def test_a_sliced_batch_whose_rest_could_not_finish_in_time_is_refused_before_its_deadline(repo, monkeypatch):
    """Its first slice ran long (here: held 150 ms of its 250): the second, by the
    profile that slice taught, would end past the deadline, so the batch is refused
    then, RESOURCE_EXHAUSTED, rather than answered after its caller gave up."""
    async with model_server(repo, slice_s=0.025) as ms:
        loaded = ms.manager.resolve("mlp", "")
        await ms.manager.execute("mlp", "", _mlp(9.0, 1), [], tier=1)  # VIP traffic, lately: slices of 2
        _learned(loaded, (2, 0.02), (4, 0.04))
        shed_before = metrics.SHED.labels("mlp")._value.get()
        order, first_running, release = _recording_runs(loaded, monkeypatch)
        standard = asyncio.create_task(ms.manager.execute("mlp", "", _mlp(3.0, 4), [], timeout_s=0.25))
        await asyncio.get_running_loop().run_in_executor(None, first_running.wait, 10)
        started = asyncio.get_running_loop().time()
        await asyncio.sleep(0.15)  # the profile then has 2 rows at about 110 ms, cautiously; 100 ms are left
        release.set()
        with pytest.raises(errors.ResourceExhausted, match="would not finish before its deadline"):
            await standard
        assert asyncio.get_running_loop().time() - started < 0.25
        assert order == [(3.0, 2)]  # the second slice never ran
        assert metrics.SHED.labels("mlp")._value.get() == shed_before + 1


@pytest.mark.service
async def test_without_vip_batches_lately_a_standard_batch_runs_whole(repo, monkeypatch):
    async with model_server(repo, slice_s=0.025) as ms:
        loaded = ms.manager.resolve("mlp", "")
        _learned(loaded, (2, 0.02), (4, 0.04))
        order, _, release = _recording_runs(loaded, monkeypatch)
        release.set()
        await ms.manager.execute("mlp", "", _mlp(3.0, 4), [])
        assert order == [(3.0, 4)]


@pytest.mark.service
async def test_a_vip_batch_is_refused_only_if_the_slice_running_leaves_it_no_time(repo, monkeypatch):
    """Behind a sliced standard batch a VIP batch waits for one slice, not for all the
    batch has left: the deadline check counts only that slice."""
    async with model_server(repo, slice_s=0.25) as ms:
        loaded = ms.manager.resolve("mlp", "")
        await ms.manager.execute("mlp", "", _mlp(9.0, 1), [], tier=1)  # VIP traffic, lately
        _learned(loaded, (2, 0.2), (4, 0.4))  # slices of 2 rows; a VIP row is estimated at 0.2 s too
        order, first_running, release = _recording_runs(loaded, monkeypatch)
        standard = asyncio.create_task(ms.manager.execute("mlp", "", _mlp(3.0, 4), []))
        await asyncio.get_running_loop().run_in_executor(None, first_running.wait, 10)
        # 0.5 s left: 0.2 s to run, so it may wait ~0.28 s: enough for the slice (0.2 s), not for all 4 rows (0.4 s).
        vip = asyncio.create_task(ms.manager.execute("mlp", "", _mlp(9.0, 1), [], tier=1, timeout_s=0.5))
        while loaded.gate.waiting < 1 and not vip.done():
            await asyncio.sleep(0.001)
        release.set()
        await asyncio.gather(standard, vip)
        assert order == [(3.0, 2), (9.0, 1), (3.0, 2)]


@pytest.mark.service
async def test_an_instance_reserved_for_vip_runs_a_vip_batch_while_standard_batches_wait(repo, monkeypatch):
    """Two instances, the second for VIP only: a standard batch holds the first, a second
    standard batch waits though the VIP instance is free, and a VIP batch runs at once."""
    _config(repo / "mlp", instances={"count": 2, "reserved_for_vip": 1, "lend_reserved_after_s": None})
    async with model_server(repo) as ms:
        loaded = ms.manager.resolve("mlp", "")
        order, first_running, release = _recording_runs(loaded, monkeypatch)
        first = asyncio.create_task(ms.manager.execute("mlp", "", _mlp(3.0, 4), []))
        await asyncio.get_running_loop().run_in_executor(None, first_running.wait, 10)
        second = asyncio.create_task(ms.manager.execute("mlp", "", _mlp(5.0, 4), []))
        while loaded.gate.waiting < 1:
            await asyncio.sleep(0.001)
        await ms.manager.execute("mlp", "", _mlp(9.0, 1), [], tier=1)  # while both standard batches wait or run
        assert order == [(3.0, 4), (9.0, 1)] and not second.done()
        release.set()
        await asyncio.gather(first, second)
        assert order == [(3.0, 4), (9.0, 1), (5.0, 4)]
        assert loaded.gate.usable(0) == 1 and loaded.gate.usable(1) == 2


@pytest.mark.service
async def test_a_reserved_instance_is_lent_to_standard_batches_when_the_config_says_so(repo, monkeypatch):
    """lend_reserved_after_s 0: a standard batch runs on the VIP instance while the
    general one is busy, and the loan is counted (null, in the test above: it never does)."""
    _config(repo / "mlp", instances={"count": 2, "reserved_for_vip": 1, "lend_reserved_after_s": 0})
    assert load_config(repo / "mlp").instances.lend_reserved_after_s == 0
    async with model_server(repo) as ms:
        loaded = ms.manager.resolve("mlp", "")
        lent_before = metrics.LENT.labels("mlp")._value.get()
        order, first_running, release = _recording_runs(loaded, monkeypatch)
        first = asyncio.create_task(ms.manager.execute("mlp", "", _mlp(3.0, 4), []))
        await asyncio.get_running_loop().run_in_executor(None, first_running.wait, 10)
        await ms.manager.execute("mlp", "", _mlp(5.0, 4), [])  # on the reserved instance, while the first still runs
        assert order == [(3.0, 4), (5.0, 4)] and not first.done()
        assert metrics.LENT.labels("mlp")._value.get() == lent_before + 1
        release.set()
        await first
    _config(repo / "mlp", instances={"count": 2, "reserved_for_vip": 1, "lend_reserved_after_s": None})
    assert load_config(repo / "mlp").instances.lend_reserved_after_s is None
    _config(repo / "mlp", instances={"count": 2, "reserved_for_vip": 1})
    assert load_config(repo / "mlp").instances.lend_reserved_after_s == LEND_RESERVED_AFTER_S


@pytest.mark.service
async def test_a_batch_too_short_to_be_worth_a_thread_hop_runs_on_the_event_loop(repo, monkeypatch):
    """A CPU batch the profile says runs within INLINE_RUN_S runs where the
    request is handled (the hand-off to the instance's thread and back costs
    more than such a run); a longer one still runs on its instance's thread,
    and both answer the same."""
    from services.model_server import execution

    threads: list[str] = []
    run = execution.LoadedVersion.run

    def recording(self, instance, inputs, outputs):
        threads.append(threading.current_thread().name)
        return run(self, instance, inputs, outputs)

    monkeypatch.setattr(execution.LoadedVersion, "run", recording)
    async with model_server(repo) as ms:
        monkeypatch.setattr(execution, "INLINE_RUN_S", 10.0)  # every batch counts as short
        _, inline = await ms.execute()
        monkeypatch.setattr(execution, "INLINE_RUN_S", 0.0)  # none does
        _, threaded = await ms.execute()
    assert threads[-2:][0] == threading.main_thread().name
    assert threads[-1] != threading.main_thread().name
    np.testing.assert_array_equal(inline, threaded)


class _SlowHandOff(concurrent.futures.ThreadPoolExecutor):
    """An instance's thread that takes `delay_s` to pick up each run, as an idle
    or loaded machine's thread wake-up can."""

    def __init__(self, delay_s: float):
        super().__init__(max_workers=1)
        self._delay_s = delay_s

    def submit(self, fn, /, *args, **kwargs):
        def late():
            time.sleep(self._delay_s)
            return fn(*args, **kwargs)

        return super().submit(late)


@pytest.mark.service
async def test_a_short_batch_that_once_went_to_a_slow_thread_comes_back_to_the_event_loop(repo, monkeypatch):
    """Whether a batch runs on the event loop is judged by what runs took
    themselves, not by the hand-off to the instance's thread: a batch that went
    there once, and waited for the thread, does not keep every later one there."""
    threads: list[str] = []
    run = execution.LoadedVersion.run

    def recording(self, instance, inputs, outputs):
        threads.append(threading.current_thread().name)
        return run(self, instance, inputs, outputs)

    monkeypatch.setattr(execution.LoadedVersion, "run", recording)
    async with model_server(repo) as ms:
        loaded = ms.manager.resolve("mlp", "")
        for instance in loaded.instances:
            instance.executor.shutdown()
            instance.executor = _SlowHandOff(0.05)
        monkeypatch.setattr(execution, "INLINE_RUN_S", 0.0)  # the first goes to the thread
        await ms.execute()
        assert threads[-1] != threading.main_thread().name
        assert loaded.estimate_s(1) >= 0.05  # its time, the hand-off included
        monkeypatch.setattr(execution, "INLINE_RUN_S", 0.02)  # above a run of mlp, below the hand-off
        await ms.execute()
        assert threads[-1] == threading.main_thread().name


@pytest.mark.service
async def test_a_direct_caller_whose_data_does_not_fit_its_shape_is_refused_naming_the_input(tmp_path):
    """The model server is reachable without the router: what the router would
    refuse it refuses too, before anything walks the data on its loop."""
    repo = tmp_path / "repo"
    shutil.copytree(MODELS / "minilm-lite", repo / "minilm-lite")
    millions = TensorData("TEXT", "BYTES", (1,), b"\0\0\0\0" * 2_000_000)  # shape [1], 2 million empty elements
    cases = [
        (millions, "input 'TEXT' of model 'minilm-lite' holds more than 1 BYTES element(s)"),
        (TensorData("TEXT", "BYTES", (3,), b"\0\0\0\0"), "too few for the 3 BYTES element(s) of shape [3]"),
        (TensorData("TEXT", "BYTES", (1, 5000), b"\0\0\0\0" * 5000), "has shape [1, 5000]; expected [-1]"),
        (TensorData("TEXT", "BYTES", (-1,), b""), "has shape [-1]; expected [-1]"),
    ]
    async with model_server(repo) as ms:
        for tensor, fragment in cases:
            request = model_server_pb2.ExecuteRequest(model="minilm-lite", inputs=tensors_to_proto([tensor]))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await ms.models.Execute(request, timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
            assert fragment in info.value.details(), info.value.details()
        good = model_server_pb2.ExecuteRequest(
            model="minilm-lite",
            inputs=tensors_to_proto([from_numpy("TEXT", np.array([b"still served"], dtype=object), "BYTES")]),
        )
        assert (await ms.models.Execute(good, timeout=30)).outputs
