"""The router's circuit breaker: the state machine on a fake clock; what counts
against a model (only its own failures, never a caller's short deadline, a bad
request or a busy queue); the bounded failure-samples file; and end to end:
minilm withdrawn under load, answers from the cache or minilm-lite marked as
degraded, and minilm back in service through half-open steps."""

import asyncio
import dataclasses
import json
import random
import uuid

import grpc
import numpy as np
import pytest
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.common import errors
from services.common.tensors import TensorData, from_numpy, pack_bytes_elements
from services.launcher.mesh import Mesh, MeshConfig
from services.router.breaker import HALF_OPEN_STEPS, Breaker, BreakerPolicy, FailureSamples, State
from services.router.config import RouterConfig
from services.router.core import Catalog, InferRequest, Router, RouterSettings
from tests.conftest import metric, until
from tests.oip import output_array, text_request
from tests.test_router_validation import MINILM

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
    for _i in range(19):
        breaker.record(5.0, failed=False)
    assert breaker.record(5.0, failed=True) is None  # 1 of 20 = 5%: not over
    assert breaker.record(5.0, failed=True) is State.OPEN  # 2 of 21
    assert not breaker.allows(9.9)


class FailingModel:
    """A batcher stand-in: minilm fails with `error` (None: answers), its
    fallback always answers; records which model each call went to."""

    def __init__(self, error: errors.InfermeshError | None):
        self.error = error
        self.calls: list[str] = []

    async def submit(self, model, version, inputs, outputs, tier, timeout_s, tenant="", weight=1.0):
        self.calls.append(model)
        if model == "minilm" and self.error is not None:
            raise self.error
        return "1", [from_numpy("EMBEDDING", np.ones((inputs[0].rows, 384), np.float32))]


def breaker_router(batcher, samples: FailureSamples | None = None) -> Router:
    catalog = Catalog()
    catalog.replace(
        [dataclasses.replace(MINILM, fallback="minilm-lite"), dataclasses.replace(MINILM, name="minilm-lite")]
    )
    return Router(
        catalog,
        batcher,
        cache=None,
        settings=RouterSettings(breaker_policy=RouterConfig().breaker_policy()),
        failure_samples=samples,
    )


def texts_request(text: str, timeout_s: float | None = None) -> InferRequest:
    data = pack_bytes_elements([text.encode()])
    return InferRequest(
        "minilm", "", "", [TensorData("TEXT", "BYTES", (1,), data)], [], timeout_s=timeout_s, cache_bypass=True
    )


async def _fail(router: Router, count: int, timeout_s: float | None = None) -> None:
    for i in range(count):
        with pytest.raises(errors.InfermeshError):
            await router.infer(texts_request(f"failing {i}", timeout_s))


@pytest.mark.unit
async def test_a_callers_own_short_deadline_never_opens_the_breaker():
    """The issue's attack: many requests with a tiny deadline time out; the next
    ordinary request, anyone's, is still answered by minilm itself."""
    batcher = FailingModel(errors.DeadlineExceeded("waited past its deadline; it was not run"))
    router = breaker_router(batcher)
    await _fail(router, 60, timeout_s=0.01)
    await _fail(router, 60, timeout_s=0.999)  # just under breaker_min_counted_timeout_ms
    batcher.error = None
    result = await router.infer(texts_request("an ordinary request"))
    assert not result.degraded and batcher.calls[-1] == "minilm"
    assert router._breakers["minilm"].state is State.CLOSED


@pytest.mark.unit
async def test_a_deadline_exceeded_with_an_ample_budget_is_the_models_failure():
    batcher = FailingModel(errors.DeadlineExceeded("the model did not answer in time"))
    router = breaker_router(batcher)
    await _fail(router, 19, timeout_s=1.0)
    result = await router.infer(texts_request("the twentieth", timeout_s=1.0))  # opens it: the fallback answers
    assert result.degraded.startswith("fallback minilm-lite/") and batcher.calls[-1] == "minilm-lite"


