"""A client for bidi streams that multiplex many requests by id.

One long-lived stream carries every request; responses resolve the waiting
caller's future by id. When the stream breaks, every waiting caller gets
UNAVAILABLE at once and the next request opens a new stream. A stream older
than `max_age_s` takes no new requests: the next one opens a new stream, and
the old one is half-closed, so the server ends it once it has answered what it
carries. Behind a mesh each stream goes to one pod, chosen when it opens: so
replicas added later (an autoscaler's) get their share within that age.

With a Framing, several messages travel as one frame each way: whatever is
queued when gRPC takes the next message goes in it. On loopback a stream
message costs each side tens of microseconds of gRPC's own work whatever it
carries, so under load the requests of a hop share that cost; at one request
in flight a frame holds one, and nothing waits to fill it.
"""

import asyncio
import contextlib
import dataclasses
import functools
import heapq
import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from services.common import errors
from services.common.budget import ByteBudget

log = logging.getLogger(__name__)

Sent = TypeVar("Sent", bound=Message, contravariant=True)
Frame = TypeVar("Frame", bound=Message, contravariant=True)
Item = TypeVar("Item")


class Multiplexed(Protocol):
    """A message of a stream that carries many requests: the id of its request."""

    @property
    def id(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Framing(Generic[Sent, Frame]):
    """How a stream carries several messages in one: `pack` makes a frame of a
    list of the messages this side sends (`Sent`), `unpack` gives the messages
    of a frame it receives (`Frame`) back. A frame holds at
    most `max_messages`, and stops growing at `max_bytes` (by each message's
    ByteSize), so that it stays well inside the transport's message limit."""

    pack: Callable[[list[Sent]], Message]
    unpack: Callable[[Frame], Iterable[Multiplexed]]
    max_messages: int = 256
    max_bytes: int = 4 * 1024 * 1024
    # How long a client's frame may wait for company while the stream has
    # requests in flight (see StreamMux): the server is busy with those, so
    # a request sent a moment later seldom starts later. 0: never waits.
    linger_s: float = 0.0


# The streams below carry whichever messages their callers' methods take: a
# framing's types are the caller's, checked where it is made.
AnyFraming = Framing[Any, Any]


async def framed(
    outbox: asyncio.Queue[Item],
    framing: AnyFraming | None,
    prepare: Callable[[Item], Message | None],
    sent: Callable[[int], None] | None = None,
    gather: Callable[[], Awaitable[None]] | None = None,
) -> AsyncGenerator[Message, None]:
    """The messages of `outbox` as they go on the wire, until a None: each
    item through prepare (None: nothing to send), in frames of what is queued
    when the next one is taken (one message each without a framing), after
    `gather()` where one item alone is queued. A message that would take a
    frame past max_bytes starts the next one. `sent(n)` is told each time
    gRPC has taken n more messages."""
    if framing is None:
        while (item := await outbox.get()) is not None:
            if (message := prepare(item)) is not None:
                yield message
                if sent is not None:
                    sent(1)
        return
    carried: Message | None = None  # a prepared message that did not fit in the last frame
    ended = False
    while not ended:
        if carried is None:
            item = await outbox.get()
            if item is None:
                return
            if gather is not None and outbox.empty():
                await gather()
            message = prepare(item)
        else:
            message, carried = carried, None
        frame: list[Message] = []
        size = 0
        while True:
            if message is not None:
                message_size = message.ByteSize()
                if frame and size + message_size > framing.max_bytes:
                    carried = message
                    break
                frame.append(message)
                size += message_size
            if len(frame) >= framing.max_messages or outbox.empty():
                break
            item = outbox.get_nowait()
            if item is None:
                ended = True
                break
            message = prepare(item)
        if frame:
            yield framing.pack(frame)
            if sent is not None:
                sent(len(frame))


class StreamLost(errors.Unavailable):
    """UNAVAILABLE: the stream a request went on ended or broke before its
    answer came; the server may or may not have run it (inference is
    idempotent, so sending it again is safe)."""


def _unchanged(message: Message | None) -> Message | None:
    return message


# What a client stream sends: a request as (its id, what builds it once it is
# sent), or a message as it is (a cancellation).
_Outgoing = tuple[int, Callable[[int], Message]] | Message


class _Stream:
    def __init__(self, opened_at: float, framing: AnyFraming | None):
        self.outbox: asyncio.Queue[_Outgoing | None] = asyncio.Queue()
        self.pending: dict[int, asyncio.Future] = {}
        self.closed = False
        self.retired = False  # half-closed: takes nothing more, its answers still come
        self.opened_at = opened_at
        self.reader: asyncio.Task | None = None
        self.framing = framing
        self._waking: asyncio.Future | None = None  # set while a frame lingers

    def messages(self) -> AsyncIterator[Message]:
        """What goes on the wire, each request built only when gRPC takes it
        (after any wait for flow control), and not at all once its caller has
        left: the time left it states is then the time left."""
        lingers = self.framing is not None and self.framing.linger_s > 0
        return framed(self.outbox, self.framing, self._prepare, gather=self._linger if lingers else None)

    async def _linger(self) -> None:
        """Waits up to the framing's linger_s for more requests to share the
        frame, while requests sent before are in flight (an idle stream sends
        at once); cut short by a request sent `at_once` or a full frame (put)."""
        if len(self.pending) <= self.outbox.qsize() + 1:
            return
        assert self.framing is not None  # only a framing's frames linger
        loop = asyncio.get_running_loop()
        self._waking = loop.create_future()
        timer = loop.call_later(self.framing.linger_s, self.wake)
        try:
            await self._waking
        finally:
            timer.cancel()
            self._waking = None

    def put(self, item: _Outgoing | None, at_once: bool = False) -> None:
        self.outbox.put_nowait(item)
        if self._waking is not None:
            assert self.framing is not None  # only a framing's frames linger
            if at_once or self.outbox.qsize() + 1 >= self.framing.max_messages:
                self.wake()

    def wake(self) -> None:
        if self._waking is not None and not self._waking.done():
            self._waking.set_result(None)

    def _prepare(self, item: _Outgoing | None) -> Message | None:
        if isinstance(item, tuple):
            request_id, build = item
            return build(request_id) if request_id in self.pending else None
        return item


class StreamMux:
    """`open_call(request_iterator)` starts the bidi call; responses carry `id`."""

    def __init__(
        self,
        name: str,
        open_call: Callable,
        cancel_message: Callable[[int], Message] | None = None,
        max_age_s: float | None = None,
        framing: AnyFraming | None = None,
    ):
        self._name = name
        self._framing = framing
        self._open_call = open_call
        self._cancel_message = cancel_message
        self._max_age_s = max_age_s
        self._ids = itertools.count(1)
        self._stream: _Stream | None = None
        self._retired: set[_Stream] = set()
        self.opened = 0  # streams opened so far
        # Requests' timeouts: [deadline, id, future] in a heap and one timer for
        # its head, rather than a timer per request (asyncio's timers compare
        # in Python, and under load they cost more than the rest of a request).
        # An answered request's entry stays until its deadline or a compaction,
        # but its future (which holds the response) is dropped at once.
        self._deadlines: list[list] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timed = 0  # requests with a timeout still waiting: the rest of the heap is answered

    def _current(self) -> _Stream:
        now = asyncio.get_running_loop().time()
        stream = self._stream
        if stream is not None and not stream.closed and self._max_age_s and now - stream.opened_at >= self._max_age_s:
            stream.retired = True
            stream.put(None, at_once=True)  # half-close: the server answers what it holds, then ends the stream
            self._retired.add(stream)
            assert stream.reader is not None  # every stream's reader starts as it opens, below
            stream.reader.add_done_callback(functools.partial(self._forget, stream))
            stream = None
        if stream is None or stream.closed:
            stream = _Stream(now, self._framing)
            call = self._open_call(stream.messages())
            stream.reader = asyncio.create_task(self._read(stream, call), name=f"mux-{self._name}")
            self._stream = stream
            self.opened += 1
        return stream

    def _forget(self, stream: _Stream, _reader: asyncio.Task) -> None:
        self._retired.discard(stream)

    async def _read(self, stream: _Stream, call) -> None:
        error: errors.InfermeshError = StreamLost(f"{self._name} closed the stream before answering")
        unpack = self._framing.unpack if self._framing is not None else None
        try:
            async for message in call:
                for response in unpack(message) if unpack is not None else (message,):
                    future = stream.pending.pop(response.id, None)
                    if future is not None and not future.done():
                        future.set_result(response)
        except grpc.aio.AioRpcError as exc:
            error = StreamLost(
                f"the stream to {self._name} ended before answering ({exc.code().name}: {exc.details()})"
            )
            log.warning("stream to %s failed: %s", self._name, exc.code().name)
        except asyncio.CancelledError:
            call.cancel()
            error = errors.Unavailable(f"stream to {self._name} was closed")
            raise
        finally:
            stream.closed = True
            stream.put(None, at_once=True)
            for future in stream.pending.values():
                if not future.done():
                    future.set_exception(error)
            stream.pending.clear()

    async def request(self, build: Callable[[int], Message], timeout_s: float | None = None, at_once: bool = False):
        """Sends build(id) and waits for the response with that id. On timeout
        or cancellation the server is told to drop the request (or, not yet
        sent, it never is). A request sent `at_once` has its frame go now, without
        waiting for company (Framing.linger_s)."""
        stream = self._current()
        request_id = next(self._ids)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        stream.pending[request_id] = future
        stream.put((request_id, build), at_once)  # built as it is sent (_Stream.messages)
        entry = self._expire_at(loop, loop.time() + timeout_s, request_id, future) if timeout_s is not None else None
        try:
            return await future
        finally:
            if entry is not None:
                entry[2] = None  # answered: the heap must not keep its response alive until the deadline
                self._timed -= 1
            if (
                stream.pending.pop(request_id, None) is not None
                and not stream.closed
                and not stream.retired
                and self._cancel_message
            ):
                stream.put(self._cancel_message(request_id))

    def _expire_at(self, loop, deadline: float, request_id: int, future: asyncio.Future) -> list:
        """Arms the request's timeout; returns its heap entry (ids are unique, so futures are never compared)."""
        heap = self._deadlines
        if len(heap) >= 4096 and len(heap) >= 4 * self._timed:
            # Answered entries stay until their deadline; once they are three in four, they go.
            heap[:] = [entry for entry in heap if entry[2] is not None]
            heapq.heapify(heap)
        entry = [deadline, request_id, future]
        heapq.heappush(heap, entry)
        self._timed += 1
        if heap[0][1] == request_id:  # the earliest now: the timer moves up
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(deadline, self._expire)
        return entry

    def _expire(self) -> None:
        """Fails the requests whose timeout has passed with TimeoutError, as
        asyncio.wait_for would; re-arms for the next deadline."""
        loop = asyncio.get_running_loop()
        now, heap = loop.time(), self._deadlines
        while heap and heap[0][0] <= now:
            _, _, future = heapq.heappop(heap)
            if future is not None and not future.done():
                future.set_exception(TimeoutError())
        self._timer = loop.call_at(heap[0][0], self._expire) if heap else None

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        streams = [*self._retired, *([self._stream] if self._stream is not None else [])]
        for stream in streams:
            if stream.reader is not None:
                stream.put(None, at_once=True)
                stream.reader.cancel()
        await asyncio.gather(*(s.reader for s in streams if s.reader is not None), return_exceptions=True)


def _byte_size(message: Message) -> int:
    return message.ByteSize()


async def answer_concurrently(
    request_iterator,
    handle: Callable[[object], Awaitable[object | None]],
    on_error: Callable[[object, Exception], object],
    max_unsent: int,
    draining: asyncio.Event | None = None,
    framing: AnyFraming | None = None,
    budget: ByteBudget | None = None,
    on_refused: Callable[[object, errors.ResourceExhausted], object] | None = None,
    size: Callable[[Any], int] = _byte_size,  # of a request of the caller's type; protobuf's ByteSize by default
    idle_s: float | None = None,
) -> AsyncIterator:
    """The server side of a multiplexed stream, as an async generator.

    Runs handle(request) for every request concurrently and yields each answer
    when it is ready. Contracts: every request gets exactly one answer (an
    unexpected exception becomes on_error's answer; handle may return None
    for messages that need none, such as cancellations); at most max_unsent
    requests are unanswered or answered-but-unsent, after which reading
    pauses; the stream ends once the input has ended and every answer is
    sent, or, given `idle_s`, once nothing has been in flight or read for
    that long (with UNAVAILABLE: one may be on the wire). Once `draining` is set nothing more is read: the requests
    already read (in flight, or in hand between the read and their task) are
    answered, then the stream ends with UNAVAILABLE (OK where the input had
    ended): the caller learns that whatever it sent and got no answer for was
    never read, and sends it again elsewhere. A stream never ends OK with a
    request unanswered. A message that cannot be read ends the stream with INVALID_ARGUMENT after
    the answers already due. When the caller goes away, work in flight is
    cancelled. Given a `budget`, each request's `size` is held in it from
    when it is read until handle has answered it (or been cancelled); one
    that does not fit is answered by `on_refused` and never handled.
    """
    outbox: asyncio.Queue = asyncio.Queue()
    slots = asyncio.Semaphore(max_unsent)
    tasks: set[asyncio.Task] = set()
    broken: list[Exception] = []
    ended = asyncio.Event()
    loop = asyncio.get_running_loop()
    last_read = [loop.time()]
    in_hand = [0]  # messages read whose requests have no task yet
    finished = [False]
    idled: list[float] = []  # set when the stream ends for being idle

    def is_draining() -> bool:
        return draining is not None and draining.is_set()

    def maybe_finish() -> None:
        if not finished[0] and not tasks and not in_hand[0] and (ended.is_set() or is_draining()):
            finished[0] = True
            outbox.put_nowait(None)

    async def run(request) -> None:
        answer = None
        try:
            answer = await handle(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the request still gets its one answer
            log.exception("stream request failed unexpectedly")
            answer = on_error(request, exc)
        finally:
            if answer is None:
                slots.release()
            else:
                outbox.put_nowait(answer)

    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        last_read[0] = loop.time()  # idle counts from the last answer too
        maybe_finish()

    async def read() -> None:
        unpack = framing.unpack if framing is not None else None
        try:
            async for message in request_iterator:
                last_read[0] = loop.time()
                in_hand[0] += 1
                try:
                    for request in unpack(message) if unpack is not None else (message,):
                        await slots.acquire()
                        held = 0
                        if budget is not None:
                            held = size(request)
                            try:
                                budget.acquire(held, "stream message")
                            except errors.ResourceExhausted as exc:
                                assert on_refused is not None  # a budget comes with on_refused
                                outbox.put_nowait(on_refused(request, exc))  # its slot frees once it is sent
                                continue
                        task = asyncio.create_task(run(request))
                        tasks.add(task)
                        # A done callback: it runs even for a task cancelled before it started.
                        if budget is not None and held:
                            budget.release_when_done(task, held)
                        task.add_done_callback(done)
                finally:
                    in_hand[0] -= 1
                if is_draining():
                    maybe_finish()
                    return  # nothing more is read; the stream ends once these are answered
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported once the answers due are sent
            broken.append(exc)
        ended.set()
        maybe_finish()

    async def watch_drain(draining: asyncio.Event) -> None:
        await draining.wait()
        maybe_finish()

    async def watch_idle(idle_s: float) -> None:
        """Ends the stream once it has been idle for idle_s: an idle stream
        must not hold one of the server's calls for good."""
        while True:
            quiet_s = loop.time() - last_read[0]
            if quiet_s >= idle_s and not tasks and not in_hand[0] and outbox.empty() and not finished[0]:
                finished[0] = True
                idled.append(quiet_s)
                outbox.put_nowait(None)
                return
            await asyncio.sleep(max(idle_s - quiet_s, idle_s / 4))

    def release(count: int) -> None:
        for _ in range(count):
            slots.release()

    reader = asyncio.create_task(read())
    watchers = []
    if draining is not None:
        watchers.append(asyncio.create_task(watch_drain(draining)))
    if idle_s:
        watchers.append(asyncio.create_task(watch_idle(idle_s)))
    try:
        async with contextlib.aclosing(framed(outbox, framing, _unchanged, release)) as messages:
            async for message in messages:
                yield message
        if broken:
            exc = broken[0]
            raise (
                exc
                if isinstance(exc, errors.InfermeshError)
                else errors.InvalidArgument(f"the request stream could not be read: {type(exc).__name__}: {exc}")
            )
        if not ended.is_set() and idled:  # a request sent just now may be on the wire: not OK
            raise errors.Unavailable(
                f"the stream was idle for {idled[0]:.1f}s and is closed; every request read "
                f"on it was answered; open a new stream for more"
            )
        if not ended.is_set() and is_draining():
            raise errors.Unavailable(
                "the server is draining: every request it read on this stream was answered, "
                "any other was not read; send it again on a new stream"
            )
    finally:
        reader.cancel()
        for watcher in watchers:
            watcher.cancel()
        for task in list(tasks):
            task.cancel()
