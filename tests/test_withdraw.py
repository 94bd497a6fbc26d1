"""A pod's preStop hook withdraws a service before SIGTERM: health turns
NOT_SERVING for good (readiness fails, the pod leaves its endpoints) while the
server still answers, and only SIGTERM (or the server's end) starts the drain."""

import asyncio
import gc
import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import serving

pytestmark = pytest.mark.service


async def _status(stub, service=""):
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


async def test_a_withdrawn_service_is_not_serving_yet_answers_until_it_is_stopped():
    server = grpc.aio.server()
    health = serving.add_health_and_reflection(server, ["infermesh.test.v1.Test"])
    await serving.set_serving(health, ["infermesh.test.v1.Test"], True)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    running = asyncio.ensure_future(serving.run_until_signal(server, health, 0.0))
    try:
        for _ in range(100):  # run_until_signal installs its handlers before its first wait
            if signal.getsignal(serving.WITHDRAW_SIGNAL) not in (signal.SIG_DFL, signal.SIG_IGN, None):
                break
            await asyncio.sleep(0)
        else:
            pytest.fail(
                f"run_until_signal handles no {serving.WITHDRAW_SIGNAL!r}: a preStop hook's signal "
                "would kill the service instead of withdrawing it"
            )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            assert await _status(stub) == health_pb2.HealthCheckResponse.SERVING
            os.kill(os.getpid(), serving.WITHDRAW_SIGNAL)
            for _ in range(500):
                if await _status(stub) == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.01)
            # Every name the probes may ask turned, and the server answered each question.
            assert await _status(stub) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await _status(stub, "infermesh.test.v1.Test") == health_pb2.HealthCheckResponse.NOT_SERVING
            assert not running.done()
            # A status set later (a model server's correctness probe) does not bring it back.
            await serving.set_serving(health, ["infermesh.test.v1.Test"], True)
            assert await _status(stub) == health_pb2.HealthCheckResponse.NOT_SERVING
        await server.stop(None)
        await asyncio.wait_for(running, 10)
        assert signal.getsignal(serving.WITHDRAW_SIGNAL) == signal.SIG_DFL
    finally:
        running.cancel()
        await server.stop(None)
        gc.unfreeze()  # run_until_signal froze the test process's heap