@pytest.mark.unit
@pytest.mark.parametrize(
    "error",
    [
        errors.InvalidArgument("input 'TEXT' is wrong"),
        errors.ResourceExhausted("queue full", retry_after_ms=50),
        errors.NotFound("no such version"),
        errors.Cancelled("the caller went away"),
        errors.PermissionDenied("no"),
        errors.FailedPrecondition("not now"),
    ],
)
async def test_failures_that_are_not_the_models_are_not_recorded_either_way(error):
    """Neither counted as failures nor as successes: a flood of bad requests
    must not keep the breaker closed while the model fails everyone else."""
    batcher = FailingModel(error)
    router = breaker_router(batcher)
    await _fail(router, 500)  # a refusal with a retry hint: the router then sheds the rest itself
    assert router._breakers["minilm"].state is State.CLOSED
    await asyncio.sleep(0.1)  # past the hint, so that the next requests reach the batcher
    batcher.error = errors.Unavailable("the model server is down")
    await _fail(router, 19)
    # 20 of 20 failed: the breaker opens, and the fallback answers. Counted beside
    # 500 successes they would be under 4%, and every caller would keep failing.
    result = await router.infer(texts_request("while minilm is down"))
    assert result.degraded.startswith("fallback minilm-lite/")


class HeldModel(FailingModel):
    """Holds every call to minilm until released: the callers go away meanwhile."""

    def __init__(self):
        super().__init__(None)
        self.release = asyncio.Event()
        self.held = 0

    async def submit(self, model, version, inputs, outputs, tier, timeout_s, tenant="", weight=1.0):
        if model == "minilm" and not self.release.is_set():
            self.held += 1
            await self.release.wait()
        return await super().submit(model, version, inputs, outputs, tier, timeout_s)


@pytest.mark.unit
async def test_callers_that_go_away_are_not_recorded():
    """Cancelled callers (a client that hung up, a stream closed) say nothing of the model."""
    batcher = HeldModel()
    router = breaker_router(batcher)
    calls = [asyncio.create_task(router.infer(texts_request(f"leaving {i}"))) for i in range(100)]
    await until(lambda: batcher.held == 100, "every call held at the batcher")
    for call in calls:
        call.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    assert all(call.cancelled() for call in calls)
    assert router._breakers["minilm"].state is State.CLOSED
    batcher.release.set()
    batcher.error = errors.Unavailable("the model server is down")
    await _fail(router, 19)
    # 20 of 20 counted answers failed: open. Counted as answers, the 100 would keep it closed.
    assert (await router.infer(texts_request("while minilm is down"))).degraded.startswith("fallback minilm-lite/")


@pytest.mark.unit
@pytest.mark.parametrize("code", ["UNAVAILABLE", "INTERNAL", "UNKNOWN"])
async def test_the_models_own_failures_open_the_breaker(code):
    error = errors.Internal("the model failed") if code != "UNAVAILABLE" else errors.Unavailable("no replica")
    error.code_name = code
    router = breaker_router(FailingModel(error))
    await _fail(router, 19)
    result = await router.infer(texts_request("the twentieth"))  # opens the breaker: answered by the fallback
    assert result.degraded.startswith("fallback minilm-lite/")


@pytest.mark.unit
def test_a_config_below_its_bounds_is_refused():
    with pytest.raises(ValueError, match="failure_samples_content must be off, redacted or full, got 'all'"):
        RouterConfig(failure_samples_content="all")
    with pytest.raises(ValueError, match="failure_samples_max_bytes must be >= 65536"):
        RouterConfig(failure_samples_max_bytes=100)
    with pytest.raises(ValueError, match="breaker_min_counted_timeout_ms must be >= 0"):
        RouterConfig(breaker_min_counted_timeout_ms=-1)
    assert RouterConfig(failure_samples_path="x.jsonl", failure_samples_content="off").failure_samples() is None


SECRET = "my account number is 12345678 and my password is hunter2"


