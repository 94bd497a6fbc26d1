"""Several model_server replicas behind one batcher: both get work, and one dying
under load loses no request. Behind a service mesh (one address for them all)
a failed batch does not take the address out, and the catalog merges polls."""

import asyncio
import collections
import contextlib
import os
import pathlib
import shutil
import signal
import sys
import uuid

import grpc
import numpy as np
import prometheus_client
import pytest
import yaml
from inference import grpc_predict_v2_pb2_grpc as pb_grpc
from infermesh.common.v1 import tensor_pb2
from infermesh.model_server.v1 import model_server_pb2, model_server_pb2_grpc

from services.batcher.config import ReplicaConfig
from services.batcher.core import Batcher, BatchingConfig
from services.batcher.discovery import FAILED_POLLS, MESH_HISTORY_POLLS, _merge_polls
from services.batcher.replicas import ReplicaSet
from services.batcher.upstream import transport_failure as _transport_failure
from services.common import errors, traffic
from services.common.tensors import from_numpy
from services.common.tier import Tier
from services.launcher.mesh import MODEL_SERVER_NICE, Mesh, MeshConfig, Process
from services.model_server.config import ModelServerConfig
from services.model_server.core import ManagerConfig, ModelManager
from services.model_server.server import ModelServerServicer, build_server
from tests.conftest import metric, until
from tests.oip import output_array, text_request
from tests.test_model_repository import _config, repo  # noqa: F401 - the mlp repository fixture

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def two_replicas(model_repository, tmp_path):
    with Mesh(
        MeshConfig(
            models=model_repository,
            cache=False,
            log_dir=tmp_path,
            model_servers=2,
            model_server_nice=(0, 3),
            batcher_args=("--replica-poll-s", "0.2", "--max-batch-size", "4"),
        )
    ) as mesh:
        yield mesh


@pytest.mark.e2e
def test_each_replica_runs_at_its_own_cpu_priority(two_replicas):
    """The launcher's per-replica niceness (bench/batching.py runs a standard pool
    at a lower priority than the VIP pool this way)."""
    priorities = [
        os.getpriority(os.PRIO_PROCESS, two_replicas.processes[f"model_server-{i}"].popen.pid) for i in range(2)
    ]
    assert [p - os.getpriority(os.PRIO_PROCESS, 0) for p in priorities] == [0, 3]
    if os.path.exists("/proc/self/autogroup"):  # the kernel schedules sessions as groups: theirs counts
        groups = [
            pathlib.Path(f"/proc/{two_replicas.processes[f'model_server-{i}'].popen.pid}/autogroup").read_text()
            for i in range(2)
        ]
        assert [int(g.split("nice")[1]) for g in groups] == [0, 3]


@pytest.mark.e2e
def test_by_default_the_model_server_runs_below_the_router_and_the_batcher(mesh):
    """The light hops in front of the model get a core first when they need one."""

    def niceness(name: str) -> int:
        return os.getpriority(os.PRIO_PROCESS, mesh.processes[name].popen.pid) - os.getpriority(os.PRIO_PROCESS, 0)

    assert (niceness("model_server"), niceness("batcher"), niceness("router")) == (MODEL_SERVER_NICE, 0, 0)
    if os.path.exists("/proc/self/autogroup"):
        group = pathlib.Path(f"/proc/{mesh.processes['model_server'].popen.pid}/autogroup").read_text()
        assert int(group.split("nice")[1]) == MODEL_SERVER_NICE


@pytest.mark.e2e
def test_local_replicas_split_the_cores_between_them(two_replicas):
    """As pods split a node's cores by their CPU requests: each taking them all,
    two model servers' ONNX Runtime threads would outnumber the cores."""
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    for i in range(2):
        argv = pathlib.Path(f"/proc/{two_replicas.processes[f'model_server-{i}'].popen.pid}/cmdline").read_bytes()
        args = argv.decode().split("\0")
        assert args[args.index("--intra-op-threads") + 1] == share


def batches_run(mesh, name: str) -> float:
    return metric(mesh.metrics_url(name), "infermesh_model_batches_total", model="minilm", outcome="ok")


