"""tools.delay_proxy as a real process between a real gRPC client and server:
bytes arrive intact, a delay adds at least itself, a stall holds calls on open
connections until it ends, clear restores, and a peer that stops reading
pushes back instead of filling the proxy."""

import asyncio
import contextlib
import os
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tools.delay_proxy import DelayProxy, DelayProxyError

pytestmark = pytest.mark.service

ECHO = "/test.Echo/Echo"


@contextlib.asynccontextmanager
async def echo_server():
    """A grpc.aio server with the health service and an echo of raw bytes."""
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20)]
    )

    async def echo(request: bytes, context) -> bytes:
        return request

    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})]
    )
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@contextlib.contextmanager
def proxy_in_front_of(upstream: str, tmp_path, **kwargs):
    proxy = DelayProxy(log_path=tmp_path / "proxy.log", seed=1, **kwargs)
    try:
        yield proxy, proxy.start(upstream)
    finally:
        proxy.stop()


def channel(address: str) -> grpc.aio.Channel:
    # A pool of its own: channels to one target would otherwise share one connection.
    return grpc.aio.insecure_channel(
        address,
        options=[
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.max_receive_message_length", 16 << 20),
            ("grpc.max_send_message_length", 16 << 20),
        ],
    )


async def timed(call) -> float:
    started = time.monotonic()
    await call
    return time.monotonic() - started


async def test_bytes_arrive_intact_over_many_connections(tmp_path):
    async with echo_server() as upstream:
        with proxy_in_front_of(upstream, tmp_path) as (proxy, address):
            channels = [channel(address) for _ in range(4)]
            try:
                echoes = [c.unary_unary(ECHO) for c in channels]
                payloads = [os.urandom(size) for size in (1, 1000, 70_000, 1 << 20, 5 << 20) for _ in range(4)]
                answers = await asyncio.gather(*(echoes[i % 4](p, timeout=60) for i, p in enumerate(payloads)))
                assert answers == payloads
                checked = await health_pb2_grpc.HealthStub(channels[0]).Check(
                    health_pb2.HealthCheckRequest(), timeout=30
                )
                assert checked.status == health_pb2.HealthCheckResponse.SERVING
            finally:
                for c in channels:
                    await c.close()
            stats = proxy.stats()
            assert stats["accepted"] == 4 and stats["upstream_failures"] == 0
            total = sum(len(p) for p in payloads)
            assert stats["bytes_to_upstream"] > total and stats["bytes_to_client"] > total
            assert stats["chunks_delayed"] == 0


async def test_a_delay_adds_at_least_itself_each_way_and_clear_restores(tmp_path):
    async with echo_server() as upstream:
        with proxy_in_front_of(upstream, tmp_path) as (proxy, address):
            async with channel(address) as open_channel:
                echo = open_channel.unary_unary(ECHO)
                await echo(b"connect", timeout=30)  # the connection and its HTTP/2 setup before the delay
                proxy.delay(100, 20)
                # A call's request and its answer each wait at least delay - jitter.
                for _ in range(5):
                    assert await timed(echo(os.urandom(100), timeout=30)) >= 2 * 0.080
                assert proxy.stats()["chunks_delayed"] >= 10
                cleared = proxy.clear()
                assert (cleared["delay_ms"], cleared["jitter_ms"], cleared["stall_left_s"]) == (0, 0, 0)
                for size in (200_000, 10, 10, 10, 10, 10):
                    payload = os.urandom(size)
                    assert await echo(payload, timeout=30) == payload
                after = proxy.stats()
                # Once cleared nothing waits: at most the frames (acks, window updates)
                # still held when the clear came out late.
                assert after["chunks"] - cleared["chunks"] >= 12
                assert after["chunks_delayed"] - cleared["chunks_delayed"] <= 2
                assert after["accepted"] == 1  # one connection throughout


async def test_a_stall_holds_calls_on_open_connections_until_it_ends(tmp_path):
    async with echo_server() as upstream:
        with proxy_in_front_of(upstream, tmp_path) as (proxy, address):
            async with channel(address) as open_channel:
                echo = open_channel.unary_unary(ECHO)
                await echo(b"connect", timeout=30)
                before = time.monotonic()
                answer = proxy.stall(1.5)
                assert answer["stall_left_s"] > 0
                held = asyncio.ensure_future(echo(b"held", timeout=30))
                # A call whose deadline falls inside the stall cannot be answered.
                with pytest.raises(grpc.aio.AioRpcError) as short:
                    await echo(b"short", timeout=0.3)
                assert short.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert not held.done()
                assert await held == b"held"
                assert time.monotonic() - before >= 1.5
                assert await echo(b"after", timeout=30) == b"after"
                stats = proxy.stats()
                assert stats["accepted"] == 1 and stats["open"] == 1  # the stall closed no connection
                assert stats["stall_left_s"] == 0


async def test_clear_ends_a_stall_at_once(tmp_path):
    async with echo_server() as upstream:
        with proxy_in_front_of(upstream, tmp_path) as (proxy, address):
            async with channel(address) as open_channel:
                echo = open_channel.unary_unary(ECHO)
                await echo(b"connect", timeout=30)
                proxy.stall(600)
                held = asyncio.ensure_future(echo(b"held", timeout=60))
                await asyncio.sleep(0.2)
                assert not held.done()
                proxy.clear()
                assert await held == b"held"  # long before the stall's 600 s


async def test_a_reader_that_stops_pushes_back_through_the_proxy(tmp_path):
    """Upstream accepts and never reads: the proxy holds its bounded buffer and
    then stops reading, so the sender's writes stop being taken."""
    accepted = asyncio.Event()
    held_open: list[asyncio.StreamWriter] = []

    async def never_reads(reader, writer):
        held_open.append(writer)
        accepted.set()

    server = await asyncio.start_server(never_reads, "127.0.0.1", 0)
    upstream = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        with proxy_in_front_of(upstream, tmp_path, buffer_bytes=256 * 1024) as (_proxy, address):
            host, port = address.rsplit(":", 1)
            sender = socket.create_connection((host, int(port)))
            sender.setblocking(False)
            await asyncio.wait_for(accepted.wait(), 30)
            taken, block, idle_since = 0, os.urandom(1 << 16), time.monotonic()
            # Write until nothing more is taken for 1 s, or 256 MB went in (no backpressure).
            while taken < 256 << 20 and time.monotonic() - idle_since < 1.0:
                try:
                    taken += sender.send(block)
                    idle_since = time.monotonic()
                except BlockingIOError:
                    await asyncio.sleep(0.01)
            sender.close()
            # Loopback socket buffers take some megabytes; an unbounded proxy takes it all.
            assert taken < 64 << 20, f"the proxy took {taken} bytes from a sender whose receiver reads nothing"
    finally:
        for writer in held_open:
            writer.close()
        server.close()


async def test_refusals_name_what_is_wrong(tmp_path):
    async with echo_server() as upstream:
        with proxy_in_front_of(upstream, tmp_path) as (proxy, _):
            with pytest.raises(DelayProxyError, match="MS must be a finite number >= 0, got '-5'"):
                proxy.command("delay -5 0")
            with pytest.raises(DelayProxyError, match="unknown command 'reorder'"):
                proxy.command("reorder")
            assert proxy.stats()["delay_ms"] == 0
    outside = DelayProxy(log_path=tmp_path / "outside.log")
    with pytest.raises(DelayProxyError, match="exited with code 2"):
        outside.start("127.0.0.1:1", listen="0.0.0.0:0")
    assert "--listen must be on 127.0.0.1" in (tmp_path / "outside.log").read_text()
