"""The router's circuit breaker: the state machine on a fake clock, and end to
end: minilm withdrawn under load, answers from the cache or minilm-lite marked
as degraded, and minilm back in service through half-open steps."""

import asyncio
import json
import random
import uuid

import grpc
import numpy as np
import pytest
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.launcher.mesh import Mesh
from services.router.breaker import HALF_OPEN_STEPS, Breaker, BreakerPolicy, State
from tests.conftest import metric, until
from tests.oip import output_array, text_request

POLICY = BreakerPolicy(open_error_rate=0.05, recover_error_rate=0.01, window_s=10.0, min_requests=20, open_s=5.0)


@pytest.mark.unit
def test_it_opens_past_five_percent_failures_and_not_before_enough_answers():
    breaker = Breaker(POLICY)
    for i in range(19):
        assert breaker.record(float(i) / 10, failed=True) is None  # under min_requests: no verdict
    breaker = Breaker(POLICY)
    for i in range(95):
        breaker.record(i / 100, failed=False)
    for i in range(5):
        assert breaker.record(1 + i / 100, failed=True) is None  # 5 of 100: not over 5%
    assert breaker.record(1.1, failed=True) is State.OPEN  # 6 of 101
    assert not breaker.allows(2.0)


@pytest.mark.unit
def test_old_answers_leave_the_window():
    breaker = Breaker(POLICY)
    for _ in range(100):
        breaker.record(0.0, failed=False)
    states = [breaker.record(11.0, failed=i < 2) for i in range(20)]
    # Counted with the 100 successes 11 s ago, 2 failures would be 1.7%; alone in the window they are 10%.
    assert states[-1] is State.OPEN


@pytest.mark.unit
def test_after_open_s_it_probes_a_growing_share_and_closes_below_one_percent():
    breaker = Breaker(POLICY, rng=random.Random(5))
    for _ in range(20):
        breaker.record(0.0, failed=True)
    assert breaker.state is State.OPEN and not breaker.allows(4.9)
    now = 5.0
    for share in HALF_OPEN_STEPS:
        allowed = sum(breaker.allows(now) for _ in range(4000)) / 4000
        assert breaker.state is State.HALF_OPEN and abs(allowed - share) < 0.03
        changed = None
        for _ in range(POLICY.min_requests):
            changed = breaker.record(now, failed=False)
        now += 1.0
    assert changed is State.CLOSED and breaker.allows(now)


@pytest.mark.unit
def test_a_failing_probe_step_opens_it_again():
    breaker = Breaker(POLICY)
    for _ in range(20):
        breaker.record(0.0, failed=True)
    breaker.allows(5.0)
    assert breaker.state is State.HALF_OPEN
    for i in range(19):
        breaker.record(5.0, failed=False)
    assert breaker.record(5.0, failed=True) is None  # 1 of 20 = 5%: not over
    assert breaker.record(5.0, failed=True) is State.OPEN  # 2 of 21
    assert not breaker.allows(9.9)