@pytest.mark.e2e
async def test_both_replicas_get_work_and_one_dying_loses_nothing(two_replicas):
    mesh = two_replicas
    async with grpc.aio.insecure_channel(mesh.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        warm = await asyncio.gather(
            *(stub.ModelInfer(text_request([f"warm {i} {uuid.uuid4().hex}"]), timeout=60) for i in range(32))
        )
        assert all(output_array(r, "EMBEDDING").shape == (1, 384) for r in warm)
        assert batches_run(mesh, "model_server-0") > 0 and batches_run(mesh, "model_server-1") > 0

        # Long texts keep both replicas busy; then one of them dies mid-batch.
        calls = [
            asyncio.ensure_future(
                stub.ModelInfer(text_request([f"{uuid.uuid4().hex} " + "long words " * 120] * 2), timeout=120)
            )
            for _ in range(40)
        ]
        victim = mesh.processes["model_server-1"]
        await until(
            lambda: (
                metric(mesh.metrics_url("batcher"), "infermesh_batcher_inflight_batches", replica=victim.info["grpc"])
                >= 1
            ),
            "a batch in flight on the replica to kill",
        )
        victim = victim.popen
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        results = await asyncio.gather(*calls, return_exceptions=True)
    failures = [r for r in results if isinstance(r, Exception)]
    assert not failures, failures[:3]
    assert all(output_array(r, "EMBEDDING").shape == (2, 384) for r in results)
    assert sorted(mesh.dead()) == ["model_server-1"]
    # The batches that were on the dead replica went to the other one.
    assert metric(mesh.metrics_url("batcher"), "infermesh_batcher_retries_total", code="UNAVAILABLE") >= 1


# ---------------------------------------------------------------- behind a mesh


@contextlib.asynccontextmanager
async def mlp_server(repository, port: int = 0):
    manager = ModelManager(ManagerConfig(str(repository), "cpu", 1, probe_interval_s=0))
    await manager.start()
    server, bound, _ = await build_server(ModelServerConfig(model_repository=str(repository)), manager, port=port)
    try:
        yield bound
    finally:
        await server.stop(0)
        await manager.close()


def mlp_batch() -> list:
    return [from_numpy("INPUT0", np.ones((2, 64), dtype=np.float32), "FP32")]


@contextlib.asynccontextmanager
async def busy_mlp_server(repository):
    """A model server whose only session is taken and whose batches take 5 s:
    it refuses any batch with a shorter deadline at once, with a retry hint."""
    manager = ModelManager(ManagerConfig(str(repository), "cpu", 1, probe_interval_s=0))
    await manager.start()
    server, port, _ = await build_server(ModelServerConfig(model_repository=str(repository)), manager, port=0)
    loaded = manager.resolve("mlp", "")
    loaded.run_s = 5.0
    try:
        async with loaded.gate.turn(0):
            yield port
    finally:
        await server.stop(0)
        await manager.close()


@pytest.mark.service
async def test_a_busy_replicas_refusal_goes_once_elsewhere_else_reaches_the_caller_with_its_hint(repo):
    async with busy_mlp_server(repo) as busy, mlp_server(repo) as free:
        alone = ReplicaSet(ReplicaConfig((f"127.0.0.1:{busy}",), 4, 60.0, 1 << 24))
        pair = ReplicaSet(ReplicaConfig((f"127.0.0.1:{busy}", f"127.0.0.1:{free}"), 4, 60.0, 1 << 24))
        await alone.start()
        await pair.start()
        with pytest.raises(errors.ResourceExhausted, match="would not finish before its deadline") as refused:
            await alone.execute("mlp", "", mlp_batch(), [], 2.0)
        # It lacked about 8 s: 5 s for the batch ahead and 5 s of its own, with 2 s left.
        assert 7900 <= refused.value.retry_after_ms <= 8100
        retries = metric_value("infermesh_batcher_retries_total", code="RESOURCE_EXHAUSTED")
        assert (await pair.execute("mlp", "", mlp_batch(), [], 2.0))[0] == "1"  # the busy one (first) refused
        assert metric_value("infermesh_batcher_retries_total", code="RESOURCE_EXHAUSTED") == retries + 1
        assert all(r.ready for r in pair._replicas)  # busy is not down
        await alone.close()
        await pair.close()


@pytest.mark.service
async def test_grpcs_own_resource_exhausted_is_not_a_busy_replica_and_is_not_retried(repo):
    """A batch over a model server's message limit fails there with gRPC's own
    RESOURCE_EXHAUSTED (no retry hint): another replica would refuse it too."""
    manager = ModelManager(ManagerConfig(str(repo), "cpu", 1, probe_interval_s=0))
    await manager.start()
    small = ModelServerConfig(model_repository=str(repo), max_message_bytes=4096)
    servers = [await build_server(small, manager, port=0) for _ in range(2)]
    replicas = ReplicaSet(ReplicaConfig(tuple(f"127.0.0.1:{port}" for _, port, _ in servers), 4, 60.0, 1 << 24))
    try:
        await replicas.start()
        retries = metric_value("infermesh_batcher_retries_total", code="RESOURCE_EXHAUSTED")
        with pytest.raises(errors.ResourceExhausted) as refused:
            await replicas.execute(
                "mlp", "", [from_numpy("INPUT0", np.ones((32, 64), dtype=np.float32), "FP32")], [], 10.0
            )
        assert refused.value.retry_after_ms == 0
        assert metric_value("infermesh_batcher_retries_total", code="RESOURCE_EXHAUSTED") == retries
        assert all(r.ready for r in replicas._replicas)
    finally:
        await replicas.close()
        for server, _, _ in servers:
            await server.stop(0)
        await manager.close()


@pytest.mark.service
async def test_with_a_traffic_policy_each_replica_still_holds_at_most_its_bound_of_batches(repo):
    """The batcher's slots are counted over all replicas; a subset (here: the
    blue one, a single replica) must still get no more than its own bound,
    and a batch that waits for room past its deadline is refused."""
    policy = traffic.PolicyFiles([ROOT / "mesh" / "istio" / "model-server-traffic.yaml"], "model-server")
    manager = ModelManager(ManagerConfig(str(repo), "cpu", 1, probe_interval_s=0))
    await manager.start()
    config = ModelServerConfig(model_repository=str(repo), labels="version=blue,pool=vip")  # both tiers here
    server, port, _ = await build_server(config, manager, port=0)
    replicas = ReplicaSet(
        ReplicaConfig((f"127.0.0.1:{port}",), 1, 60.0, 1 << 24), policy
    )  # one batch in flight per replica
    try:
        await replicas.start()
        (replica,) = replicas._replicas
        loaded = manager.resolve("mlp", "")
        async with loaded.gate.turn(0):  # the model is busy: the first batch waits at the server
            first = asyncio.ensure_future(replicas.execute("mlp", "", mlp_batch(), [], 30.0))
            second = asyncio.ensure_future(replicas.execute("mlp", "", mlp_batch(), [], 30.0))
            await until(lambda: replicas.routing._room_waiters, "a batch waiting for room", timeout_s=10)
            assert replica.inflight == 1  # the second waits here, not in the server's queue
            with pytest.raises(
                errors.ResourceExhausted,
                match=r"had as many batches in flight as it may \(1\) until this "
                "batch could no longer finish before its deadline",
            ):
                await replicas.execute("mlp", "", mlp_batch(), [], 0.2)
            # A VIP batch has a slot of its own: it goes to the server's VIP-first gate.
            vip = asyncio.ensure_future(replicas.execute("mlp", "", mlp_batch(), [], 30.0, tier=1))
            await until(lambda: replica.inflight == 2, "two batches in flight", timeout_s=10)
        assert [(await call)[0] for call in (first, second, vip)] == ["1", "1", "1"]
        assert replica.inflight == 0
    finally:
        await replicas.close()
        await server.stop(0)
        await manager.close()


@pytest.mark.service
async def test_under_a_traffic_policy_each_tier_counts_the_slots_its_route_reaches(repo, tmp_path):
    """Two blue replicas, a green one at weight 0 and a VIP pool: standard
    batches get the blue ones' slots, less an ejected one; VIP batches get the
    VIP pool's alone; a new weight brings green in and leaves the ejection as
    it was (as in Istio); a changed outlierDetection starts afresh."""
    policy_file = tmp_path / "traffic.yaml"
    policy_file.write_text((ROOT / "mesh" / "istio" / "model-server-traffic.yaml").read_text())
    policy = traffic.PolicyFiles([policy_file], "model-server")
    manager = ModelManager(ManagerConfig(str(repo), "cpu", 1, probe_interval_s=0))
    await manager.start()
    servers = [
        await build_server(ModelServerConfig(model_repository=str(repo), labels=labels), manager, port=0)
        for labels in ("version=blue", "version=blue", "version=green", "pool=vip")
    ]
    addresses = tuple(f"127.0.0.1:{port}" for _, port, _ in servers)
    replicas = ReplicaSet(ReplicaConfig(addresses, 1, 60.0, 1 << 24), policy)
    try:
        await replicas.start()
        # One instance each: a standard batch apiece on blue; the VIP pool's one and one more.
        assert replicas.slots("mlp") == (2, 2, 0)  # no standard slot VIP batches reach
        without_policy = ReplicaSet(ReplicaConfig(addresses, 1, 60.0, 1 << 24))
        await without_policy.poll_once()
        assert without_policy.slots("mlp") == (4, 4, 4)  # every replica, for either tier
        await without_policy.close()
        blue = replicas.routing._detectors["blue"]
        now = asyncio.get_running_loop().time()
        assert [blue.record(addresses[0], "UNAVAILABLE", now) for _ in range(3)][-1]  # ejected
        assert replicas.slots("mlp") == (1, 2, 0)
        policy_file.write_text(
            policy_file.read_text().replace("weight: 100", "weight: 50").replace("weight: 0", "weight: 50")
        )
        await replicas.poll_once()  # reloads the policy: green comes in, the ejected blue stays out
        assert replicas.routing._detectors["blue"] is blue and blue.ejected() == [addresses[0]]
        assert replicas.slots("mlp") == (2, 2, 0)
        policy_file.write_text(policy_file.read_text().replace("consecutive5xxErrors: 3", "consecutive5xxErrors: 10"))
        await replicas.poll_once()  # a new outlierDetection: Envoy's new cluster has no ejections
        assert replicas.routing._detectors["blue"].ejected() == []
        assert replicas.slots("mlp") == (3, 2, 0)
    finally:
        await replicas.close()
        for server, _, _ in servers:
            await server.stop(0)
        await manager.close()


def subset_policy(blue_5xx_errors: int) -> str:
    """mesh/istio's policy with an outlierDetection of blue's own, which
    ejects after `blue_5xx_errors` and panics below half of blue healthy."""
    docs = list(yaml.safe_load_all((ROOT / "mesh" / "istio" / "model-server-traffic.yaml").read_text()))
    rule = next(d for d in docs if d["kind"] == "DestinationRule")
    blue = next(s for s in rule["spec"]["subsets"] if s["name"] == "blue")
    blue["trafficPolicy"] = {
        "outlierDetection": {"consecutive5xxErrors": blue_5xx_errors, "maxEjectionPercent": 100, "minHealthPercent": 50}
    }
    return yaml.safe_dump_all(docs)


@pytest.mark.service
async def test_a_subsets_own_outlier_detection_and_its_panic_threshold_apply_to_that_subset_alone(repo, tmp_path):
    """Blue's own outlierDetection ejects on the first failure and panics below
    half its replicas healthy, when batches go to every blue replica again;
    green keeps the rule's. A change to blue's alone starts blue afresh only."""
    policy_file = tmp_path / "traffic.yaml"
    policy_file.write_text(subset_policy(1))
    policy = traffic.PolicyFiles([policy_file], "model-server")
    manager = ModelManager(ManagerConfig(str(repo), "cpu", 1, probe_interval_s=0))
    await manager.start()
    servers = [
        await build_server(ModelServerConfig(model_repository=str(repo), labels=labels), manager, port=0)
        for labels in ("version=blue", "version=blue", "version=green")
    ]
    addresses = tuple(f"127.0.0.1:{port}" for _, port, _ in servers)
    replicas = ReplicaSet(ReplicaConfig(addresses, 1, 60.0, 1 << 24), policy)
    try:
        await replicas.start()
        blue, green = replicas.routing._detectors["blue"], replicas.routing._detectors["green"]
        assert blue.policy.consecutive_5xx == 1 and green.policy.consecutive_5xx == 3
        now = asyncio.get_running_loop().time()
        assert blue.record(addresses[0], "INTERNAL", now)  # one failure is enough in blue
        assert replicas.slots("mlp")[0] == 1  # half of blue is healthy: not below 50%, no panic
        assert blue.record(addresses[1], "INTERNAL", now)
        assert blue.ejected() == sorted(addresses[:2])
        assert replicas.slots("mlp")[0] == 2  # none healthy: panic, both blue replicas take batches
        assert (await replicas.execute("mlp", "", mlp_batch(), [], 30.0))[0] == "1"
        policy_file.write_text(subset_policy(12))
        await replicas.poll_once()
        assert replicas.routing._detectors["blue"] is not blue and replicas.routing._detectors["green"] is green
        assert replicas.routing._detectors["blue"].ejected() == []
    finally:
        await replicas.close()
        for server, _, _ in servers:
            await server.stop(0)
        await manager.close()


@pytest.mark.service
async def test_a_replica_is_sent_as_many_batches_as_its_instances_can_start(repo):
    """Three instances, one for VIP only: the model server says so in ListModels,
    and the batcher sends two standard batches at once (not its configured one),
    keeping the third in its queue, while a VIP batch still goes."""
    _config(repo / "mlp", instances={"count": 3, "reserved_for_vip": 1, "lend_reserved_after_s": None})
    manager = ModelManager(ManagerConfig(str(repo), "cpu", 1, probe_interval_s=0))
    await manager.start()
    server, port, _ = await build_server(ModelServerConfig(model_repository=str(repo)), manager, port=0)
    replicas = ReplicaSet(ReplicaConfig((f"127.0.0.1:{port}",), 1, 60.0, 1 << 24))
    batcher = Batcher(replicas, BatchingConfig(max_batch_size=1, max_queue_delay_ms=0))
    try:
        await replicas.start()
        (replica,) = replicas._replicas
        info = replica.models["mlp"]
        assert (info.instances, info.reserved_instances, info.lending) == (3, 1, False)
        assert replicas.slots("mlp") == (2, 2, 2)
        gate = manager.resolve("mlp", "").gate
        async with contextlib.AsyncExitStack() as held:
            for _ in range(3):  # every instance busy: what is sent waits at the model server
                await held.enter_async_context(gate.turn(1))
            one_row = [from_numpy("INPUT0", np.ones((1, 64), dtype=np.float32), "FP32")]
            standard = [asyncio.ensure_future(batcher.submit("mlp", "", one_row, [])) for _ in range(3)]
            await until(lambda: gate.waiting == 2, "two batches waiting", timeout_s=10)
            assert replica.running[("mlp", Tier.STANDARD)] == 2 and batcher.queue_length() == 1
            vip = asyncio.ensure_future(batcher.submit("mlp", "", one_row, [], tier=Tier.VIP))
            await until(lambda: gate.waiting == 3, "three batches waiting", timeout_s=10)
            assert replica.running[("mlp", Tier.VIP)] == 1 and batcher.queue_length() == 1
        assert len(await asyncio.gather(*standard, vip)) == 4
    finally:
        await batcher.close()
        await replicas.close()
        await server.stop(0)
        await manager.close()


@pytest.mark.service
async def test_while_the_vip_instance_is_lent_out_standard_batches_may_use_it_until_vip_work_comes(repo):
    """Lent out (here at once): the standard slots count the VIP instance, until
    this batcher sends a VIP batch, which ends the loan at the model server; the
    next poll then says whether it is lent again."""
    _config(repo / "mlp", instances={"count": 2, "reserved_for_vip": 1, "lend_reserved_after_s": 0})
    manager = ModelManager(ManagerConfig(str(repo), "cpu", 1, probe_interval_s=0))
    await manager.start()
    server, port, _ = await build_server(ModelServerConfig(model_repository=str(repo)), manager, port=0)
    replicas = ReplicaSet(ReplicaConfig((f"127.0.0.1:{port}",), 1, 60.0, 1 << 24))
    try:
        await replicas.start()
        assert replicas._replicas[0].models["mlp"].lending
        assert replicas.slots("mlp") == (2, 1, 2)
        await replicas.execute("mlp", "", mlp_batch(), [], 30.0, tier=Tier.VIP)
        assert replicas.slots("mlp") == (1, 2, 1)
        await replicas.poll_once()
        assert replicas.slots("mlp") == (2, 1, 2)
        queued = ReplicaSet(ReplicaConfig((f"127.0.0.1:{port}",), 1, 60.0, 1 << 24, queued_per_replica=1))
        await queued.poll_once()  # --queued-batches-per-replica 1: one more standard batch waits there
        assert queued.slots("mlp") == (3, 1, 3)
        await queued.close()
    finally:
        await replicas.close()
        await server.stop(0)
        await manager.close()


def metric_value(name: str, **labels) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.service
@pytest.mark.parametrize("behind_mesh", [True, False], ids=["behind a mesh", "own replicas"])
async def test_a_failed_batch_marks_the_address_unready_only_when_the_batcher_balances_itself(repo, behind_mesh):
    async with mlp_server(repo) as port:
        replicas = ReplicaSet(
            ReplicaConfig((f"127.0.0.1:{port}",), 4, 60.0, 1 << 24, behind_mesh=behind_mesh)
        )  # no poll in the test
        await replicas.start()
        assert (await replicas.execute("mlp", "", mlp_batch(), [], 10.0))[0] == "1"
    with pytest.raises(errors.Unavailable):  # the address answers no more (behind a mesh: a 503 from the sidecar)
        await replicas.execute("mlp", "", mlp_batch(), [], 10.0)
    async with mlp_server(repo, port):  # another pod answers at the same address
        await asyncio.wait_for(replicas._replicas[0].channel.channel_ready(), 30)  # reconnected
        if behind_mesh:
            assert (await replicas.execute("mlp", "", mlp_batch(), [], 10.0))[0] == "1"
        else:  # its own replica stays out until the next poll says it is back
            with pytest.raises(errors.Unavailable, match="no ready model_server replica"):
                await replicas.execute("mlp", "", mlp_batch(), [], 10.0)
        await replicas.close()


@pytest.mark.service
async def test_a_models_own_unavailable_goes_once_elsewhere_else_reaches_the_caller_and_the_replica_serves_on(repo):
    """A model whose version drifted since the last poll is the model server's
    UNAVAILABLE for that model alone: the batch is tried once on another
    replica, or the caller gets the model server's message, and the replica
    keeps serving its other models."""
    shutil.copytree(repo / "mlp", repo / "twin")
    _config(repo / "twin", name="twin")
    managers = [ModelManager(ManagerConfig(str(repo), "cpu", 1, probe_interval_s=0)) for _ in range(2)]
    servers = []
    for manager in managers:
        await manager.start()
        servers.append(await build_server(ModelServerConfig(model_repository=str(repo)), manager, port=0))
    drifted, healthy = (f"127.0.0.1:{port}" for _, port, _ in servers)
    alone = ReplicaSet(ReplicaConfig((drifted,), 4, 60.0, 1 << 24))  # polled once, at start
    pair = ReplicaSet(ReplicaConfig((drifted, healthy), 4, 60.0, 1 << 24))
    try:
        await alone.start()
        await pair.start()
        assert [m.name for m in alone.models()] == ["mlp", "twin"]
        managers[0].versions.models["mlp"].drifted["1"] = "correctness probe failed"  # since the poll
        with pytest.raises(errors.Unavailable, match=r"model 'mlp' has no ready version: .*correctness probe failed"):
            await alone.execute("mlp", "", mlp_batch(), [], 10.0)
        assert alone._replicas[0].ready
        assert (await alone.execute("twin", "", mlp_batch(), [], 10.0))[0] == "1"
        with pytest.raises(grpc.aio.AioRpcError) as sent:  # marked as the model server's own status
            await alone._replicas[0].stub.Execute(model_server_pb2.ExecuteRequest(model="mlp"), timeout=10)
        assert errors.is_server_status(sent.value.trailing_metadata())
        retries = metric_value("infermesh_batcher_retries_total", code="UNAVAILABLE")
        assert (await pair.execute("mlp", "", mlp_batch(), [], 10.0))[0] == "1"  # the drifted one (first) failed it
        assert metric_value("infermesh_batcher_retries_total", code="UNAVAILABLE") == retries + 1
        assert all(r.ready for r in pair._replicas)
    finally:
        await alone.close()
        await pair.close()
        for server, _, _ in servers:
            await server.stop(0)
        for manager in managers:
            await manager.close()


@pytest.mark.unit
def test_a_status_our_server_sent_is_no_transport_failure_whatever_its_message_quotes():
    def unavailable(details: str, *trailers) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details=details
        )

    lost_shard = "model 'mlp' version 1 lost a tensor-parallel shard (RuntimeError: Connection reset by peer)"
    assert not _transport_failure(unavailable(lost_shard, (errors.ERROR_METADATA, "UNAVAILABLE")))
    assert _transport_failure(unavailable("recvmsg:Connection reset by peer"))
    assert not _transport_failure(unavailable("model 'mlp' has no ready version: {}"))


