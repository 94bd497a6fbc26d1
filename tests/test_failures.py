"""When the model server is gone: UNAVAILABLE (retryable), readiness withdrawn,
the router and batcher stay up."""

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.launcher.mesh import Mesh, MeshConfig
from tests.conftest import metric, wait_until
from tests.oip import output_array, text_request


@pytest.fixture
def uncached_mesh(model_repository, tmp_path):
    with Mesh(
        MeshConfig(
            models=model_repository,
            cache=False,
            log_dir=tmp_path,
            batcher_args=("--replica-poll-s", "0.2"),
            router_args=("--catalog-poll-s", "0.2"),
        )
    ) as mesh:
        yield mesh


@pytest.mark.e2e
def test_model_server_gone_means_unavailable_and_not_ready(uncached_mesh):
    with grpc.insecure_channel(uncached_mesh.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert output_array(stub.ModelInfer(text_request(["before"])), "EMBEDDING").shape == (1, 384)
        server = uncached_mesh.processes["model_server"].popen
        server.send_signal(signal.SIGKILL)
        server.wait()
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(text_request(["after"]), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "minilm" in info.value.details()
        deadline = time.monotonic() + 10
        while stub.ServerReady(pb.ServerReadyRequest()).ready and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not stub.ServerReady(pb.ServerReadyRequest()).ready
        assert not stub.ModelReady(pb.ModelReadyRequest(name="minilm")).ready
        assert stub.ServerLive(pb.ServerLiveRequest()).live
        # Kubernetes' probes: readiness ("") follows the models; liveness (the service's
        # own name) stays SERVING, so kubelet does not restart a router that waits for them.
        health = health_pb2_grpc.HealthStub(channel)
        assert (
            health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.NOT_SERVING
        )
        alive = health.Check(health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService"))
        assert alive.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as again:
            stub.ModelInfer(text_request(["still down"]), timeout=10)
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE
    assert sorted(uncached_mesh.dead()) == ["model_server"]


@pytest.mark.e2e
def test_a_batcher_too_busy_to_answer_a_catalog_poll_keeps_its_models_offered(uncached_mesh):
    """A stopped batcher (SIGSTOP: what a starved process looks like from outside)
    misses the router's catalog polls; for a moment that must not withdraw every
    model, only a run of misses does. The requests sent meanwhile are answered."""
    batcher = uncached_mesh.processes["batcher"].popen
    router_log = uncached_mesh.log_dir / "router.log"

    def missed_polls() -> int:
        return router_log.read_text().count("batcher did not list models")

    with grpc.insecure_channel(uncached_mesh.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert output_array(stub.ModelInfer(text_request(["before"])), "EMBEDDING").shape == (1, 384)
        missed_before = missed_polls()
        batcher.send_signal(signal.SIGSTOP)
        try:
            pending = stub.ModelInfer.future(text_request(["while stopped"]), timeout=30)
            wait_until(lambda: missed_polls() > missed_before, "the router missing a catalog poll (1 s timeout)")
            assert stub.ModelReady(pb.ModelReadyRequest(name="minilm")).ready
        finally:
            batcher.send_signal(signal.SIGCONT)
        assert output_array(pending.result(), "EMBEDDING").shape == (1, 384)
        batcher.send_signal(signal.SIGSTOP)  # now for longer: three missed polls withdraw the models
        try:
            deadline = time.monotonic() + 15
            while stub.ModelReady(pb.ModelReadyRequest(name="minilm")).ready and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not stub.ModelReady(pb.ModelReadyRequest(name="minilm")).ready
        finally:
            batcher.send_signal(signal.SIGCONT)


@pytest.fixture
def tiny_queues(model_repository, tmp_path):
    with Mesh(
        MeshConfig(
            models=model_repository,
            cache=False,
            log_dir=tmp_path,
            batcher_args=("--max-batch-size", "1", "--standard-max-queue-size", "2", "--vip-max-queue-size", "50"),
        )
    ) as mesh:
        yield mesh


@pytest.mark.e2e
async def test_a_full_queue_answers_resource_exhausted_with_a_retry_hint_and_vip_still_gets_in(tiny_queues):
    async with grpc.aio.insecure_channel(tiny_queues.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        long_text = "words " * 200
        standard = [stub.ModelInfer(text_request([f"{i} {long_text}"]), timeout=60) for i in range(12)]
        vip = []
        for i in range(4):
            request = text_request([f"vip {i} {long_text}"])
            request.parameters["priority"].int64_param = 1
            vip.append(stub.ModelInfer(request, timeout=60, metadata=tiny_queues.credentials("dev-vip")))
        calls = [asyncio.ensure_future(c) for c in standard + vip]
        results = await asyncio.gather(*calls, return_exceptions=True)
    rejected = [r for r in results[:12] if isinstance(r, grpc.aio.AioRpcError)]
    assert rejected, "12 standard requests against a queue of 2 should overflow"
    for error in rejected:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (
            "the standard queue of model 'minilm' is full (2 requests waiting)" in error.details()
            or "is refusing standard requests that cannot wait" in error.details()
        )
        assert int(dict(error.trailing_metadata())["retry-after-ms"]) >= 10
    assert all(isinstance(r, pb.ModelInferResponse) for r in results[12:]), "VIP has a queue of its own"
    # Refused by the batcher's full queue, or by the router itself while the batcher's hint lasted.
    rejections = metric(
        tiny_queues.metrics_url("batcher"), "infermesh_batcher_rejections_total", tier="standard", reason="queue_full"
    )
    shed = metric(tiny_queues.router_metrics, "infermesh_router_shed_total", tier="standard")
    assert rejections >= 1 and rejections + shed == len(rejected)


@pytest.mark.unit
def test_internal_hops_try_to_reconnect_at_least_every_two_seconds():
    """gRPC's own reconnect back-off grows to 120 s: a router whose batcher was
    down for 45 s served again only 24 s after the batcher was back (a scratch
    run in review). Every hop's channel caps it; with the cap, 2.2 s after 30 s down."""
    from services.common.serving import client_options

    assert dict(client_options())["grpc.max_reconnect_backoff_ms"] <= 2000


@pytest.mark.unit
def test_servers_take_the_keepalive_pings_our_clients_send():
    """The server option had a name gRPC does not know, so its default (one ping
    a 5 minutes without data) held, and an idle router's streams to the cache
    were cut with GOAWAY too_many_pings every few minutes (seen under make run;
    a scratch pair of servers: cut after 90 s with the wrong name, open after
    240 s with this one)."""
    from services.common.serving import client_options, server_options

    server = dict(server_options(1 << 20))
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < dict(client_options())["grpc.keepalive_time_ms"]
    # A connection with no call is idle and left to close (max_connection_idle_s): the
    # server takes no pings on one, so our clients send none.
    assert (
        server["grpc.keepalive_permit_without_calls"]
        == dict(client_options())["grpc.keepalive_permit_without_calls"]
        == 0
    )
