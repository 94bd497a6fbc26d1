"""Router scale-out: several router processes share the public port
(SO_REUSEPORT), the kernel spreads callers' connections among them, and one
of them leaving does not take the port with it."""

import subprocess
import sys

import grpc
import numpy as np
import pytest
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.launcher.mesh import Mesh, MeshConfig
from services.launcher.ports import free_ports
from tests.conftest import ROOT, metric
from tests.oip import output_array, tensor_request

pytestmark = pytest.mark.e2e


def served(mesh: Mesh, name: str) -> float:
    return metric(mesh.metrics_url(name), "infermesh_router_requests_total", code="OK")


def ask_on_new_connections(address: str, count: int) -> None:
    """One request on each of `count` fresh connections (a new source port each)."""
    for i in range(count):
        with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                tensor_request(np.full((1, 64), i, dtype=np.float32)), timeout=30
            )
            assert output_array(response, "OUTPUT0").shape == (1, 64)


def test_two_routers_share_one_port_and_both_serve(model_repository, tmp_path):
    (port,) = free_ports(1)
    with Mesh(MeshConfig(models=model_repository, log_dir=tmp_path, cache=False, router_port=port, routers=2)) as mesh:
        assert mesh.router == f"127.0.0.1:{port}"
        assert mesh.address("router-2") == f"127.0.0.1:{port}"
        ask_on_new_connections(mesh.router, 24)
        first, second = served(mesh, "router"), served(mesh, "router-2")
        assert first + second == 24 and first > 0 and second > 0, (first, second)

        # One router drains and goes: the port stays served by the other.
        mesh.stop_service("router-2")
        ask_on_new_connections(mesh.router, 8)
        assert served(mesh, "router") == first + 8


def test_a_router_without_reuse_port_cannot_take_a_port_in_use(model_repository, tmp_path):
    """Sharing is asked for, never fallen into: a second router started on a
    router's port without --reuse-port fails instead of splitting its callers."""
    with Mesh(MeshConfig(models=model_repository, log_dir=tmp_path, cache=False)) as mesh:
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.router",
                "--batcher",
                mesh.address("batcher"),
                "--port",
                mesh.router.rsplit(":", 1)[1],
                "--metrics-port",
                "0",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode != 0
        assert "Failed to bind" in second.stderr or "address already in use" in second.stderr.lower(), second.stderr[
            -2000:
        ]
