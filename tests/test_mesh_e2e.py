"""End to end through a real mesh (router, batcher, model_server, cache, redis-server)
with our generated stubs: answers, streaming, every error row, health, metrics."""

import asyncio
import contextlib
import re
import uuid

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from tests.conftest import MAX_REQUEST_BYTES, metric, scrape, until
from tests.oip import output_array, tensor_request, text_request

pytestmark = pytest.mark.e2e


def unique(text: str) -> str:
    """Texts the cache has not seen, so the model really runs."""
    return f"{text} [{uuid.uuid4().hex[:8]}]"


@contextlib.asynccontextmanager
async def router_stub(mesh):
    async with grpc.aio.insecure_channel(mesh.router, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture
async def stub(mesh):
    async with router_stub(mesh) as stub:
        yield stub


async def answered_from_the_cache(stub, mesh, request) -> pb.ModelInferResponse:
    """Sends `request` until the router answers it from the cache (results are
    stored asynchronously, after the answer), and returns that answer."""

    def hits():
        return metric(mesh.router_metrics, "infermesh_router_cache_lookups_total", result="hit")

    before = hits()

    async def hit():
        answer = await stub.ModelInfer(request)
        return answer if hits() > before else None

    return await until(hit, "an identical request answered from the cache", interval_s=0.05)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


async def test_probes_and_metadata(stub):
    assert (await stub.ServerLive(pb.ServerLiveRequest())).live
    assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
    assert (await stub.ModelReady(pb.ModelReadyRequest(name="minilm"))).ready
    metadata = await stub.ModelMetadata(pb.ModelMetadataRequest(name="minilm"))
    assert metadata.versions == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [("TEXT", "BYTES", [-1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [("EMBEDDING", "FP32", [-1, 384])]
    server = await stub.ServerMetadata(pb.ServerMetadataRequest())
    assert server.name == "infermesh" and "model_stream_infer" in server.extensions


async def test_minilm_matches_sentence_transformers(stub, reference_embeddings):
    texts = [
        unique("How do I reset my password?"),
        "",
        "Где находится ближайшая станция метро?",
        "我想退货。",
        unique("token " * 400),
    ]
    response = await stub.ModelInfer(text_request(texts, request_id="r-1"))
    assert (response.model_name, response.model_version, response.id) == ("minilm", "1", "r-1")
    embeddings = output_array(response, "EMBEDDING")
    assert embeddings.shape == (5, 384)
    assert cosine(embeddings, reference_embeddings(texts)).min() >= 0.9999


async def test_plain_tensor_model_matches_onnx_runtime(stub, model_repository):
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    response = await stub.ModelInfer(tensor_request(x))
    session = ort.InferenceSession(
        str(model_repository / "mlp" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    (expected,) = session.run(["OUTPUT0"], {"INPUT0": x})
    np.testing.assert_allclose(output_array(response, "OUTPUT0"), expected, atol=1e-5)


async def test_stream_answers_every_request_by_id_and_survives_bad_ones(stub):
    requests = []
    for i in range(20):
        if i % 5 == 3:
            bad = tensor_request(np.zeros((1, 64), np.float32), model="minilm", name="TEXT")
            bad.id = f"s-{i}"
            requests.append(bad)
        else:
            requests.append(text_request([unique(f"stream text {i}")], request_id=f"s-{i}"))

    async def send():
        for request in requests:
            yield request

    received = [message async for message in stub.ModelStreamInfer(send())]
    answers = {message.infer_response.id: message for message in received}
    assert sorted(m.infer_response.id for m in received) == sorted(r.id for r in requests)  # each exactly once
    for request_id, message in answers.items():
        if int(request_id.split("-")[1]) % 5 == 3:
            assert message.error_message.startswith("INVALID_ARGUMENT")
            assert "input 'TEXT' of model 'minilm' has datatype 'FP32'" in message.error_message
        else:
            assert not message.error_message
            assert output_array(message.infer_response, "EMBEDDING").shape == (1, 384)


def _negative_dim(r):
    r.inputs[0].shape[0] = -1


def _short_raw(r):
    r.raw_input_contents[0] = r.raw_input_contents[0][:-4]


def _bad_prefix(r):
    r.raw_input_contents[0] = b"\xff\x00\x00\x00abc"


def _both(r):
    r.inputs[0].contents.bytes_contents.append(b"x")


def _extra_input(r):
    r.inputs.add(name="EXTRA", datatype="FP32", shape=[1])
    r.raw_input_contents.append(b"\0\0\0\0")


ERROR_ROWS = [
    (
        "unknown model",
        lambda: text_request(["x"], model="gpt-9"),
        grpc.StatusCode.NOT_FOUND,
        "model 'gpt-9' is not served",
    ),
    ("unknown version", lambda: text_request(["x"], version="42"), grpc.StatusCode.NOT_FOUND, "has no version '42'"),
    (
        "wrong datatype",
        lambda: tensor_request(np.zeros((1, 4), np.float32), model="minilm", name="TEXT"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "has datatype 'FP32'; expected BYTES",
    ),
    (
        "wrong shape",
        lambda: tensor_request(np.zeros((2, 63), np.float32)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "has shape [2, 63]; dimension 1 must be 64",
    ),
    (
        "negative dimension",
        lambda: _mutated(text_request(["x"]), _negative_dim),
        grpc.StatusCode.INVALID_ARGUMENT,
        "shape [-1] with a negative dimension",
    ),
    (
        "raw length mismatch",
        lambda: _mutated(tensor_request(np.zeros((2, 64), np.float32)), _short_raw),
        grpc.StatusCode.INVALID_ARGUMENT,
        "has 508 bytes of data but shape [2, 64] of FP32 needs 512",
    ),
    (
        "malformed BYTES prefix",
        lambda: _mutated(text_request(["x"]), _bad_prefix),
        grpc.StatusCode.INVALID_ARGUMENT,
        "element 0 declares length 255",
    ),
    (
        "missing input",
        lambda: pb.ModelInferRequest(model_name="minilm"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "missing input(s) ['TEXT']",
    ),
    (
        "unexpected input",
        lambda: _mutated(text_request(["x"]), _extra_input),
        grpc.StatusCode.INVALID_ARGUMENT,
        "unexpected input(s) ['EXTRA']",
    ),
    (
        "contents and raw contents",
        lambda: _mutated(text_request(["x"]), _both),
        grpc.StatusCode.INVALID_ARGUMENT,
        "has both contents and raw_input_contents",
    ),
    (
        "over the size limit",
        lambda: tensor_request(np.zeros((200, 64 * 90), np.float32)),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        str(MAX_REQUEST_BYTES),
    ),
]


def _mutated(request, change):
    change(request)
    return request


@pytest.mark.parametrize("make, code, fragment", [row[1:] for row in ERROR_ROWS], ids=[row[0] for row in ERROR_ROWS])
async def test_error_rows(stub, make, code, fragment):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ModelInfer(make())
    assert info.value.code() == code
    assert fragment in info.value.details()
    assert (await stub.ServerLive(pb.ServerLiveRequest())).live


async def test_bad_requests_in_a_burst_never_fail_the_good_ones(stub, reference_embeddings):
    good_texts = [unique(f"customer question number {i}") for i in range(40)]
    bad = [ERROR_ROWS[i][1]() for i in (2, 3, 5, 6, 7)] * 2
    calls = [stub.ModelInfer(text_request([t])) for t in good_texts] + [stub.ModelInfer(b) for b in bad]
    results = await asyncio.gather(*calls, return_exceptions=True)
    good, failed = results[:40], results[40:]
    assert all(isinstance(r, pb.ModelInferResponse) for r in good), [r for r in good if isinstance(r, Exception)]
    assert all(isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.INVALID_ARGUMENT for r in failed)
    embeddings = np.concatenate([output_array(r, "EMBEDDING") for r in good])
    assert cosine(embeddings, reference_embeddings(good_texts)).min() >= 0.9999


async def test_requests_that_cannot_make_their_deadline_never_reach_the_model(own_mesh):
    """Either the batcher sees at admission that the backlog ahead is longer than
    the deadline (RESOURCE_EXHAUSTED at once), or, waiting, that too little time
    is left for its batch (RESOURCE_EXHAUSTED then), or the deadline passes while
    the request waits (DEADLINE_EXCEEDED): in every case the mesh answers, before
    the caller's own deadline fires, and the model never runs it. A mesh of its
    own: the flood teaches the shared one batch times of long texts that the
    tests after it would be judged by."""
    async with router_stub(own_mesh) as stub:
        await _a_hurried_request_behind_a_flood(stub, own_mesh)


async def _a_hurried_request_behind_a_flood(stub, mesh):
    batcher_metrics = mesh.metrics_url("batcher")

    def refused():
        return {
            reason: metric(batcher_metrics, "infermesh_batcher_rejections_total", reason=reason)
            for reason in ("deadline", "would_miss_deadline", "no_time_left")
        }

    before = refused()
    # Keep the model busy with long texts, then send a request that cannot wait that long.
    flood = [stub.ModelInfer(text_request([unique("long " * 250)] * 8)) for _ in range(16)]
    flood_tasks = [asyncio.ensure_future(c) for c in flood]
    await until(
        lambda: (
            metric(batcher_metrics, "infermesh_batcher_inflight_batches") >= 1
            and metric(batcher_metrics, "infermesh_batcher_queue_length", model="minilm") >= 1
        ),
        "the model busy with the flood and more of it waiting",
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ModelInfer(text_request([unique("in a hurry")]), timeout=1.0)
    # The flood is only the load; on a slow machine some of it may be refused too.
    await asyncio.gather(*flood_tasks, return_exceptions=True)
    after = refused()
    if info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "it was not run" in info.value.details():
        # It waited until too little time was left for its batch (seen on a busy machine).
        assert re.search(
            r"waited \d+ ms in the standard queue and has \d+ ms left, less than its batch would take",
            info.value.details(),
        )
        assert after["no_time_left"] >= before["no_time_left"] + 1
    elif info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # The limit is a share of the time left, or what is left after the request's own batch.
        assert re.search(r"left before this request's deadline|leaves after its own batch", info.value.details())
        assert after["would_miss_deadline"] == before["would_miss_deadline"] + 1
    else:
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "past its deadline; it was not run" in info.value.details()
        assert after["deadline"] >= before["deadline"] + 1


async def test_identical_requests_are_answered_from_the_cache(stub, mesh):
    request = text_request([unique("cache me")])
    first = await stub.ModelInfer(request)
    second = await answered_from_the_cache(stub, mesh, request)
    assert second.raw_output_contents == first.raw_output_contents


@pytest.mark.parametrize("service", ["router", "batcher", "model_server", "cache"])
async def test_every_service_serves_health_reflection_and_metrics(mesh, service):
    async with grpc.aio.insecure_channel(mesh.address(service)) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(mesh.address(service)) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "grpc.health.v1.Health" in services
    expected_service = {
        "router": "inference.GRPCInferenceService",
        "batcher": "infermesh.batcher.v1.Batcher",
        "model_server": "infermesh.model_server.v1.ModelServer",
        "cache": "infermesh.cache.v1.Cache",
    }[service]
    assert expected_service in services
    url = mesh.router_metrics if service == "router" else mesh.metrics_url(service)
    assert metric(url, "infermesh_grpc_requests_total") > 0
    # Its startup heap is out of the collector's walks, and each collection is timed.
    assert metric(url, "infermesh_gc_frozen_objects") > 10_000
    assert metric(url, "infermesh_gc_pause_seconds_count", generation="2") >= 1  # the one before freezing


async def test_metrics_cover_requests_latency_queue_batches_and_cache(stub, mesh):
    """Each service counts what this test makes it do: a request run by the model
    (a cache miss), the same one answered from the cache, and a refused one."""
    router, batcher, cache = mesh.router_metrics, mesh.metrics_url("batcher"), mesh.metrics_url("cache")
    counted = {
        "answered": (router, "infermesh_router_requests_total", {"model": "minilm", "code": "OK"}),
        "refused": (router, "infermesh_router_requests_total", {"code": "INVALID_ARGUMENT"}),
        "answer times": (router, "infermesh_router_request_duration_seconds_count", {"model": "minilm", "code": "OK"}),
        "refusal times": (router, "infermesh_router_request_duration_seconds_count", {"code": "INVALID_ARGUMENT"}),
        "batches": (batcher, "infermesh_batcher_batch_size_count", {"model": "minilm"}),
        "model runs": (
            mesh.metrics_url("model_server"),
            "infermesh_model_inference_duration_seconds_count",
            {"model": "minilm"},
        ),
        "cache misses": (cache, "infermesh_cache_lookups_total", {"result": "miss"}),
        "cache hits": (cache, "infermesh_cache_lookups_total", {"result": "hit"}),
    }

    def counts():
        return {name: metric(url, sample, **labels) for name, (url, sample, labels) in counted.items()}

    before = counts()
    request = text_request([unique("count me")])
    await stub.ModelInfer(request)
    await answered_from_the_cache(stub, mesh, request)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ModelInfer(ERROR_ROWS[2][1]())  # wrong datatype
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = counts()
    assert [name for name in counted if after[name] <= before[name]] == [], (before, after)
    assert ("infermesh_batcher_queue_length", (("model", "minilm"), ("tier", "standard"))) in scrape(batcher)


async def test_redis_down_answers_still_come_uncached_and_the_cache_recovers(stub, mesh):
    cache_metrics = mesh.metrics_url("cache")
    errors_before = metric(cache_metrics, "infermesh_cache_errors_total")
    mesh.stop_redis()
    try:
        for i in range(5):
            response = await stub.ModelInfer(text_request([unique(f"redis is down {i}")]))
            assert output_array(response, "EMBEDDING").shape == (1, 384)
        assert metric(cache_metrics, "infermesh_cache_errors_total") > errors_before
    finally:
        mesh.start_redis()
    # Once Redis is back the breaker closes by itself and results are cached again.
    await answered_from_the_cache(stub, mesh, text_request([unique("redis is back")]))


async def test_unreadable_messages_are_invalid_argument_and_fail_alone(mesh):
    async with grpc.aio.insecure_channel(mesh.router) as channel:
        raw_unary = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw_unary(b"\xff\xff\xff garbage", timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not a valid message" in info.value.details()

        raw_stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        good = text_request([unique("good, before the garbage")], request_id="g1").SerializeToString()

        after = text_request([unique("good, after the garbage")], request_id="g2").SerializeToString()

        async def messages():
            yield good
            yield b"\xff\xff\xff garbage"
            yield after

        call = raw_stream(messages(), timeout=30)
        answers = {}
        async for message in call:
            answer = pb.ModelStreamInferResponse.FromString(message)
            answers[answer.infer_response.id] = answer.error_message
        assert await call.code() == grpc.StatusCode.OK  # the stream went on past the garbage
        assert answers.keys() == {"g1", "g2", ""} and not answers["g1"] and not answers["g2"]
        assert answers[""].startswith("INVALID_ARGUMENT: ModelStreamInfer request of 11 bytes is not a valid message")
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert (await stub.ServerLive(pb.ServerLiveRequest())).live


async def test_what_the_router_does_not_serve_it_says_so(stub):
    """Triton's answers where a client or probe relies on them: a model that is
    not served is not ready (no error); model control, which the model servers
    do, is UNIMPLEMENTED naming them; a name too long to echo is cut short
    rather than making the status itself too large to send."""
    assert not (await stub.ModelReady(pb.ModelReadyRequest(name="gpt-9"))).ready
    assert not (await stub.ModelReady(pb.ModelReadyRequest(name="minilm", version="42"))).ready
    for call, request in (
        (stub.RepositoryIndex, pb.RepositoryIndexRequest()),
        (stub.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name="minilm")),
        (stub.RepositoryModelUnload, pb.RepositoryModelUnloadRequest(model_name="minilm")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(request)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "loaded and unloaded on the model servers" in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ModelInfer(text_request(["x"], model="m" * 20_000))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "(20000 characters) is not served" in info.value.details()
    many = text_request(["x"])
    for i in range(60):  # within the router's max_outputs
        many.outputs.add(name=f"OUT{i}")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ModelInfer(many)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ", and 52 more]" in info.value.details()


async def test_an_oversized_request_on_a_stream_fails_alone(stub):
    big = tensor_request(np.zeros((200, 64 * 90), np.float32))
    big.id = "big"
    requests = [text_request([unique(f"small {i}")], request_id=f"s{i}") for i in range(3)] + [big]

    async def send():
        for request in requests:
            yield request

    answers = {m.infer_response.id: m async for m in stub.ModelStreamInfer(send())}
    assert sorted(answers) == ["big", "s0", "s1", "s2"]
    assert answers["big"].error_message.startswith("RESOURCE_EXHAUSTED")
    assert f"exceeds the limit of {MAX_REQUEST_BYTES} bytes" in answers["big"].error_message
    assert all(not answers[f"s{i}"].error_message for i in range(3))


async def test_invalid_utf8_text_fails_alone_in_its_batch(stub):
    bad = text_request([b"\xff\xfe not utf-8"])
    good = [text_request([unique(f"valid text {i}")]) for i in range(8)]
    results = await asyncio.gather(stub.ModelInfer(bad), *(stub.ModelInfer(g) for g in good), return_exceptions=True)
    assert isinstance(results[0], grpc.aio.AioRpcError)
    assert results[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "element 0 is not UTF-8 text" in results[0].details()
    assert all(isinstance(r, pb.ModelInferResponse) for r in results[1:])


async def test_a_text_past_the_token_limit_fails_alone_and_one_within_it_is_truncated(stub):
    """Texts up to preprocess.max_text_tokens (8192) are truncated at the model's
    256 tokens; longer ones are refused by the tokenizer, naming the input and the limit."""
    long = text_request([unique("word " * 9000)])  # 45 KB: within the router's 64 KiB per text
    within = [text_request([unique("word " * 2000)]), text_request([unique("short")])]
    results = await asyncio.gather(stub.ModelInfer(long), *(stub.ModelInfer(r) for r in within), return_exceptions=True)
    assert isinstance(results[0], grpc.aio.AioRpcError), results[0]
    assert results[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'TEXT' element 0 of model 'minilm' has more than 8192 tokens" in results[0].details()
    assert all(output_array(r, "EMBEDDING").shape == (1, 384) for r in results[1:])


async def test_a_text_over_the_router_byte_limit_is_refused_naming_it(stub):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ModelInfer(text_request(["ok", "x" * (64 * 1024 + 1)]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'TEXT' of model 'minilm': element 1 is 65537 bytes long; the limit is 65536" in info.value.details()


async def test_requests_up_to_the_model_limit_and_far_deadlines_are_served(own_mesh):
    """A mesh of its own: on the shared one, the batch times earlier tests taught
    it (of long texts, on a busy machine) can rightly have a batch of 64 refused
    as unable to finish within the standard level's 30 s."""
    texts = [unique(f"one of many {i}") for i in range(64)]  # minilm's limit, above the batcher's 32
    async with router_stub(own_mesh) as stub:
        response = await stub.ModelInfer(text_request(texts), timeout=60 * 24 * 3600)  # 60 days
    assert output_array(response, "EMBEDDING").shape == (64, 384)


async def test_the_batcher_answers_one_request_a_message_and_several_alike(mesh):
    """SubmitMany (the router's hop, several requests to a message) and Submit
    (one a message, which routers of the previous release still use) answer
    the same requests with the same outputs, each by its own id."""
    from infermesh.batcher.v1 import batcher_pb2, batcher_pb2_grpc
    from infermesh.common.v1.tensor_pb2 import Tensor

    rows = np.arange(3 * 64, dtype="<f4").reshape(3, 64) / 100

    def request(i):
        return batcher_pb2.SubmitRequest(
            id=i,
            model="mlp",
            timeout_ms=10_000,
            inputs=[Tensor(name="INPUT0", datatype="FP32", shape=[1, 64], data=rows[i - 1].tobytes())],
        )

    async with grpc.aio.insecure_channel(mesh.address("batcher")) as channel:
        batcher = batcher_pb2_grpc.BatcherStub(channel)
        singles = {r.id: r for r in [r async for r in batcher.Submit(iter([request(i) for i in (1, 2, 3)]))]}
        frames = [
            f
            async for f in batcher.SubmitMany(
                iter(
                    [
                        batcher_pb2.SubmitManyRequest(requests=[request(1), request(2)]),
                        batcher_pb2.SubmitManyRequest(
                            requests=[request(3), batcher_pb2.SubmitRequest(id=4, model="no-such")]
                        ),
                    ]
                )
            )
        ]
    many = {r.id: r for frame in frames for r in frame.responses}
    assert sorted(singles) == [1, 2, 3] and sorted(many) == [1, 2, 3, 4]
    for i in (1, 2, 3):
        assert not singles[i].HasField("error") and not many[i].HasField("error")
        assert singles[i].outputs[0].data == many[i].outputs[0].data
        assert np.frombuffer(many[i].outputs[0].data, "<f4").shape == (64,)
    assert many[4].error.code == grpc.StatusCode.UNAVAILABLE.value[0]  # one bad request fails alone


async def test_internal_messages_built_to_be_slow_to_parse_are_refused_unparsed(mesh):
    """The batcher and the model server are reachable without the router: a
    frame of a million empty requests, or a batch of a million tensors, is
    refused with INVALID_ARGUMENT before it is parsed, and both go on serving."""
    from infermesh.batcher.v1 import batcher_pb2, batcher_pb2_grpc
    from infermesh.common.v1.tensor_pb2 import Tensor
    from infermesh.model_server.v1 import model_server_pb2, model_server_pb2_grpc

    frame = b"\x0a\x00" * 1_000_000  # SubmitManyRequest.requests, a million empty ones
    tensors = b"\x1a\x00" * 1_000_000  # ExecuteRequest.inputs, a million empty tensors
    options = [("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(mesh.address("batcher"), options=options) as channel:
        many = channel.stream_stream(
            "/infermesh.batcher.v1.Batcher/SubmitMany",
            request_serializer=None,
            response_deserializer=batcher_pb2.SubmitManyResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [f async for f in many(iter([frame]))]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "SubmitMany message of 2000000 bytes holds more than 131072 protobuf fields" in info.value.details()
        request = batcher_pb2.SubmitRequest(
            id=1,
            model="mlp",
            timeout_ms=10_000,
            inputs=[Tensor(name="INPUT0", datatype="FP32", shape=[1, 64], data=bytes(256))],
        )
        (answer,) = [r async for r in batcher_pb2_grpc.BatcherStub(channel).Submit(iter([request]))]
        assert not answer.HasField("error")
    async with grpc.aio.insecure_channel(mesh.address("model_server"), options=options) as channel:
        execute = channel.unary_unary(
            "/infermesh.model_server.v1.ModelServer/Execute",
            request_serializer=None,
            response_deserializer=model_server_pb2.ExecuteResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await execute(b"\x0a\x03mlp" + tensors)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Execute message of 2000005 bytes holds more than 131072 protobuf fields" in info.value.details()
        ok = await model_server_pb2_grpc.ModelServerStub(channel).Execute(
            model_server_pb2.ExecuteRequest(
                model="mlp", inputs=[Tensor(name="INPUT0", datatype="FP32", shape=[1, 64], data=bytes(256))]
            )
        )
        assert ok.outputs