@pytest.mark.service
@pytest.mark.parametrize("behind_mesh", [True, False], ids=["behind a mesh", "own replicas"])
async def test_behind_a_mesh_the_catalog_outlives_a_missed_poll_but_not_a_run_of_them(repo, behind_mesh):
    async with mlp_server(repo) as port:
        replicas = ReplicaSet(
            ReplicaConfig((f"127.0.0.1:{port}",), 4, 60.0, 1 << 24, behind_mesh=behind_mesh)
        )  # polled by hand
        await replicas.poll_once()
        assert [m.name for m in replicas.models()] == ["mlp"]
    for missed in range(1, FAILED_POLLS + 1):
        await replicas.poll_once()
        standing = behind_mesh and missed < FAILED_POLLS
        assert [m.name for m in replicas.models()] == (["mlp"] if standing else []), missed
    assert not replicas._replicas[0].history  # a pod seen again starts a fresh catalog
    await replicas.close()


@pytest.mark.service
async def test_a_replica_too_busy_to_answer_its_poll_stays_in_service(repo, tmp_path):
    """A model server whose poll times out (here: stopped with SIGSTOP, as a
    starved process looks from outside) is not dead: it keeps its place and
    its batches until several polls in a row fail, so one slow moment under
    overload does not answer every request with "no ready replica"."""
    server = Process(
        "model_server",
        [
            sys.executable,
            "-m",
            "services.model_server",
            "--host",
            "127.0.0.1",
            "--metrics-port",
            "0",
            "--model-repository",
            str(repo),
        ],
        tmp_path,
        dict(os.environ),
    )
    try:
        address = server.wait_ready(60)["grpc"]
        replicas = ReplicaSet(ReplicaConfig((address,), 4, 1.0, 1 << 24))  # polled by hand; each poll waits 1 s
        await replicas.poll_once()
        server.popen.send_signal(signal.SIGSTOP)
        for missed in range(1, FAILED_POLLS):
            await replicas.poll_once()
            assert [m.name for m in replicas.models()] == ["mlp"], missed
        server.popen.send_signal(signal.SIGCONT)
        assert (await replicas.execute("mlp", "", mlp_batch(), [], 10.0))[0] == "1"  # it was busy, not gone
        await replicas.poll_once()  # answered: the count of missed polls starts again
        server.popen.send_signal(signal.SIGSTOP)
        for _ in range(FAILED_POLLS - 1):
            await replicas.poll_once()
        assert [m.name for m in replicas.models()] == ["mlp"]
        await replicas.poll_once()
        assert replicas.models() == []  # a run of missed polls takes it out
        server.popen.send_signal(signal.SIGCONT)
        for _ in range(50):  # the channel reconnects with back-off
            await replicas.poll_once()
            if replicas.models():
                break
            await asyncio.sleep(0.2)
        assert [m.name for m in replicas.models()] == ["mlp"]
        await replicas.close()
    finally:
        server.popen.send_signal(signal.SIGCONT)
        server.stop(10)


