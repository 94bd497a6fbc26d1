"""The cache as the router uses it: single-flight, per-request and automatic bypass."""

import asyncio
import time
import uuid

import grpc
import pytest
import redis
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc
from infermesh.cache.v1 import cache_pb2, cache_pb2_grpc

from services.launcher.mesh import Mesh, MeshConfig
from services.router.core import SINGLE_FLIGHT_LINGER_S
from tests.conftest import metric, wait_until
from tests.oip import output_array, text_request

pytestmark = pytest.mark.e2e


def rows_run(mesh) -> float:
    return metric(mesh.metrics_url("model_server"), "infermesh_model_batch_rows_sum", model="minilm")


def bypassing(request: pb.ModelInferRequest) -> pb.ModelInferRequest:
    request.parameters["cache_bypass"].bool_param = True
    return request


async def test_a_hundred_identical_concurrent_requests_run_the_model_once(mesh):
    request = text_request([f"the same question, asked by everyone at once {uuid.uuid4().hex}"])
    before = rows_run(mesh)
    async with grpc.aio.insecure_channel(mesh.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        responses = await asyncio.gather(*(stub.ModelInfer(request) for _ in range(100)))
    assert len({r.raw_output_contents[0] for r in responses}) == 1
    assert rows_run(mesh) - before == 1


def test_per_request_bypass_runs_the_model_every_time(mesh):
    request = bypassing(text_request([f"do not cache me {uuid.uuid4().hex}"]))
    before = rows_run(mesh)
    bypassed = metric(mesh.router_metrics, "infermesh_router_cache_lookups_total", result="bypassed")
    with grpc.insecure_channel(mesh.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answers = [stub.ModelInfer(request, timeout=30) for _ in range(3)]
        with pytest.raises(grpc.RpcError) as info:
            wrong = text_request(["x"])
            wrong.parameters["cache_bypass"].string_param = "yes"
            stub.ModelInfer(wrong, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "parameter 'cache_bypass' must be a bool_param, got string_param" in info.value.details()
    assert rows_run(mesh) - before == 3
    assert metric(mesh.router_metrics, "infermesh_router_cache_lookups_total", result="bypassed") - bypassed == 3
    assert len({a.raw_output_contents[0] for a in answers}) == 1


def test_purge_needs_an_admin_tenant_of_the_registry(mesh):
    with grpc.insecure_channel(mesh.address("cache")) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)
        for metadata, code, complaint in (
            ((("authorization", "Bearer anything"),), grpc.StatusCode.UNAUTHENTICATED, "bearer key is not known"),
            ((), grpc.StatusCode.UNAUTHENTICATED, "needs an admin credential"),
            (
                mesh.credentials("dev-vip"),
                grpc.StatusCode.PERMISSION_DENIED,
                "tenant 'dev-vip' may not purge model 'minilm': it has no admin rights",
            ),
        ):
            with pytest.raises(grpc.RpcError) as info:
                stub.Purge(cache_pb2.PurgeRequest(model="minilm"), metadata=metadata, timeout=10)
            assert info.value.code() == code and complaint in info.value.details()
        # minilm-lite: no other test here counts on its cached entries
        assert (
            stub.Purge(
                cache_pb2.PurgeRequest(model="minilm-lite"), metadata=mesh.credentials("dev-admin"), timeout=10
            ).generation
            >= 1
        )


def test_near_cache_then_bypass_for_unique_work_then_recovery(model_repository, tmp_path):
    with Mesh(
        MeshConfig(
            models=model_repository,
            log_dir=tmp_path,
            router_args=("--cache-bypass-window", "20", "--cache-min-hit-rate", "0.1"),
        )
    ) as m:

        def lookups() -> float:
            return sum(
                metric(m.router_metrics, "infermesh_router_cache_lookups_total", result=r)
                for r in ("hit", "miss", "error")
            )

        def gauge() -> float:
            return metric(m.router_metrics, "infermesh_router_cache_bypassed", model="minilm")

        def cache_traffic() -> tuple[float, float]:
            """What the cache service itself saw: lookups it answered, bytes it stored."""
            return (
                metric(m.metrics_url("cache"), "infermesh_cache_lookups_total"),
                metric(m.metrics_url("cache"), "infermesh_cache_stored_bytes_total"),
            )

        stored = redis.Redis.from_url(m.redis_url)

        def results_in_redis() -> int:
            return sum(1 for _ in stored.scan_iter("infermesh:v1:minilm:g*"))

        with grpc.insecure_channel(m.router) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            # A repeat within the near cache's TTL never leaves the router.
            repeat = text_request([f"asked twice {uuid.uuid4().hex}"])
            first = stub.ModelInfer(repeat, timeout=30)
            # Past single-flight's linger, a timer that a busy router may run late; well within
            # the near cache's 1 s. A wait for time itself: the linger is no state one can see.
            time.sleep(SINGLE_FLIGHT_LINGER_S + 0.25)
            lookups_before, near_before = (
                lookups(),
                metric(m.router_metrics, "infermesh_router_cache_lookups_total", result="near_hit"),
            )
            assert stub.ModelInfer(repeat, timeout=30).raw_output_contents == first.raw_output_contents
            assert lookups() == lookups_before
            assert (
                metric(m.router_metrics, "infermesh_router_cache_lookups_total", result="near_hit") == near_before + 1
            )
            for i in range(19):  # with the repeat's miss above, 20 lookups: one window, one hit
                stub.ModelInfer(text_request([f"unique {i} {uuid.uuid4().hex}"]), timeout=30)
            assert gauge() == 1
            # The stores of the window's misses land, all but the last's: its lookup turned the bypass on.
            wait_until(lambda: results_in_redis() == 19, "the window's misses stored")
            before, traffic_before = lookups(), cache_traffic()
            for i in range(40):
                stub.ModelInfer(text_request([f"still unique {i} {uuid.uuid4().hex}"]), timeout=30)
            time.sleep(0.5)  # nothing may come of them: time for a store that should not be to land
            assert lookups() == before  # while bypassed, the cache sees nothing of the model
            assert cache_traffic() == traffic_before
            # The workload turns repetitive: the router sees the repeats itself, and the bypass lifts.
            deadline = time.monotonic() + 60
            while gauge() == 1 and time.monotonic() < deadline:
                response = stub.ModelInfer(text_request(["the one popular question"]), timeout=30)
                time.sleep(
                    SINGLE_FLIGHT_LINGER_S + 0.01
                )  # past single-flight's linger, so each request is a new flight
            assert gauge() == 0
            stub.ModelInfer(text_request(["the one popular question"]), timeout=30)
            assert lookups() > before  # looking up again
            assert output_array(response, "EMBEDDING").shape == (1, 384)
        stored.close()