async def _sample_lines(tmp_path, content: str) -> list[dict]:
    path = tmp_path / f"{content}.jsonl"
    router = breaker_router(
        FailingModel(errors.Unavailable("the model server is down")), FailureSamples(str(path), content=content)
    )
    await _fail(router, 3)
    with pytest.raises(errors.Unavailable):  # the breaker is still closed: a counted failure
        await router.infer(texts_request(SECRET))
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.unit
async def test_redacted_samples_hold_shapes_and_keyed_hashes_never_the_text(tmp_path):
    lines = await _sample_lines(tmp_path, "redacted")
    assert len(lines) == 4 and SECRET not in (tmp_path / "redacted.jsonl").read_text()
    last = lines[-1]
    assert (last["model"], last["status"], last["message"]) == ("minilm", "UNAVAILABLE", "the model server is down")
    (tensor,) = last["inputs"]
    assert tensor["shape"] == [1] and "texts" not in tensor and len(tensor["text_hashes"]) == 1
    assert len(tensor["text_hashes"][0]) == 16  # 8 bytes, hex
    hashes = {line["inputs"][0]["text_hashes"][0] for line in lines}
    assert len(hashes) == 4  # one per distinct text
    assert (await _sample_lines(tmp_path / "again", "redacted"))[-1]["inputs"][0]["text_hashes"] != tensor[
        "text_hashes"
    ], "the hash is keyed per process (here: per FailureSamples), not a bare digest"


@pytest.mark.unit
async def test_full_samples_hold_texts_cut_short_and_off_writes_nothing(tmp_path):
    assert (await _sample_lines(tmp_path, "full"))[-1]["inputs"][0]["texts"] == [SECRET]
    assert await _sample_lines(tmp_path, "off") == [] and not (tmp_path / "off.jsonl").exists()


@pytest.mark.unit
async def test_the_samples_file_is_bounded_and_rotated_once(tmp_path):
    path = tmp_path / "samples.jsonl"
    samples = FailureSamples(str(path), per_minute=10_000, max_bytes=4096)
    router = breaker_router(FailingModel(errors.Unavailable("down")), samples)
    router._breaker_policy = dataclasses.replace(router._breaker_policy, min_requests=10**9)  # stays closed
    await _fail(router, 200)
    assert path.stat().st_size <= 4096 and (tmp_path / "samples.jsonl.1").stat().st_size <= 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == ["samples.jsonl", "samples.jsonl.1"]
    newest = [json.loads(line) for line in path.read_text().splitlines()]
    assert newest and newest[-1]["inputs"][0]["shape"] == [1]


