"""Tensor-parallel shards: the builder's checks, degree 2 and 4 equal to the
whole model on padded batches (on host arrays and bound through IOBinding, with
the all-reduce's Sum graph), weights split about 1/N per shard, a sharded
version served by the model server and through the mesh as one model, and a
failing shard failing its batch cleanly and withdrawing readiness."""

import asyncio
import json
import pathlib
import shutil

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from grpc_health.v1 import health_pb2
from inference import grpc_predict_v2_pb2_grpc as pb_grpc
from tokenizers import Tokenizer

from services.launcher.mesh import Mesh, MeshConfig
from services.model_server.shards import ShardedSession, ShardError, _sum_graph, read_manifest
from tests.oip import output_array, text_request
from tests.test_model_repository import model_server
from tools.build_models.shards import BertShape, minilm_weights

TEXTS = [
    "",
    "short",
    "A sentence of middling length about queues, batches and replicas.",
    "Совсем другой язык и алфавит.",
    "中文句子也应该得到同样的向量。",
    " ".join(f"token{i}" for i in range(400)),  # past 256 tokens: truncated
]


def _session(path, device=None):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def version_dir(model_repository) -> pathlib.Path:
    folder = model_repository / "minilm" / "1"
    for degree in (2, 4):
        if not (folder / f"tp{degree}" / "manifest.json").is_file():
            pytest.fail(f"{folder / f'tp{degree}'} is missing: run 'make setup'")
    return folder


@pytest.fixture(scope="module")
def sharded_sessions(version_dir):
    """minilm's shard sessions per degree, loaded once for the module (a load is most of a
    test's time) and closed after it."""
    opened: dict[int, ShardedSession] = {}

    def sessions(degree: int) -> ShardedSession:
        if degree not in opened:
            opened[degree] = ShardedSession(version_dir / f"tp{degree}", degree, _session, [None] * degree)
        return opened[degree]

    yield sessions
    for sharded in opened.values():
        sharded.close()