@pytest.mark.unit
def test_behind_a_mesh_the_catalog_is_what_recent_polls_saw():
    def poll(*versions: str) -> dict:
        info = tensor_pb2.ModelInfo(name="minilm", versions=list(versions), ready_versions=list(versions))
        return {"minilm": info}

    history = collections.deque(maxlen=MESH_HISTORY_POLLS)
    history.extend([poll("1"), poll("2")])  # two polls reached a blue and a green pod
    assert list(_merge_polls(history)["minilm"].ready_versions) == ["2", "1"]
    history.extend([poll("2")] * (MESH_HISTORY_POLLS - 1))  # version 1 was unloaded everywhere
    assert list(_merge_polls(history)["minilm"].ready_versions) == ["2"]
    history.extend([{}] * MESH_HISTORY_POLLS)
    assert _merge_polls(history) == {}


@pytest.mark.unit
def test_behind_a_mesh_the_batcher_applies_no_traffic_policy_of_its_own():
    from services.batcher.config import BatcherConfig

    with pytest.raises(ValueError, match="model_servers_behind_mesh and traffic_policy exclude each other"):
        BatcherConfig(
            model_servers=("model-server:8011",),
            model_servers_behind_mesh=True,
            traffic_policy="mesh/istio/model-server-traffic.yaml",
        )


