"""Exactly one answer per accepted request when a server drains or a stream
breaks: a draining stream answers what it read and ends UNAVAILABLE, never OK
with a request unanswered; the router sends a request whose stream was lost
once more, to whichever batcher its channel reaches."""

import asyncio
import concurrent.futures
import os
import signal
import threading
import time

import grpc
import pytest
from inference import grpc_predict_v2_pb2_grpc as pb_grpc
from infermesh.batcher.v1 import batcher_pb2, batcher_pb2_grpc

from services.batcher.server import FRAMING
from services.common import errors
from services.common.streams import StreamLost, answer_concurrently
from services.launcher.mesh import Mesh, MeshConfig
from services.launcher.supervisor import RestartPolicy
from services.router.clients import BatcherClient
from services.router.config import RouterConfig
from services.router.core import Catalog
from tests.conftest import settle, until, wait_until
from tests.oip import text_request


async def answers_of(stream) -> tuple[list, Exception | None]:
    got, ended = [], None
    try:
        async for answer in stream:
            got.append(answer)
    except errors.InfermeshError as exc:
        ended = exc
    return got, ended


@pytest.mark.unit
async def test_a_request_in_hand_when_the_drain_begins_is_answered_and_the_stream_ends_unavailable():
    """One slot: the second request is read and waits for the slot the first
    holds when the drain begins. It is answered all the same, nothing after it
    is read, and the stream ends UNAVAILABLE, since its caller may have sent more."""
    gate, draining, read = asyncio.Event(), asyncio.Event(), []

    async def requests():
        for i in range(1, 100):
            read.append(i)
            yield i

    async def handle(request):
        await gate.wait()
        return request

    stream = answers_of(answer_concurrently(requests(), handle, lambda r, e: None, 1, draining))
    task = asyncio.create_task(stream)
    await until(lambda: len(read) == 2, "the second request read and held for a slot")
    draining.set()
    await settle()
    gate.set()
    answered, ended = await task
    assert answered == [1, 2]
    assert isinstance(ended, errors.Unavailable) and "draining" in str(ended)
    assert read == [1, 2]  # nothing more was read once the drain began


@pytest.mark.unit
async def test_a_drained_stream_whose_caller_had_closed_it_ends_ok():
    draining = asyncio.Event()

    async def requests():
        yield 1
        draining.set()

    async def handle(request):
        await asyncio.sleep(0)
        return request

    answered, ended = await answers_of(answer_concurrently(requests(), handle, lambda r, e: None, 4, draining))
    assert answered == [1] and ended is None


class Batcher(batcher_pb2_grpc.BatcherServicer):
    """SubmitMany answering each request with its id; the next `lose` streams
    break (the call aborted) once they hold a request."""

    def __init__(self, name: str):
        self.name = name
        self.lose = 0
        self.answered = 0

    async def SubmitMany(self, request_iterator, context):
        lose = self.lose > 0
        self.lose -= lose
        async for frame in request_iterator:
            for request in frame.requests:
                if request.cancel:
                    continue
                if lose:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the batcher went away")
                self.answered += 1
                yield batcher_pb2.SubmitManyResponse(
                    responses=[batcher_pb2.SubmitResponse(id=request.id, version=self.name)]
                )

    async def ListModels(self, request, context):
        return batcher_pb2.ListModelsResponse()