@pytest.mark.e2e
async def test_tiny_deadlines_through_the_mesh_leave_the_breaker_closed(mesh):
    """The issue's attack end to end: 60 requests with a tiny deadline and
    cache_bypass, then ordinary requests from anyone, answered by minilm."""
    async with grpc.aio.insecure_channel(mesh.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _i in range(60):
            request = text_request([f"tiny deadline {uuid.uuid4().hex}"])
            request.parameters["cache_bypass"].bool_param = True
            request.parameters["timeout"].int64_param = 1000  # 1 ms
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.ModelInfer(request, timeout=30)
            assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _i in range(5):
            answer = await stub.ModelInfer(text_request([f"an ordinary request {uuid.uuid4().hex}"]), timeout=30)
            assert "infermesh_degraded" not in answer.parameters
    assert metric(mesh.router_metrics, "infermesh_router_breaker_state", model="minilm") == 0


@pytest.mark.e2e
async def test_a_withdrawn_model_is_answered_by_its_fallback_and_comes_back(
    model_repository, tmp_path, reference_embeddings
):
    with Mesh(
        MeshConfig(
            models=model_repository,
            log_dir=tmp_path,
            l2_path=tmp_path / "l2",
            batcher_args=("--replica-poll-s", "0.2"),
            router_args=(
                "--catalog-poll-s",
                "0.2",
                "--breaker-min-requests",
                "10",
                "--breaker-open-s",
                "1",
                "--near-cache-ttl-s",
                "0",
                "--cache-min-hit-rate",
                "0",
            ),
        )
    ) as mesh:
        async with (
            grpc.aio.insecure_channel(mesh.router) as channel,
            grpc.aio.insecure_channel(mesh.processes["model_server"].info["grpc"]) as control_channel,
        ):
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
            await until(
                lambda: (
                    metric(mesh.metrics_url("cache"), "infermesh_cache_stored_bytes_total", level="l1") > stored_before
                ),
                "the answer stored in the cache",
            )

            await control.RepositoryModelUnload(
                pb.RepositoryModelUnloadRequest(model_name="minilm"), timeout=30, metadata=mesh.credentials("dev-admin")
            )
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
            assert degraded and all(
                r.parameters["infermesh_degraded"].string_param.startswith("fallback minilm-lite/") for r in degraded
            )
            assert all(r.model_name == "minilm" and output_array(r, "EMBEDDING").shape == (1, 384) for r in degraded)
            cached = await stub.ModelInfer(text_request([known]), timeout=30)
            assert cached.parameters["infermesh_degraded"].string_param == "cache"
            want = reference_embeddings([known])
            assert float(np.dot(output_array(cached, "EMBEDDING")[0], want[0])) >= 0.9999  # minilm's own answer

            # With the fallback gone too, the caller hears why, as a retryable status.
            await control.RepositoryModelUnload(
                pb.RepositoryModelUnloadRequest(model_name="minilm-lite"),
                timeout=30,
                metadata=mesh.credentials("dev-admin"),
            )
            await router_sees("minilm-lite", ready=False)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.ModelInfer(text_request([f"no fallback {uuid.uuid4().hex}"]), timeout=30)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "its fallback 'minilm-lite' cannot answer either" in raised.value.details()
            await control.RepositoryModelLoad(
                pb.RepositoryModelLoadRequest(model_name="minilm-lite"),
                timeout=60,
                metadata=mesh.credentials("dev-admin"),
            )

            await control.RepositoryModelLoad(
                pb.RepositoryModelLoadRequest(model_name="minilm"), timeout=120, metadata=mesh.credentials("dev-admin")
            )
            await router_sees("minilm-lite", ready=True)  # the fallback, while the breaker is open
            await router_sees("minilm", ready=True)
            # Half-open: 10%, then 25%, then 50% of requests try minilm, each step needing 10 good answers.
            # Bounded by time, not rounds: degraded answers come fast, and a step that saw a failure
            # reopens the breaker for a second, so on a slow machine rounds can run out first.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while (
                metric(mesh.router_metrics, "infermesh_router_breaker_state", model="minilm") != 0
                and loop.time() < deadline
            ):
                await asyncio.gather(
                    *(stub.ModelInfer(text_request([f"recovery {uuid.uuid4().hex}"]), timeout=30) for _ in range(16))
                )
            after = await stub.ModelInfer(text_request(["after the recovery"]), timeout=30)
            assert "infermesh_degraded" not in after.parameters and after.model_version == "1", _last_failures(tmp_path)
            assert metric(mesh.router_metrics, "infermesh_router_breaker_state", model="minilm") == 0
            assert (
                metric(
                    mesh.router_metrics, "infermesh_router_breaker_transitions_total", model="minilm", state="closed"
                )
                >= 1
            )
        # The launcher names a samples file; the router writes it redacted by default.
        samples = [json.loads(line) for line in (tmp_path / "failure-samples.jsonl").read_text().splitlines()]
        assert samples and samples[0]["model"] == "minilm" and samples[0]["status"] == "UNAVAILABLE"
        assert samples[0]["inputs"][0]["text_hashes"] and "outage " not in json.dumps(samples)


def _last_failures(log_dir, count: int = 5) -> str:
    """The last counted failures the router wrote down, for a failing assertion's message."""
    path = log_dir / "failure-samples.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return "last counted failures:\n" + "\n".join(line[:300] for line in lines[-count:])
