"""A client for bidi streams that multiplex many requests by id.

One long-lived stream carries every request; responses resolve the waiting
caller's future by id. When the stream breaks, every waiting caller gets
UNAVAILABLE at once and the next request opens a new stream. A stream older
than `max_age_s` takes no new requests: the next one opens a new stream, and
the old one is half-closed, so the server ends it once it has answered what it
carries. Behind a mesh each stream goes to one pod, chosen when it opens: so
replicas added later (an autoscaler's) get their share within that age.
"""

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from services.common import errors

log = logging.getLogger(__name__)


class _Stream:
    def __init__(self, opened_at: float):
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.pending: dict[int, asyncio.Future] = {}
        self.closed = False
        self.retired = False  # half-closed: takes nothing more, its answers still come
        self.opened_at = opened_at
        self.reader: asyncio.Task | None = None

    async def messages(self) -> AsyncIterator:
        """What goes on the wire, each request built only when gRPC takes it
        (after any wait for flow control), and not at all once its caller has
        left: the time left it states is then the time left."""
        while (item := await self.outbox.get()) is not None:
            if isinstance(item, tuple):
                request_id, build = item
                if request_id not in self.pending:
                    continue
                item = build(request_id)
            yield item


class StreamMux:
    """`open_call(request_iterator)` starts the bidi call; responses carry `id`."""

    def __init__(self, name: str, open_call: Callable, cancel_message: Callable[[int], object] | None = None,
                 max_age_s: float | None = None):
        self._name = name
        self._open_call = open_call
        self._cancel_message = cancel_message
        self._max_age_s = max_age_s
        self._ids = itertools.count(1)
        self._stream: _Stream | None = None
        self._retired: set[_Stream] = set()
        self.opened = 0  # streams opened so far

    def _current(self) -> _Stream:
        now = asyncio.get_running_loop().time()
        stream = self._stream
        if stream is not None and not stream.closed and self._max_age_s and now - stream.opened_at >= self._max_age_s:
            stream.retired = True
            stream.outbox.put_nowait(None)  # half-close: the server answers what it holds, then ends the stream
            self._retired.add(stream)
            stream.reader.add_done_callback(lambda _, stream=stream: self._retired.discard(stream))
            stream = None
        if stream is None or stream.closed:
            stream = _Stream(now)
            call = self._open_call(stream.messages())
            stream.reader = asyncio.create_task(self._read(stream, call), name=f"mux-{self._name}")
            self._stream = stream
            self.opened += 1
        return stream

    async def _read(self, stream: _Stream, call) -> None:
        error: errors.InfermeshError = errors.Unavailable(f"{self._name} closed the stream")
        try:
            async for response in call:
                future = stream.pending.pop(response.id, None)
                if future is not None and not future.done():
                    future.set_result(response)
        except grpc.aio.AioRpcError as exc:
            error = errors.Unavailable(f"{self._name} is unreachable ({exc.code().name}: {exc.details()})")
            log.warning("stream to %s failed: %s", self._name, exc.code().name)
        except asyncio.CancelledError:
            call.cancel()
            error = errors.Unavailable(f"stream to {self._name} was closed")
            raise
        finally:
            stream.closed = True
            stream.outbox.put_nowait(None)
            for future in stream.pending.values():
                if not future.done():
                    future.set_exception(error)
            stream.pending.clear()

    async def request(self, build: Callable[[int], object], timeout_s: float | None = None):
        """Sends build(id) and waits for the response with that id. On timeout
        or cancellation the server is told to drop the request (or, not yet
        sent, it never is)."""
        stream = self._current()
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        stream.pending[request_id] = future
        stream.outbox.put_nowait((request_id, build))  # built as it is sent (_Stream.messages)
        try:
            if timeout_s is None:
                return await future
            return await asyncio.wait_for(future, timeout_s)
        finally:
            if (stream.pending.pop(request_id, None) is not None and not stream.closed and not stream.retired
                    and self._cancel_message):
                stream.outbox.put_nowait(self._cancel_message(request_id))

    async def close(self) -> None:
        streams = [*self._retired, *([self._stream] if self._stream is not None else [])]
        for stream in streams:
            if stream.reader is not None:
                stream.outbox.put_nowait(None)
                stream.reader.cancel()
        await asyncio.gather(*(s.reader for s in streams if s.reader is not None), return_exceptions=True)


async def answer_concurrently(
    request_iterator,
    handle: Callable[[object], Awaitable[object | None]],
    on_error: Callable[[object, Exception], object],
    max_unsent: int,
    draining: asyncio.Event | None = None,
) -> AsyncIterator:
    """The server side of a multiplexed stream, as an async generator.

    Runs handle(request) for every request concurrently and yields each answer
    when it is ready. Contracts: every request gets exactly one answer (an
    unexpected exception becomes on_error's answer; handle may return None
    for messages that need none, such as cancellations); at most max_unsent
    requests are unanswered or answered-but-unsent, after which reading
    pauses; the stream ends once the input has ended and every answer is
    sent, or, after `draining` is set, as soon as nothing is in flight. A
    message that cannot be read ends the stream with INVALID_ARGUMENT after
    the answers already due. When the caller goes away, work in flight is
    cancelled.
    """
    outbox: asyncio.Queue = asyncio.Queue()
    slots = asyncio.Semaphore(max_unsent)
    tasks: set[asyncio.Task] = set()
    broken: list[Exception] = []
    ended = asyncio.Event()

    def maybe_finish() -> None:
        if not tasks and (ended.is_set() or (draining is not None and draining.is_set())):
            outbox.put_nowait(None)

    async def run(request) -> None:
        answer = None
        try:
            answer = await handle(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the request still gets its one answer
            log.exception("stream request failed unexpectedly")
            answer = on_error(request, exc)
        finally:
            if answer is None:
                slots.release()
            else:
                outbox.put_nowait(answer)

    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        maybe_finish()

    async def read() -> None:
        try:
            async for request in request_iterator:
                await slots.acquire()
                task = asyncio.create_task(run(request))
                tasks.add(task)
                task.add_done_callback(done)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported once the answers due are sent
            broken.append(exc)
        ended.set()
        maybe_finish()

    async def watch_drain() -> None:
        await draining.wait()
        maybe_finish()

    reader = asyncio.create_task(read())
    watcher = asyncio.create_task(watch_drain()) if draining is not None else None
    try:
        while (answer := await outbox.get()) is not None:
            yield answer
            slots.release()
        if broken:
            exc = broken[0]
            raise exc if isinstance(exc, errors.InfermeshError) else errors.InvalidArgument(
                f"the request stream could not be read: {type(exc).__name__}: {exc}")
    finally:
        reader.cancel()
        if watcher is not None:
            watcher.cancel()
        for task in list(tasks):
            task.cancel()
