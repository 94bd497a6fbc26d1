"""When the model server is gone: UNAVAILABLE (retryable), readiness withdrawn,
the router and batcher stay up."""

import signal
import time

import grpc
import pytest
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.launcher.mesh import Mesh
from tests.oip import output_array, text_request


@pytest.fixture
def uncached_mesh(model_repository, tmp_path):
    with Mesh(models=model_repository, cache=False, log_dir=tmp_path,
              batcher_args=("--replica-poll-s", "0.2"), router_args=("--catalog-poll-s", "0.2")) as mesh:
        yield mesh


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
        with pytest.raises(grpc.RpcError) as again:
            stub.ModelInfer(text_request(["still down"]), timeout=10)
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE
    assert sorted(uncached_mesh.dead()) == ["model_server"]