@pytest.mark.service
async def test_behind_a_mesh_vip_batches_have_room_of_their_own(repo):
    """Behind one Service address the mesh may send VIP batches to a pool of
    their own: a standard surge filling its bound must not leave VIP work one
    batch in flight (it had every + 1 - standard: one)."""
    async with mlp_server(repo) as port:
        replicas = ReplicaSet(ReplicaConfig((f"127.0.0.1:{port}",), 2, 60.0, 1 << 24, behind_mesh=True))
        await replicas.start()
        await replicas.poll_once()
        (replica,) = replicas._replicas
        replica.running[("mlp", Tier.STANDARD)] = 2  # the standard bound is full
        assert replicas.slots("mlp") == (2, 2, 0)  # standard's two; VIP's own two, none shared
        assert not replicas.routing._has_room(replica, "mlp", Tier.STANDARD)
        assert replicas.routing._has_room(replica, "mlp", Tier.VIP)
        replica.running[("mlp", Tier.VIP)] = 2
        assert not replicas.routing._has_room(replica, "mlp", Tier.VIP)
        replica.running.clear()
        await replicas.close()


class RecordingServicer(ModelServerServicer):
    """The model server's own servicer, noting how each batch's tier arrived."""

    def __init__(self, manager: ModelManager):
        super().__init__(manager)
        self.seen: list[tuple[int, str | None]] = []

    async def Execute(self, request, context):
        self.seen.append((request.tier, dict(context.invocation_metadata()).get("x-user-tier")))
        return await super().Execute(request, context)


