"""A TCP proxy process that delays or stalls the bytes it forwards, for chaos runs
on one hop (gRPC over HTTP/2 passes through untouched: it only moves bytes).

    python -m tools.delay_proxy --listen 127.0.0.1:0 --upstream HOST:PORT [--control-port 0]

prints one line when it serves, as the mesh's services do:
    {"ready": true, "listen": "127.0.0.1:P", "control": "127.0.0.1:Q"}

Control (127.0.0.1 only): a line protocol over TCP, one command a line, each
answered by one JSON line ({"ok": true, ...} or {"ok": false, "error": ...}):
    delay MS JITTER_MS   every chunk read from now on is written MS ± uniform(JITTER_MS)
                         after it arrived; each direction keeps its byte order
    stall SECONDS        nothing is written either way on any connection for SECONDS
                         (connections stay open; a stall during a stall extends it)
    clear                no delay, no stall: what is held goes out at once
    stats                counters: connections (accepted, open), bytes each way,
                         chunks, chunks_delayed (written later than they arrived), faults
Each connection holds at most --buffer-bytes per direction; past that it stops
reading that side, so a slow or stalled peer pushes back through TCP.

`DelayProxy` starts this as a subprocess and speaks its control protocol.
"""

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import signal
import socket
import sys

CHUNK_BYTES = 64 * 1024
LOOPBACK = "127.0.0.1"


@dataclasses.dataclass
class Counters:
    accepted: int = 0
    open: int = 0
    upstream_failures: int = 0  # connections whose upstream could not be reached
    bytes_to_upstream: int = 0
    bytes_to_client: int = 0
    chunks: int = 0
    chunks_delayed: int = 0


