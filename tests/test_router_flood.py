"""A router flooded with back-to-back 16 MB pathological requests (millions of
empty BYTES elements, raw and typed; one 15 MB text; a million tiny inputs)
goes on answering its health checks throughout, and refuses each request with
INVALID_ARGUMENT naming the field, unary and on a stream."""

import asyncio

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.launcher.mesh import Mesh, MeshConfig
from tests.oip import output_array, tensor_request
from tools import pathological

pytestmark = pytest.mark.e2e

ROUNDS = 3  # back-to-back requests of each kind
SERVING = health_pb2.HealthCheckResponse.SERVING


class Pinger:
    """ServerLive and health Check, one after the other, until stopped; every
    answer is kept, so a failed or wrong one is seen."""

    def __init__(self, channel):
        self._live = pb_grpc.GRPCInferenceServiceStub(channel).ServerLive
        self._check = health_pb2_grpc.HealthStub(channel).Check
        self.answered = 0
        self.wrong: list[str] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                live = await self._live(pb.ServerLiveRequest())
                check = await self._check(health_pb2.HealthCheckRequest())
            except grpc.aio.AioRpcError as exc:
                self.wrong.append(f"{exc.code().name}: {exc.details()}")
                continue
            if not live.live or check.status != SERVING:
                self.wrong.append(f"live={live.live} status={check.status}")
            self.answered += 2

    def stop(self) -> None:
        self._stop.set()


async def test_health_checks_are_answered_while_pathological_requests_are_refused(model_repository, tmp_path):
    attacks = pathological.all_attacks()
    options = [("grpc.max_send_message_length", 64 << 20)]
    with Mesh(MeshConfig(models=model_repository, log_dir=tmp_path, cache=False)) as mesh:
        async with (
            grpc.aio.insecure_channel(mesh.router, options=options) as flood,
            grpc.aio.insecure_channel(mesh.router) as probes,
        ):
            infer = flood.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer",
                request_serializer=None,
                response_deserializer=pb.ModelInferResponse.FromString,
            )
            stream = flood.stream_stream(
                "/inference.GRPCInferenceService/ModelStreamInfer",
                request_serializer=None,
                response_deserializer=pb.ModelStreamInferResponse.FromString,
            )
            pinger = Pinger(probes)
            pinging = asyncio.create_task(pinger.run())
            answered_during = {}
            for attack in attacks:
                before = pinger.answered
                for _ in range(ROUNDS):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await infer(attack.raw)
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (attack.kind, info.value)
                    assert attack.names in info.value.details(), (attack.kind, info.value.details())
                answers = [answer async for answer in stream(iter([attack.raw] * ROUNDS))]
                assert len(answers) == ROUNDS
                for answer in answers:
                    assert answer.error_message.startswith("INVALID_ARGUMENT"), (attack.kind, answer.error_message)
                    assert attack.names in answer.error_message, (attack.kind, answer.error_message)
                    assert answer.infer_response.id == attack.kind.replace("_", "-")
                answered_during[attack.kind] = pinger.answered - before
            pinger.stop()
            await pinging
            assert not pinger.wrong, pinger.wrong[:5]
            # Pings went on through each flood, not only between them.
            assert all(count > 0 for count in answered_during.values()), answered_during
            # And the router still serves.
            ok = await pb_grpc.GRPCInferenceServiceStub(probes).ModelInfer(tensor_request(np.ones((1, 64), "f4")))
            assert output_array(ok, "OUTPUT0").shape == (1, 64)
        assert not mesh.dead()