@pytest.mark.service
@pytest.mark.parametrize("behind_mesh", [False, True])
async def test_a_batch_carries_its_tier_once_and_as_a_header_only_for_a_mesh_to_route_on(repo, behind_mesh):
    """ExecuteRequest.tier is what the model server reads; x-user-tier goes
    along only behind a mesh, whose sidecar routes on headers."""
    manager = ModelManager(ManagerConfig(str(repo), "cpu", 1, probe_interval_s=0))
    await manager.start()
    server = grpc.aio.server()
    servicer = RecordingServicer(manager)
    model_server_pb2_grpc.add_ModelServerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    replicas = ReplicaSet(ReplicaConfig((f"127.0.0.1:{port}",), 4, 60.0, 1 << 24, behind_mesh=behind_mesh))
    try:
        await replicas.start()
        await replicas.execute("mlp", "", mlp_batch(), [], 30.0, tier=Tier.VIP)
        await replicas.execute("mlp", "", mlp_batch(), [], 30.0, tier=Tier.STANDARD)
    finally:
        await replicas.close()
        await server.stop(0)
        await manager.close()
    headers = ("vip", "standard") if behind_mesh else (None, None)
    assert servicer.seen == [(Tier.VIP, headers[0]), (Tier.STANDARD, headers[1])]