async def serve(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    batcher_pb2_grpc.add_BatcherServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.service
async def test_a_request_whose_stream_broke_is_sent_once_more_and_answered():
    servicer = Batcher("one")
    server, address = await serve(servicer)
    client = BatcherClient(address, 1, Catalog(), 60.0)
    try:
        servicer.lose = 1
        version, _ = await client.submit("m", "", [], [], 1, timeout_s=10)
        assert version == "one" and servicer.answered == 1
    finally:
        await client.close()
        await server.stop(0)


@pytest.mark.service
async def test_a_request_lost_twice_is_answered_unavailable_with_both_reasons():
    servicer = Batcher("one")
    server, address = await serve(servicer)
    client = BatcherClient(address, 1, Catalog(), 60.0)
    servicer.lose = 2
    try:
        with pytest.raises(errors.Unavailable, match="sent again") as info:
            await client.submit("m", "", [], [], 1, timeout_s=10)
        assert not isinstance(info.value, StreamLost) and str(info.value).count("the batcher went away") == 2
    finally:
        await client.close()
        await server.stop(0)


class Draining(batcher_pb2_grpc.BatcherServicer):
    """SubmitMany as the batcher answers it (answer_concurrently, its framing,
    a drain event); a request waits while `gate` is closed; `read` counts requests read."""

    def __init__(self, name: str):
        self.name = name
        self.gate = asyncio.Event()
        self.gate.set()
        self.draining = asyncio.Event()
        self.read = 0
        self.answered = 0

    async def SubmitMany(self, request_iterator, context):
        async def handle(request):
            if request.cancel:
                return None
            self.read += 1
            await self.gate.wait()
            self.answered += 1
            return batcher_pb2.SubmitResponse(id=request.id, version=self.name)

        try:
            async for answer in answer_concurrently(
                request_iterator, handle, lambda r, e: None, 64, self.draining, FRAMING
            ):
                yield answer
        except errors.InfermeshError as exc:  # as the services' error interceptor maps it
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def ListModels(self, request, context):
        return batcher_pb2.ListModelsResponse()


@pytest.mark.service
async def test_a_batcher_that_drains_hands_its_unread_requests_to_the_one_that_stays():
    """Two batchers behind one address list (round robin): one drains while
    requests are in flight on its stream; what it read it answers, what it did
    not read goes to the other; every request is answered once, none fails."""
    batchers = {"first": Draining("first"), "second": Draining("second")}
    servers = {name: await serve(b) for name, b in batchers.items()}
    client = BatcherClient(",".join(address for _, address in servers.values()), 1, Catalog(), 60.0)
    try:
        name, _ = await client.submit("m", "", [], [], 1, timeout_s=20)  # opens the stream, to one of them
        leaving, staying = batchers[name], batchers["second" if name == "first" else "first"]
        leaving.gate.clear()
        held = [asyncio.create_task(client.submit("m", "", [], [], 1, timeout_s=20)) for _ in range(5)]
        await until(lambda: leaving.read == 6, "five requests in flight on the leaving batcher")
        leaving.draining.set()
        stopping = asyncio.create_task(servers[name][0].stop(10))  # GOAWAY: no new stream reaches it
        # One read while the drain is under way (in hand: answered there), the rest sent after it: never read.
        later = [asyncio.create_task(client.submit("m", "", [], [], 1, timeout_s=20))]
        await until(lambda: leaving.read == 7, "a request read after the drain began")
        later += [asyncio.create_task(client.submit("m", "", [], [], 1, timeout_s=20)) for _ in range(4)]
        await settle()
        leaving.gate.set()
        answers = [version for version, _ in await asyncio.gather(*held, *later)]
        assert answers[:6] == [leaving.name] * 6  # what it read, it answered
        assert answers[6:] == [staying.name] * 4  # what it did not read went to the other
        assert leaving.answered + staying.answered == 11 == leaving.read + staying.read  # each once
        await stopping
    finally:
        await client.close()
        for server, _ in servers.values():
            await server.stop(0)


@pytest.mark.unit
def test_a_list_of_batchers_takes_only_ipv4_entries():
    assert RouterConfig(batcher="127.0.0.1:1,127.0.0.1:2").batcher == "127.0.0.1:1,127.0.0.1:2"
    with pytest.raises(ValueError, match=r"'batcher\.local:1'"):
        RouterConfig(batcher="batcher.local:1,127.0.0.1:2")


def load_while(mesh, fault, callers: int = 4, after_s: float = 1.5) -> dict[str, int]:
    """Unary requests of distinct texts from `callers` threads until `after_s`
    after `fault()` returns; the count of each outcome (OK or a status name)."""
    outcomes: dict[str, int] = {}
    lock, stop = threading.Lock(), threading.Event()

    def caller(index: int):
        with grpc.insecure_channel(mesh.router) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    stub.ModelInfer(text_request([f"caller {index} request {n}"]), timeout=20)
                    outcome = "OK"
                except grpc.RpcError as exc:
                    outcome = f"{exc.code().name}: {exc.details()}"
                with lock:
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1

    with concurrent.futures.ThreadPoolExecutor(callers) as pool:
        futures = [pool.submit(caller, i) for i in range(callers)]
        time.sleep(1.0)
        fault()
        time.sleep(after_s)
        stop.set()
        for future in futures:
            future.result()
    return outcomes


@pytest.mark.e2e
def test_with_two_batchers_one_drained_under_load_costs_no_request(model_repository, tmp_path):
    with Mesh(MeshConfig(models=model_repository, cache=False, log_dir=tmp_path, batchers=2)) as mesh:
        leaving = mesh.processes["batcher"].popen

        def drain():
            leaving.send_signal(signal.SIGTERM)
            leaving.wait(30)

        outcomes = load_while(mesh, drain)
    assert set(outcomes) == {"OK"} and outcomes["OK"] > 10, outcomes


@pytest.mark.e2e
def test_a_supervised_batcher_killed_under_load_costs_no_request(model_repository, tmp_path):
    with Mesh(
        MeshConfig(
            models=model_repository,
            cache=False,
            log_dir=tmp_path,
            supervise=True,
            restart_policy=RestartPolicy(base_delay_s=0.2, probe_period_s=0.5),
        )
    ) as mesh:

        def kill():
            os.kill(mesh.processes["batcher"].popen.pid, signal.SIGKILL)
            wait_until(
                lambda: mesh.status()["batcher"]["restarts"] == 1 and mesh.status()["batcher"]["ready"],
                "the batcher restarted",
            )

        outcomes = load_while(mesh, kill)
    assert set(outcomes) == {"OK"} and outcomes["OK"] > 10, outcomes