@pytest.mark.e2e
async def test_a_withdrawn_model_is_answered_by_its_fallback_and_comes_back(model_repository, tmp_path,
                                                                             reference_embeddings):
    with Mesh(models=model_repository, log_dir=tmp_path, l2_path=tmp_path / "l2",
              batcher_args=("--replica-poll-s", "0.2"),
              router_args=("--catalog-poll-s", "0.2", "--breaker-min-requests", "10", "--breaker-open-s", "1",
                           "--near-cache-ttl-s", "0", "--cache-min-hit-rate", "0")) as mesh:
        async with grpc.aio.insecure_channel(mesh.router) as channel, \
                grpc.aio.insecure_channel(mesh.processes["model_server"].info["grpc"]) as control_channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            control = pb_grpc.GRPCInferenceServiceStub(control_channel)

            def router_sees(model: str, ready: bool):
                """Whether the router's catalog, which comes from the batcher's, has `model` ready or not."""
                async def check() -> bool:
                    return (await stub.ModelReady(pb.ModelReadyRequest(name=model))).ready == ready
                return until(check, f"the router seeing {model} {'ready' if ready else 'without a ready version'}")

            known = "a sentence answered before the outage"
            stored_before = metric(mesh.metrics_url("cache"), "infermesh_cache_stored_bytes_total", level="l1")
            await stub.ModelInfer(text_request([known]), timeout=60)
            await until(lambda: metric(mesh.metrics_url("cache"), "infermesh_cache_stored_bytes_total", level="l1")
                        > stored_before, "the answer stored in the cache")

            await control.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="minilm"), timeout=30,
                metadata=mesh.credentials("dev-admin"))
            await router_sees("minilm", ready=False)
            results = []
            for _ in range(40):
                try:
                    results.append(await stub.ModelInfer(text_request([f"outage {uuid.uuid4().hex}"]), timeout=30))
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                    results.append(exc)
            failed = [r for r in results if isinstance(r, Exception)]
            degraded = [r for r in results if not isinstance(r, Exception)]
            assert len(failed) <= 10  # only until the breaker has seen min_requests answers
            assert degraded and all(r.parameters["infermesh_degraded"].string_param.startswith("fallback minilm-lite/")
                                    for r in degraded)
            assert all(r.model_name == "minilm" and output_array(r, "EMBEDDING").shape == (1, 384) for r in degraded)
            cached = await stub.ModelInfer(text_request([known]), timeout=30)
            assert cached.parameters["infermesh_degraded"].string_param == "cache"
            want = reference_embeddings([known])
            assert float(np.dot(output_array(cached, "EMBEDDING")[0], want[0])) >= 0.9999  # minilm's own answer

            # With the fallback gone too, the caller hears why, as a retryable status.
            await control.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="minilm-lite"), timeout=30,
                metadata=mesh.credentials("dev-admin"))
            await router_sees("minilm-lite", ready=False)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.ModelInfer(text_request([f"no fallback {uuid.uuid4().hex}"]), timeout=30)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "its fallback 'minilm-lite' cannot answer either" in raised.value.details()
            await control.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="minilm-lite"), timeout=60,
                metadata=mesh.credentials("dev-admin"))

            await control.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="minilm"), timeout=120,
                metadata=mesh.credentials("dev-admin"))
            await router_sees("minilm-lite", ready=True)  # the fallback, while the breaker is open
            await router_sees("minilm", ready=True)
            # Half-open: 10%, then 25%, then 50% of requests try minilm, each step needing 10 good answers.
            # Bounded by time, not rounds: degraded answers come fast, and a step that saw a failure
            # reopens the breaker for a second, so on a slow machine rounds can run out first.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while (metric(mesh.router_metrics, "infermesh_router_breaker_state", model="minilm") != 0
                   and loop.time() < deadline):
                await asyncio.gather(*(stub.ModelInfer(text_request([f"recovery {uuid.uuid4().hex}"]), timeout=30)
                                       for _ in range(16)))
            after = await stub.ModelInfer(text_request(["after the recovery"]), timeout=30)
            assert "infermesh_degraded" not in after.parameters and after.model_version == "1", _last_failures(tmp_path)
            assert metric(mesh.router_metrics, "infermesh_router_breaker_state", model="minilm") == 0
            assert metric(mesh.router_metrics, "infermesh_router_breaker_transitions_total", model="minilm",
                          state="closed") >= 1
        samples = [json.loads(line) for line in (tmp_path / "failure-samples.jsonl").read_text().splitlines()]
        assert samples and samples[0]["model"] == "minilm" and samples[0]["status"] == "UNAVAILABLE"
        assert samples[0]["inputs"][0]["texts"][0].startswith("outage ")


def _last_failures(log_dir, count: int = 5) -> str:
    """The last counted failures the router wrote down, for a failing assertion's message."""
    path = log_dir / "failure-samples.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return "last counted failures:\n" + "\n".join(line[:300] for line in lines[-count:])