@pytest.fixture(scope="module")
def feeds(version_dir) -> dict[str, np.ndarray]:
    tokenizer = Tokenizer.from_file(str(version_dir / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=256)
    tokenizer.enable_padding()  # a padded batch: the short texts carry hundreds of pad tokens
    encodings = tokenizer.encode_batch(TEXTS)
    return {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
    }


@pytest.mark.unit
def test_degrees_that_do_not_divide_are_refused():
    shape = BertShape(hidden=384, heads=12, layers=6, intermediate=1536, vocab=30522)
    with pytest.raises(ShardError, match="degree 5 does not divide the 12 attention heads"):
        shape.check_degree(5)
    odd = BertShape(hidden=384, heads=12, layers=6, intermediate=1530, vocab=30522)
    with pytest.raises(ShardError, match="degree 4 does not divide the feed-forward inner dimension 1530"):
        odd.check_degree(4)
    shape.check_degree(4)  # 12 heads and 1536 divide by 4; the vocabulary is padded instead


@pytest.mark.unit
@pytest.mark.parametrize("degree", [2, 4])
def test_shards_equal_the_whole_model_on_a_padded_batch(version_dir, feeds, sharded_sessions, degree):
    (whole,) = _session(version_dir / "model.onnx").run(["sentence_embedding"], feeds)
    sharded = sharded_sessions(degree)
    (split,) = sharded.run(["sentence_embedding"], feeds)
    (one,) = sharded.run(
        ["sentence_embedding"], {k: v[2:3, : int(v[2:3].astype(bool).sum()) or 1] for k, v in feeds.items()}
    )
    assert split.shape == (len(TEXTS), 384)
    assert np.abs(split - whole).max() <= 1e-4
    assert np.abs(one - whole[2:3]).max() <= 1e-4


@pytest.mark.unit
@pytest.mark.parametrize("degree", [2, 4])
def test_the_bound_loop_gives_what_the_host_loop_gives(feeds, sharded_sessions, degree):
    # The GPU path's loop (IOBinding, the all-reduce a Sum session) bound to CPU memory here.
    sharded = sharded_sessions(degree)
    (host,) = sharded.run(["sentence_embedding"], feeds)
    (bound,) = sharded._run_bound(["sentence_embedding"], feeds)
    assert bound.shape == host.shape == (len(TEXTS), 384)
    assert np.abs(bound - host).max() <= 1e-6


@pytest.mark.unit
def test_the_all_reduce_graph_is_the_onnx_sum_model_it_claims():
    import onnx
    from onnx import TensorProto, helper

    names = [f"partial{i}" for i in range(3)]

    def tensor(name):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "seq", "hidden"])

    graph = helper.make_graph(
        [helper.make_node("Sum", names, ["sum"])], "all_reduce", [tensor(n) for n in names], [tensor("sum")]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    assert _sum_graph(3) == model.SerializeToString()
    onnx.checker.check_model(onnx.load_from_string(_sum_graph(3)), full_check=True)
    partials = [np.random.default_rng(i).standard_normal((2, 5, 384), dtype=np.float32) for i in range(3)]
    (got,) = ort.InferenceSession(_sum_graph(3), providers=["CPUExecutionProvider"]).run(
        None, dict(zip(names, partials, strict=True))
    )
    np.testing.assert_array_equal(got, partials[0] + partials[1] + partials[2])


@pytest.mark.unit
@pytest.mark.parametrize("degree", [2, 4])
def test_each_shard_holds_about_a_share_of_the_weights(version_dir, degree):
    manifest = read_manifest(version_dir / f"tp{degree}", degree)
    weights, _ = minilm_weights()
    whole = sum(w.size for name, w in weights.items() if w.dtype == np.float32 and not name.startswith("pooler."))
    per_shard = [shard["parameters"] for shard in manifest["shards"]]
    assert len(per_shard) == degree
    # Shard 0 also holds the position and token-type embeddings and the final
    # LayerNorm; LayerNorm weights are replicated. Both are small.
    assert max(per_shard) <= whole / degree * 1.05
    assert min(per_shard) >= whole / degree * 0.95
    assert manifest["segments"][0] == "embed" and manifest["segments"][-1] == "pool"
    assert len(manifest["all_reduce_after"]) == 13  # embeddings, then attention and FFN of six layers


@pytest.mark.unit
def test_a_damaged_shard_set_is_refused(version_dir, tmp_path):
    import shutil

    copy = tmp_path / "tp2"
    shutil.copytree(version_dir / "tp2", copy)
    victim = next((copy / "shard1").iterdir())
    victim.write_bytes(victim.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(ShardError, match="checksum differs"):
        read_manifest(copy, 2)
    with pytest.raises(ShardError, match="degree 2"):
        read_manifest(copy, 4)


def _minilm_repo(tmp_path: pathlib.Path, model_repository: pathlib.Path, **fields) -> pathlib.Path:
    """minilm version 1 only (its folder linked, not copied), with config fields replaced."""
    target = tmp_path / "repo" / "minilm"
    target.mkdir(parents=True)
    (target / "1").symlink_to((model_repository / "minilm" / "1").resolve(), target_is_directory=True)
    config = json.loads((model_repository / "minilm" / "config.json").read_text())
    config.pop("fallback", None)
    config.update({"version_policy": {"specific": {"versions": [1]}}, **fields})
    (target / "config.json").write_text(json.dumps(config))
    for extra in ("golden.json",):  # copied: a file a field names must lie inside the model's folder
        if (model_repository / "minilm" / extra).is_file():
            shutil.copy(model_repository / "minilm" / extra, target / extra)
    return tmp_path / "repo"


@pytest.mark.service
async def test_the_model_server_runs_a_sharded_version_and_withdraws_it_when_a_shard_fails(
    tmp_path, model_repository, version_dir, feeds
):
    from infermesh.model_server.v1 import model_server_pb2

    from services.common.protoconv import tensors_from_proto, tensors_to_proto
    from services.common.tensors import from_numpy, to_numpy

    repo = _minilm_repo(tmp_path, model_repository, tp_degree=2)
    (whole,) = _session(version_dir / "model.onnx").run(["sentence_embedding"], feeds)
    async with model_server(repo) as ms:
        loaded = ms.manager.resolve("minilm", "")
        assert isinstance(loaded.instances[0].session, ShardedSession)
        texts = np.array([t.encode() for t in TEXTS], dtype=object)
        request = model_server_pb2.ExecuteRequest(
            model="minilm", inputs=tensors_to_proto([from_numpy("TEXT", texts, "BYTES")])
        )
        response = await ms.models.Execute(request, timeout=60)
        assert np.abs(to_numpy(tensors_from_proto(response.outputs)[0]) - whole).max() <= 1e-4

        # Shard 1 loses its attention segment of layer 3 (as a device fault would):
        sharded = loaded.instances[0].session
        _name, sessions, _takes = sharded._segments[7]
        sessions[1] = _session(version_dir / "tp2" / "shard1" / "00_embed.onnx")  # wrong graph: it fails to run
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await ms.models.Execute(request, timeout=60)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "lost a tensor-parallel shard (shard 1 failed in segment attn3" in raised.value.details()
        assert not await ms.ready("minilm")
        assert await ms.health_of("minilm") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert any(e[:3] == ("minilm", "1", "UNAVAILABLE") and "shard 1" in e[3] for e in await ms.index())


@pytest.mark.e2e
async def test_router_and_batcher_see_one_model_served_by_four_shards(tmp_path, model_repository, reference_embeddings):
    repo = _minilm_repo(tmp_path, model_repository, tp_degree=4)
    with Mesh(MeshConfig(models=repo, cache=False, log_dir=tmp_path)) as mesh:
        async with grpc.aio.insecure_channel(mesh.router) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            responses = await asyncio.gather(*(stub.ModelInfer(text_request([t]), timeout=60) for t in TEXTS))
    got = np.concatenate([output_array(r, "EMBEDDING") for r in responses])
    want = reference_embeddings(TEXTS)
    cosine = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosine.min() >= 0.9999