class Faults:
    """The faults now applied, and a wake-up for writers whenever they change."""

    def __init__(self, rng: random.Random):
        self.delay_s = 0.0
        self.jitter_s = 0.0
        self.stall_until = 0.0  # loop time
        self.generation = 0
        self._changed = asyncio.Event()
        self._rng = rng

    def sample_s(self) -> float:
        """One chunk's delay: delay ± uniform jitter, never negative."""
        if self.jitter_s:
            return max(0.0, self.delay_s + self._rng.uniform(-self.jitter_s, self.jitter_s))
        return self.delay_s

    def set_delay(self, delay_s: float, jitter_s: float) -> None:
        self.delay_s, self.jitter_s = delay_s, jitter_s
        self._notify()

    def stall(self, seconds: float, now: float) -> None:
        self.stall_until = max(self.stall_until, now + seconds)
        self._notify()

    def clear(self) -> None:
        self.delay_s = self.jitter_s = 0.0
        self.stall_until = 0.0
        self._notify()

    def _notify(self) -> None:
        self.generation += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout_s: float) -> None:
        """Returns when the faults change or after timeout_s, whichever is first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    def describe(self, now: float) -> dict:
        return {
            "delay_ms": 1000 * self.delay_s,
            "jitter_ms": 1000 * self.jitter_s,
            "stall_left_s": max(0.0, self.stall_until - now),
        }


class Pipe:
    """One direction of one connection: a reader filling a queue bounded in
    bytes, a writer emptying it in order once each chunk is due."""

    def __init__(self, proxy: "Proxy", reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str):
        self._proxy = proxy
        self._reader = reader
        self._writer = writer
        self._direction = direction
        self._queue: asyncio.Queue = asyncio.Queue()  # (arrived, delay_s, generation, data | b"" for EOF)
        self._held_bytes = 0
        self._room = asyncio.Event()
        self._room.set()

    async def read(self) -> None:
        faults, loop = self._proxy.faults, asyncio.get_running_loop()
        while True:
            await self._room.wait()
            data = await self._reader.read(CHUNK_BYTES)
            self._queue.put_nowait((loop.time(), faults.sample_s(), faults.generation, data))
            if not data:
                return
            self._held_bytes += len(data)
            if self._held_bytes >= self._proxy.buffer_bytes:
                self._room.clear()

    async def write(self) -> None:
        faults, loop, counters = self._proxy.faults, asyncio.get_running_loop(), self._proxy.counters
        while True:
            arrived, delay_s, generation, data = await self._queue.get()
            waited = False
            while True:
                if generation != faults.generation:  # the faults changed since it arrived: theirs now apply
                    delay_s, generation = faults.sample_s(), faults.generation
                wait_s = max(arrived + delay_s, faults.stall_until) - loop.time()
                if wait_s <= 0:
                    break
                waited = True
                await faults.changed(wait_s)
            if not data:
                if self._writer.can_write_eof():
                    self._writer.write_eof()
                return
            self._writer.write(data)
            await self._writer.drain()  # a slow receiver holds this pipe, and its reader once the queue is full
            self._held_bytes -= len(data)
            if self._held_bytes < self._proxy.buffer_bytes:
                self._room.set()
            counters.chunks += 1
            counters.chunks_delayed += waited
            if self._direction == "to_upstream":
                counters.bytes_to_upstream += len(data)
            else:
                counters.bytes_to_client += len(data)


class Proxy:
    """Accepts connections, opens one upstream for each, and pipes both ways under the faults."""

    def __init__(self, upstream: tuple[str, int], buffer_bytes: int, seed: int | None = None):
        self.upstream = upstream
        self.buffer_bytes = buffer_bytes
        self.faults = Faults(random.Random(seed))
        self.counters = Counters()

    async def handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.counters.accepted += 1
        self.counters.open += 1
        upstream_writer = None
        failed = True
        try:
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream, limit=CHUNK_BYTES)
            except OSError:
                self.counters.upstream_failures += 1
                return  # the client sees its connection close, as with no server behind
            for w in (client_writer, upstream_writer):
                w.transport.set_write_buffer_limits(high=self.buffer_bytes)
                w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pipes = [
                Pipe(self, client_reader, upstream_writer, "to_upstream"),
                Pipe(self, upstream_reader, client_writer, "to_client"),
            ]
            tasks = [asyncio.create_task(p.read()) for p in pipes] + [asyncio.create_task(p.write()) for p in pipes]
            try:
                # Both directions end (EOF written each way), or either side fails and both close.
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                failed = any(t.exception() is not None for t in done)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for w in (client_writer, upstream_writer):
                if w is not None:
                    # A side that failed is reset on the other side too, as a broken path would be.
                    w.transport.abort() if failed else w.close()
            self.counters.open -= 1

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                writer.write(json.dumps(self.command(line.decode(errors="replace").split())).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, ValueError):  # gone, or a line past the reader's limit
            pass
        finally:
            writer.close()

    def command(self, words: list[str]) -> dict:
        now = asyncio.get_running_loop().time()
        try:
            match words:
                case ["delay", ms, jitter_ms]:
                    delay_ms, jitter = _non_negative("MS", ms), _non_negative("JITTER_MS", jitter_ms)
                    self.faults.set_delay(delay_ms / 1000, jitter / 1000)
                case ["stall", seconds]:
                    self.faults.stall(_non_negative("SECONDS", seconds), now)
                case ["clear"]:
                    self.faults.clear()
                case ["stats"]:
                    pass
                case _:
                    raise ValueError(
                        f"unknown command {' '.join(words)!r}; expected 'delay MS JITTER_MS', "
                        "'stall SECONDS', 'clear' or 'stats'"
                    )
        except ValueError as exc:
            return {"ok": False, "error": str(exc)}
        return {"ok": True, **dataclasses.asdict(self.counters), **self.faults.describe(now)}


def _non_negative(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {text!r}")
    return value


def _address(text: str, what: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{what} must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


async def serve(args: argparse.Namespace) -> None:
    proxy = Proxy(args.upstream, args.buffer_bytes, args.seed)
    listener = await asyncio.start_server(proxy.handle, LOOPBACK, args.listen[1], limit=CHUNK_BYTES)
    controller = await asyncio.start_server(proxy.control, LOOPBACK, args.control_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    listen_port = listener.sockets[0].getsockname()[1]
    control_port = controller.sockets[0].getsockname()[1]
    print(
        json.dumps(
            {
                "ready": True,
                "listen": f"{LOOPBACK}:{listen_port}",
                "control": f"{LOOPBACK}:{control_port}",
                "upstream": f"{args.upstream[0]}:{args.upstream[1]}",
            }
        ),
        flush=True,
    )
    await stop.wait()
    listener.close()
    controller.close()


class DelayProxyError(RuntimeError):
    """The proxy did not start, or refused a command; the message says why."""


class DelayProxy:
    """A delay proxy process and its control connection: `start` runs
    `python -m tools.delay_proxy` in front of `upstream` and returns the
    address to connect to instead; the fault methods return its stats."""

    def __init__(
        self,
        log_path: str | os.PathLike | None = None,
        buffer_bytes: int = 256 * 1024,
        seed: int | None = None,
        ready_timeout_s: float = 30.0,
    ):
        self.log_path = log_path
        self.buffer_bytes = buffer_bytes
        self.seed = seed
        self.ready_timeout_s = ready_timeout_s
        self.process = None  # a services.launcher.mesh.Process while it runs
        self.listen = ""
        self.control_address = ""
        self._control: socket.socket | None = None
        self._replies = b""

    def start(self, upstream: str, listen: str = f"{LOOPBACK}:0", control_port: int = 0) -> str:
        """Starts the process (it dies with this one) and returns its listen address."""
        from services.launcher.mesh import MeshError, Process  # started and awaited as the mesh's services are

        if self.process is not None:
            raise DelayProxyError(f"this proxy already runs (pid {self.process.popen.pid}, listening on {self.listen})")
        argv = [
            sys.executable,
            "-m",
            "tools.delay_proxy",
            "--listen",
            listen,
            "--upstream",
            upstream,
            "--control-port",
            str(control_port),
            "--buffer-bytes",
            str(self.buffer_bytes),
        ]
        if self.seed is not None:
            argv += ["--seed", str(self.seed)]
        log = pathlib.Path(self.log_path) if self.log_path else None
        self.process = Process(log.stem if log else "delay-proxy", argv, log.parent if log else None, dict(os.environ))
        try:
            info = self.process.wait_ready(self.ready_timeout_s)
        except MeshError as exc:
            self.stop()
            raise DelayProxyError(f"the delay proxy did not start: {exc}") from None
        self.listen, self.control_address = info["listen"], info["control"]
        host, port = _address(self.control_address, "control")
        self._control = socket.create_connection((host, port), timeout=10)
        return self.listen

    def command(self, line: str) -> dict:
        """Sends one control command and returns its answer; raises if refused."""
        if self._control is None:
            raise DelayProxyError("the delay proxy is not running: call start(upstream) first")
        self._control.sendall(line.encode() + b"\n")
        while b"\n" not in self._replies:
            data = self._control.recv(65536)
            if not data:
                raise DelayProxyError(f"the delay proxy closed its control connection during {line!r}")
            self._replies += data
        reply, _, self._replies = self._replies.partition(b"\n")
        answer = json.loads(reply)
        if not answer["ok"]:
            raise DelayProxyError(f"the delay proxy refused {line!r}: {answer['error']}")
        return answer

    def delay(self, ms: float, jitter_ms: float = 0.0) -> dict:
        return self.command(f"delay {ms:g} {jitter_ms:g}")

    def stall(self, seconds: float) -> dict:
        return self.command(f"stall {seconds:g}")

    def clear(self) -> dict:
        return self.command("clear")

    def stats(self) -> dict:
        return self.command("stats")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ends the process (SIGTERM, then SIGKILL); its connections close."""
        if self._control is not None:
            self._control.close()
            self._control = None
        if self.process is not None:
            self.process.stop(timeout_s)
            self.process = None

    def __enter__(self) -> "DelayProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--listen",
        type=lambda t: _address(t, "--listen"),
        default=(LOOPBACK, 0),
        help="127.0.0.1:PORT to accept connections on (port 0: a free one)",
    )
    parser.add_argument(
        "--upstream",
        type=lambda t: _address(t, "--upstream"),
        required=True,
        help="HOST:PORT every connection is forwarded to",
    )
    parser.add_argument("--control-port", type=int, default=0, help="the control port on 127.0.0.1 (0: a free one)")
    parser.add_argument(
        "--buffer-bytes",
        type=int,
        default=256 * 1024,
        help="bytes held per connection and direction before reading that side pauses",
    )
    parser.add_argument("--seed", type=int, default=None, help="the jitter's random seed")
    args = parser.parse_args(argv)
    if args.listen[0] != LOOPBACK:
        parser.error(f"--listen must be on {LOOPBACK}, got {args.listen[0]!r}: the proxy is for local chaos runs")
    if args.buffer_bytes < CHUNK_BYTES:
        parser.error(f"--buffer-bytes must be >= {CHUNK_BYTES}, got {args.buffer_bytes}")
    from services.common.serving import die_with_parent

    die_with_parent()
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
