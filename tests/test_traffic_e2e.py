"""The batcher applies mesh/istio's VirtualService and DestinationRule to its
hop: batches split between a blue and a green model server by weight, and an
edit of the file moves traffic without a restart."""

import asyncio
import pathlib
import re
import subprocess
import sys
import uuid

import grpc
import pytest
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.launcher.mesh import Mesh, MeshConfig
from tests.conftest import metric, until
from tests.oip import text_request

pytestmark = pytest.mark.e2e

POLICY = pathlib.Path(__file__).resolve().parent.parent / "mesh" / "istio" / "model-server-traffic.yaml"


def set_weights(path: pathlib.Path, blue: int, green: int) -> None:
    weights = iter((blue, green))
    text = re.sub(r"weight: \d+", lambda _: f"weight: {next(weights)}", POLICY.read_text())
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # atomically, as an editor or meshctl would


@pytest.fixture
def blue_green(model_repository, tmp_path):
    policy = tmp_path / "traffic.yaml"
    set_weights(policy, 75, 25)
    with Mesh(
        MeshConfig(
            models=model_repository,
            cache=False,
            log_dir=tmp_path,
            model_servers=2,
            model_server_labels=("version=blue,pool=vip", "version=green"),
            batcher_args=("--replica-poll-s", "0.2", "--max-batch-size", "1", "--traffic-policy", str(policy)),
        )
    ) as mesh:
        yield mesh, policy


def policy_log(mesh, what: str) -> int:
    """How often the batcher's log says `what` about its traffic policy."""
    return (mesh.log_dir / "batcher.log").read_text().count(what)


RELOADED, REFUSED = "traffic policy for model-server:", "traffic policy not reloaded"


def batches(mesh, name: str) -> float:
    return metric(mesh.metrics_url(name), "infermesh_model_batches_total", model="minilm", outcome="ok")


async def send(mesh, count: int) -> None:
    async with grpc.aio.insecure_channel(mesh.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for start in range(0, count, 16):
            await asyncio.gather(
                *(
                    stub.ModelInfer(text_request([f"{uuid.uuid4().hex} weigh me"]), timeout=60)
                    for _ in range(min(16, count - start))
                )
            )


async def test_batches_split_by_weight_and_follow_an_edited_file(blue_green):
    mesh, policy = blue_green
    before = {name: batches(mesh, name) for name in ("model_server-0", "model_server-1")}
    await send(mesh, 400)
    blue = batches(mesh, "model_server-0") - before["model_server-0"]
    green = batches(mesh, "model_server-1") - before["model_server-1"]
    assert blue + green >= 400
    assert 0.65 <= blue / (blue + green) <= 0.85  # 75% expected; 400 picks put 0.65..0.85 beyond doubt

    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.meshctl",
            "--file",
            str(policy),
            "status",
            "model-server",
            "--metrics",
            mesh.metrics_url("batcher"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {line.split()[0]: line.split() for line in status.stdout.splitlines()[1:]}
    assert rows["blue"][1:3] == ["75", "1"] and rows["green"][1:3] == ["25", "1"]  # weight, ready replicas
    assert int(rows["blue"][3]) == blue and rows["blue"][4] == "100.00%" and rows["blue"][5].startswith("<=")

    # The operator's tool moves the traffic; the running batcher follows the file.
    reloads = policy_log(mesh, RELOADED)
    subprocess.run(
        [sys.executable, "-m", "services.meshctl", "--file", str(policy), "promote", "model-server", "green"],
        check=True,
        capture_output=True,
    )
    # It reads changed files on its next replica poll (0.2 s), and logs the policy it applies.
    await until(lambda: policy_log(mesh, RELOADED) > reloads, "the batcher applying the promoted policy")
    blue_before = batches(mesh, "model_server-0")
    await send(mesh, 100)
    assert batches(mesh, "model_server-0") == blue_before  # every batch went to green

    policy.write_text("this: [is not, a policy")  # a broken edit: the last good policy stays
    await until(lambda: policy_log(mesh, REFUSED) > 0, "the batcher refusing the broken edit")
    await send(mesh, 50)
    assert batches(mesh, "model_server-0") == blue_before
    assert not mesh.dead()


async def test_vip_batches_run_on_the_vip_pool_and_standard_ones_never_do(model_repository, tmp_path):
    policy = tmp_path / "traffic.yaml"
    set_weights(policy, 100, 0)
    with Mesh(
        MeshConfig(
            models=model_repository,
            cache=False,
            log_dir=tmp_path,
            model_servers=2,
            model_server_labels=("version=blue", "pool=vip"),
            batcher_args=("--replica-poll-s", "0.2", "--traffic-policy", str(policy)),
        )
    ) as mesh:
        async with grpc.aio.insecure_channel(mesh.router) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for tier, count in (("vip", 40), ("standard", 60)):
                before = {name: batches(mesh, name) for name in ("model_server-0", "model_server-1")}
                await asyncio.gather(
                    *(
                        stub.ModelInfer(
                            text_request([f"{uuid.uuid4().hex} {tier}"]),
                            timeout=60,
                            metadata=mesh.credentials(f"dev-{tier}"),
                        )
                        for _ in range(count)
                    )
                )
                ran = {name: batches(mesh, name) - before[name] for name in before}
                pool, other = (
                    ("model_server-1", "model_server-0") if tier == "vip" else ("model_server-0", "model_server-1")
                )
                assert ran[pool] >= 1 and ran[other] == 0, (tier, ran)
