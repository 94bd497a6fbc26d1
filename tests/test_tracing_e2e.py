"""Traces across the whole mesh, read back from a real Jaeger: a caller's
traceparent is honoured, and its trace holds the costly steps of all four
services, parented as the request went, the batch linked to its requests."""

import asyncio
import secrets

import grpc
import numpy as np
import pytest
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.launcher.mesh import Mesh, MeshConfig
from tests.jaeger import jaeger  # noqa: F401 - the fixture
from tests.oip import tensor_request, text_request

pytestmark = pytest.mark.e2e

# The spans of a request of its own, whichever batch carried it (the batch's are in one trace only).
OWN_SPANS = {
    "router.infer",
    "router.validate",
    "router.cache_lookup",
    "router.submit",
    "cache.lookup",
    "cache.store",
    "batcher.submit",
    "batcher.queue_wait",
}
SERVICES = {"infermesh-router", "infermesh-batcher", "infermesh-model-server", "infermesh-cache"}


@pytest.fixture(scope="module")
def traced_mesh(model_repository, tmp_path_factory, jaeger):
    """A mesh that sends its spans to Jaeger and samples no trace of its own accord:
    every trace in Jaeger is one a test asked for."""
    config = MeshConfig(
        models=model_repository,
        log_dir=tmp_path_factory.mktemp("traced-mesh-logs"),
        l2_path=tmp_path_factory.mktemp("traced-l2"),
        otlp_endpoint=jaeger.otlp_grpc_endpoint,
        trace_ratio=0.0,
        # The cache is looked up for every request here: the trace shows its spans.
        router_args=("--cache-min-hit-rate", "0", "--near-cache-ttl-s", "0"),
    )
    with Mesh(config) as mesh:
        yield mesh


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


async def own_spans(jaeger, trace_id: str, timeout_s: float = 45.0) -> dict:
    """The trace's spans by name once all of OWN_SPANS are stored (each service sends when its batch is due)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        spans = await asyncio.to_thread(jaeger.trace, trace_id, timeout_s, 1)
        names = {span.name: span for span in spans}
        if set(names) >= OWN_SPANS or loop.time() > deadline:
            assert set(names) >= OWN_SPANS, sorted(names)
            return names
        await asyncio.sleep(0.2)


async def infer(mesh: Mesh, request, metadata=()) -> None:
    async with grpc.aio.insecure_channel(mesh.router) as channel:
        await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, metadata=metadata, timeout=30)


async def test_a_callers_trace_holds_every_services_steps(traced_mesh, jaeger):
    header, trace_id, caller_span = traceparent()
    await infer(traced_mesh, text_request([f"where does the time go {trace_id}"]), (("traceparent", header),))
    expected = OWN_SPANS | {
        "batcher.batch",
        "batcher.form",
        "model_server.execute",
        "model_server.gate",
        "model_server.tokenise",
        "onnxruntime.run",
        "model_server.encode",
    }
    spans = await asyncio.to_thread(jaeger.trace, trace_id, 45.0, len(expected))
    by_name = {span.name: span for span in spans}
    assert expected <= set(by_name), sorted(by_name)
    assert {span.service for span in spans} == SERVICES
    assert all(span.trace_id == trace_id for span in spans)

    def parent(name: str) -> str:
        parent_id = by_name[name].parent_span_id
        return next(span.name for span in spans if span.span_id == parent_id)

    # The caller's span is the root's parent; each hop's span is a child of the step that called it.
    assert by_name["router.infer"].parent_span_id == caller_span
    assert by_name["router.infer"].kind == "SERVER" and by_name["router.infer"].status != "ERROR"
    assert parent("router.submit") == parent("router.cache_lookup") == "router.infer"
    assert parent("cache.lookup") == "router.cache_lookup"
    assert parent("batcher.submit") == "router.submit"
    assert parent("batcher.queue_wait") == parent("batcher.batch") == "batcher.submit"
    assert parent("batcher.form") == "batcher.batch"
    assert parent("model_server.execute") == "batcher.batch"
    assert parent("onnxruntime.run") == parent("model_server.gate") == "model_server.execute"
    # The batch span links to every request it served: here, this one.
    links = by_name["batcher.batch"].links
    assert [link.span_id for link in links] == [by_name["batcher.submit"].span_id]
    assert by_name["batcher.batch"].attributes["batch.requests"] == 1
    assert by_name["router.infer"].attributes["model"] == "minilm"


async def test_a_batch_of_several_traced_requests_links_to_each(traced_mesh, jaeger):
    """Requests sent together share a batch: its span links to each of their spans,
    and each request's own trace shows its queue wait."""
    headers = [traceparent() for _ in range(6)]
    await asyncio.gather(
        *(
            infer(traced_mesh, tensor_request(np.full((1, 64), i, np.float32)), (("traceparent", header),))
            for i, (header, _, _) in enumerate(headers)
        )
    )
    submits, batches = {}, {}
    for _, trace_id, _ in headers:
        # Each service sends its spans when its batch of them is due: wait for all of a request's own.
        names = await own_spans(jaeger, trace_id)
        submits[trace_id] = names["batcher.submit"].span_id
        batches.update({span.span_id: span for span in names.values() if span.name == "batcher.batch"})
    linked = {(link.trace_id, link.span_id) for batch in batches.values() for link in batch.links}
    assert set(submits.items()) <= linked  # every request is linked from the batch that served it
    assert sum(batch.attributes["batch.requests"] for batch in batches.values()) >= len(headers)


async def test_an_unsampled_or_malformed_traceparent_starts_no_trace(traced_mesh, jaeger):
    _, trace_id, span_id = traceparent()
    await infer(
        traced_mesh,
        tensor_request(np.full((1, 64), 0.5, np.float32)),
        (("traceparent", f"00-{trace_id}-{span_id}-00"),),
    )
    await infer(traced_mesh, tensor_request(np.full((1, 64), 0.25, np.float32)), (("traceparent", "00-" + "z" * 4096),))
    # Proof of the negative: a sampled request sent after both is found, and neither of theirs.
    header, later, _ = traceparent()
    await infer(traced_mesh, tensor_request(np.full((1, 64), 0.75, np.float32)), (("traceparent", header),))
    await asyncio.to_thread(jaeger.trace, later, 45.0, 3)
    with pytest.raises(AssertionError):
        await asyncio.to_thread(jaeger.trace, trace_id, 1.0, 1)
