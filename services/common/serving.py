"""Serving helpers shared by every service: error handling for every method, health,
reflection, readiness announcement and graceful shutdown."""

import argparse
import asyncio
import concurrent.futures
import ctypes
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Protocol

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import collector, errors, tracing, wire
from services.common.budget import ByteBudget, ServingLimits
from services.common.config import add_dataclass_arguments, from_arguments
from services.common.metrics import RPC_LATENCY_BY, RPC_REQUESTS_BY

log = logging.getLogger(__name__)

STATUS_BY_CODE = {code.value[0]: code for code in grpc.StatusCode}


def status_code(error: errors.InfermeshError) -> grpc.StatusCode:
    return STATUS_BY_CODE[error.code]


class Oversized:
    """A stream message over the per-message limit, parsed all the same so that
    the servicer can answer that one request with RESOURCE_EXHAUSTED and keep
    the stream (and every other request on it) alive."""

    __slots__ = ("message", "size")

    def __init__(self, message, size: int):
        self.message = message
        self.size = size


class Malformed:
    """A stream message that is not valid protobuf, or that its method's
    Decoder refused. Under per-message checks (a server with
    max_request_bytes) it reaches the servicer wrapped so, to be answered
    alone: the stream's framing is intact, so the stream, and every other
    request on it, can go on. `partial` is what the Decoder could read of it
    (its id, for the answer), or None."""

    __slots__ = ("error", "partial", "size")

    def __init__(self, size: int, error: errors.InfermeshError, partial=None):
        self.size = size
        self.error = error
        self.partial = partial


class Decoder(Protocol):
    """How a server reads one method's requests in place of the generated
    parser: checks that need no parse first, so that a message built to be
    slow to parse is refused before it is."""

    def decode(self, raw: bytes):
        """The message; raises an InfermeshError to refuse it, any other
        exception where it is not a valid message."""

    def partial(self, raw: bytes):
        """What of a refused message can be read at a cost independent of its
        size (what its answer must name), or None."""


class BoundedDecoder:
    """A Decoder for internal methods: a large message is refused with
    INVALID_ARGUMENT when it holds more than `max_fields` fields in all (what
    parsing it costs), counted before it is parsed."""

    def __init__(self, message_class, max_fields: int, method: str):
        self._class = message_class
        self._max_fields = max_fields
        self._method = method

    def decode(self, raw: bytes):
        if len(raw) > OFFLOAD_BYTES:
            try:
                wire.count_fields(raw, self._class.DESCRIPTOR, self._max_fields)
            except wire.BudgetExceeded:
                raise errors.InvalidArgument(
                    f"{self._method} message of {len(raw)} bytes holds more than {self._max_fields} protobuf fields; "
                    "this service takes at most that many in one message"
                ) from None
        return self._class.FromString(raw)

    def partial(self, raw: bytes):
        return None


# Messages larger than this, of a method with a Decoder, are decoded in the
# server's decode thread: a Python walk there hands the GIL back to the event
# loop every switch interval, where on the loop it would hold it throughout.
OFFLOAD_BYTES = 64 * 1024


class ErrorHandling:
    """Wraps every method handler of a server once, as it is registered
    (ErrorHandledServer), rather than an interceptor running per call. The
    wrapper maps domain errors to their gRPC status, anything unexpected to
    INTERNAL (traceback in the log, a generic message to the caller), and
    records the per-RPC metrics. It also parses requests itself (through the
    method's Decoder where it has one), so that a
    message that is not valid protobuf is INVALID_ARGUMENT rather than grpc's
    UNKNOWN, and a unary request over `max_request_bytes` is
    RESOURCE_EXHAUSTED naming both sizes (stream messages over
    `max_stream_message_bytes`, by default the same, arrive wrapped in
    Oversized, and with it set unreadable ones in Malformed); the requests of
    unary methods other than `data_methods` are held to
    `max_control_request_bytes`, and those of data methods to `budget`. A
    method the servicer leaves unimplemented is UNIMPLEMENTED."""

    def __init__(
        self,
        service: str,
        max_request_bytes: int | None = None,
        max_control_request_bytes: int | None = None,
        data_methods: frozenset[str] = frozenset(),
        budget: ByteBudget | None = None,
        max_stream_message_bytes: int | None = None,
        decoders: dict[str, Decoder] | None = None,
    ):
        self._service = service
        self._max_request_bytes = max_request_bytes
        self._max_stream_message_bytes = max_stream_message_bytes or max_request_bytes
        self._max_control_request_bytes = max_control_request_bytes
        self._data_methods = data_methods
        self._budget = budget
        self._decoders = decoders or {}
        # One thread: large messages are decoded one at a time, so that the
        # loop shares the GIL with one decode at most.
        self._decode_thread = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{service}-decode") if self._decoders else None
        )

    def wrap(self, full_method: str, handler):
        """The handler of `full_method` ("/package.Service/Method"), wrapped."""
        if handler is None:
            return None
        method = full_method.rsplit("/", 1)[-1]
        parse = handler.request_deserializer
        decoder = self._decoders.get(method)
        if decoder is not None:
            assert self._decode_thread is not None  # made where there are decoders
            parse = _Decoding(decoder, self._decode_thread)
        if handler.unary_unary:
            if method in self._data_methods:
                limit, budget = self._max_request_bytes, self._budget
            else:
                limit, budget = self._max_control_request_bytes, None
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method, parse, limit, budget),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_stream(handler.stream_stream, method, parse), response_serializer=handler.response_serializer
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_stream_unary(handler.stream_unary, method, parse),
                response_serializer=handler.response_serializer,
            )
        return handler

    async def _parse(self, parse, raw: bytes, method: str):
        if parse is None:
            return raw
        try:
            if isinstance(parse, _Decoding):
                return await parse.decode(raw)
            return parse(raw)
        except errors.InfermeshError:
            raise
        except Exception as exc:  # noqa: BLE001 - DecodeError and friends
            raise errors.InvalidArgument(
                f"{method} request of {len(raw)} bytes is not a valid message: {exc}"
            ) from None

    def _too_large(self, raw: bytes) -> bool:
        return self._max_stream_message_bytes is not None and len(raw) > self._max_stream_message_bytes

    async def _messages(self, raw_iterator, parse, method: str):
        async for raw in raw_iterator:
            if isinstance(parse, _Decoding) and self._too_large(raw):
                yield Oversized(parse.decoder.partial(raw), len(raw))  # refused unparsed: parsing it costs most
                continue
            try:
                message = await self._parse(parse, raw, method)
            except errors.InfermeshError as exc:
                if self._max_stream_message_bytes is None:
                    raise
                yield Malformed(len(raw), exc, parse.decoder.partial(raw) if isinstance(parse, _Decoding) else None)
                continue
            yield Oversized(message, len(raw)) if self._too_large(raw) else message

    def _record(self, method: str, code: str, started: float) -> None:
        RPC_REQUESTS_BY[self._service, method, code].inc()
        RPC_LATENCY_BY[self._service, method].observe(time.perf_counter() - started)

    def _wrap_unary(self, behavior, method, parse, limit: int | None, budget: ByteBudget | None):
        """A unary method whose requests are at most `limit` bytes and, given a
        budget, held within it from before they are parsed until answered."""

        async def wrapper(raw, context):
            started = time.perf_counter()
            try:
                if limit is not None and len(raw) > limit:
                    raise errors.ResourceExhausted(
                        f"{method} request of {len(raw)} bytes exceeds the limit of {limit} bytes"
                    )
                if budget is None:
                    response = await behavior(await self._parse(parse, raw, method), context)
                else:
                    with budget.hold(len(raw), f"{method} request"):
                        response = await behavior(await self._parse(parse, raw, method), context)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                await self._abort(context, exc, method, started)
            self._record(method, _code_name(context), started)
            return response

        return wrapper

    def _wrap_stream_unary(self, behavior, method, parse):
        async def wrapper(raw_iterator, context):
            started = time.perf_counter()
            try:
                response = await behavior(self._messages(raw_iterator, parse, method), context)
            except Exception as exc:  # noqa: BLE001
                await self._abort(context, exc, method, started)
            self._record(method, _code_name(context), started)
            return response

        return wrapper

    def _wrap_stream(self, behavior, method, parse):
        async def wrapper(raw_iterator, context):
            started = time.perf_counter()
            try:
                async for response in behavior(self._messages(raw_iterator, parse, method), context):
                    yield response
            except Exception as exc:  # noqa: BLE001
                await self._abort(context, exc, method, started)
            self._record(method, _code_name(context), started)

        return wrapper

    async def _abort(self, context, exc: Exception, method: str, started: float):
        trailers: tuple[tuple[str, str], ...] = ()
        if isinstance(exc, errors.InfermeshError):
            code, message = status_code(exc), errors.clipped(exc.message)
            if isinstance(exc, errors.ResourceExhausted) and exc.retry_after_ms:
                trailers = ((errors.RETRY_AFTER_METADATA, str(exc.retry_after_ms)),)
        elif isinstance(exc, NotImplementedError):  # a method of the proto the servicer does not override
            code, message = grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented by the {self._service}"
        elif isinstance(exc, asyncio.CancelledError):
            self._record(method, "CANCELLED", started)
            raise exc
        elif isinstance(exc, grpc.aio.AbortError):  # raised by context.abort(): it must pass through
            self._record(method, _code_name(context), started)
            raise exc
        else:
            log.error("unexpected error in %s: %s", method, "".join(traceback.format_exception(exc)))
            code, message = grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log"
        self._record(method, code.name, started)
        context.set_trailing_metadata(((errors.ERROR_METADATA, code.name), *trailers))
        await context.abort(code, message)


class _Decoding:
    """A method's Decoder, run on the event loop for a small message and in
    the decode thread for a large one."""

    __slots__ = ("_thread", "decoder")

    def __init__(self, decoder: Decoder, thread: concurrent.futures.Executor):
        self.decoder = decoder
        self._thread = thread

    async def decode(self, raw: bytes):
        if len(raw) <= OFFLOAD_BYTES:
            return self.decoder.decode(raw)
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.decoder.decode, raw)


def _code_name(context) -> str:
    code = context.code()
    if code is None:
        return "OK"
    return code.name if isinstance(code, grpc.StatusCode) else str(code)


class ErrorHandledServer:
    """A grpc.aio server whose method handlers are wrapped by ErrorHandling
    as they are registered: the generated add_*Servicer_to_server functions,
    health and reflection register through it unchanged. Everything else is
    the server's own."""

    def __init__(self, server: grpc.aio.Server, handling: ErrorHandling):
        self._server = server
        self._handling = handling

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_WrappedGenericHandler(h, self._handling) for h in handlers))

    def add_registered_method_handlers(self, service: str, method_handlers: dict) -> None:
        self._server.add_registered_method_handlers(
            service,
            {name: self._handling.wrap(f"/{service}/{name}", handler) for name, handler in method_handlers.items()},
        )

    def __getattr__(self, name):
        return getattr(self._server, name)


# What registers servicers (reflection, among others) tells an aio server from a sync one by isinstance.
grpc.aio.Server.register(ErrorHandledServer)


class _WrappedGenericHandler(grpc.GenericRpcHandler):
    """A generic handler whose answers are wrapped, once per method."""

    def __init__(self, inner: grpc.GenericRpcHandler, handling: ErrorHandling):
        self._inner = inner
        self._handling = handling
        self._by_method: dict[str, object] = {}

    def service(self, handler_call_details):
        method = handler_call_details.method
        handler = self._by_method.get(method)
        if handler is None:
            handler = self._handling.wrap(method, self._inner.service(handler_call_details))
            if handler is not None:  # only methods served: callers cannot grow the dict
                self._by_method[method] = handler
        return handler


def new_server(
    service: str,
    max_message_bytes: int,
    max_concurrent_rpcs: int | None = None,
    max_request_bytes: int | None = None,
    reuse_port: bool = False,
    limits: ServingLimits | None = None,
    data_methods: frozenset[str] = frozenset(),
    budget: ByteBudget | None = None,
    max_stream_message_bytes: int | None = None,
    decoders: dict[str, Decoder] | None = None,
) -> ErrorHandledServer:
    """A grpc.aio server whose handlers are error-handled (ErrorHandling).
    `max_message_bytes` is the transport's hard limit; `max_request_bytes`,
    when set and lower, is checked per request of the `data_methods` (the
    inference ones) so that one oversized message fails alone, and the
    requests of every other unary method are held to the control limit of
    `limits`. Unary data requests are held in `budget`; streams hold theirs
    per message (answer_concurrently). With `reuse_port`, other processes may
    bind the same port (SO_REUSEPORT) and the kernel spreads connections
    among them. `decoders` read the requests of the methods they name (by
    method name)."""
    server = grpc.aio.server(
        maximum_concurrent_rpcs=max_concurrent_rpcs, options=server_options(max_message_bytes, reuse_port, limits)
    )
    control = limits.max_control_request_bytes if limits is not None else None
    return ErrorHandledServer(
        server,
        ErrorHandling(service, max_request_bytes, control, data_methods, budget, max_stream_message_bytes, decoders),
    )


KEEPALIVE_MS = 15_000  # how often our clients ping a connection with calls in flight


def server_options(
    max_message_bytes: int, reuse_port: bool = False, limits: ServingLimits | None = None
) -> list[tuple[str, int]]:
    """Our clients ping long-lived streams every KEEPALIVE_MS to notice a frozen
    peer: the server must take pings that often while calls are open, or, at
    its default of one per 5 minutes, it answers the third with GOAWAY
    too_many_pings and every long-lived stream (the router's to the cache and
    to the batcher) breaks every few minutes. Pings on a connection with no
    call are not taken: such a connection is idle, and closes after
    max_connection_idle_s. The port is the process's own (a second server on
    it fails to bind, rather than silently sharing its callers) unless
    `reuse_port` asks for SO_REUSEPORT."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", int(reuse_port)),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS * 2 // 3),
        ("grpc.keepalive_permit_without_calls", 0),
    ]
    if limits is not None:
        options.append(("grpc.max_concurrent_streams", limits.max_concurrent_streams))
        for option, seconds in (
            ("grpc.max_connection_idle_ms", limits.max_connection_idle_s),
            ("grpc.max_connection_age_ms", limits.max_connection_age_s),
            ("grpc.max_connection_age_grace_ms", limits.max_connection_age_grace_s),
        ):
            if seconds > 0:
                options.append((option, max(1, min(int(1000 * seconds), 2**31 - 1))))
    return options


MAX_RECONNECT_BACKOFF_MS = 2_000


def client_options(max_message_bytes: int = 64 * 1024 * 1024) -> list[tuple[str, int]]:
    """Channel options of every internal hop. Keepalive pings let long-lived
    streams notice a peer that stopped answering (frozen, or gone without a FIN).
    Reconnecting backs off to 2 s at most, not gRPC's default of 120 s: after a
    restart (a model server loading its models for a minute, a batcher rolled)
    the hop serves again within a poll or two, not minutes later."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 0),  # servers refuse those pings (server_options)
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


def add_health_and_reflection(
    server: grpc.aio.Server | ErrorHandledServer, service_names: list[str]
) -> health.aio.HealthServicer:
    """Serves grpc.health.v1 (overall and per service; grpc_health starts the
    overall status "" as SERVING, so a service not ready at once sets it
    first) and server reflection for `service_names`."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
        pool=_MethodAwarePool(descriptor_pool.Default()),
    )
    return health_servicer


class _MethodAwarePool:
    """The default descriptor pool, except that a method's full name resolves to
    its service's file. ghz asks reflection for `pkg.Service.Method`, which the
    upb pool does not resolve, so ghz could not find any of our methods."""

    def __init__(self, pool):
        self._pool = pool

    def FindFileContainingSymbol(self, symbol: str):
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            service, _, method = symbol.rpartition(".")
            if not service:
                raise
            descriptor = self._pool.FindServiceByName(service)  # KeyError when unknown
            if method not in descriptor.methods_by_name:
                raise
            return descriptor.file

    def __getattr__(self, name):
        return getattr(self._pool, name)


async def set_serving(health_servicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


def announce(service: str, **addresses) -> None:
    """Prints the one line a launcher waits for: the service is up and where."""
    print(json.dumps({"ready": service, **addresses}), flush=True)


# Sent by a pod's preStop hook (mesh/kubernetes): readiness turns false while the
# service still answers, so callers move away before SIGTERM starts the drain.
WITHDRAW_SIGNAL = signal.SIGUSR1


async def run_until_signal(
    server: grpc.aio.Server,
    health_servicer,
    grace_s: float,
    on_stop: Callable[[], object] | None = None,
    draining: asyncio.Event | None = None,
) -> None:
    """Waits for SIGTERM or SIGINT, then drains: health NOT_SERVING, `draining`
    set (long-lived streams end once idle), stop taking new calls, let
    in-flight ones finish within grace_s, then run on_stop. WITHDRAW_SIGNAL
    before it turns health NOT_SERVING for good while serving on, so that
    readiness fails and the pod leaves its endpoints before the drain."""
    frozen = collector.freeze_startup_heap()  # what the service built before serving lives as long as it does
    log.info("%d objects built at startup are out of the garbage collector's walks", frozen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    withdrawals: set[asyncio.Future] = set()

    def withdraw() -> None:
        log.info("withdrawn: health NOT_SERVING, still serving until SIGTERM")
        withdrawal = asyncio.ensure_future(health_servicer.enter_graceful_shutdown())
        withdrawals.add(withdrawal)
        withdrawal.add_done_callback(withdrawals.discard)

    loop.add_signal_handler(WITHDRAW_SIGNAL, withdraw)
    termination = asyncio.ensure_future(server.wait_for_termination())
    try:
        await asyncio.wait([termination, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    finally:
        loop.remove_signal_handler(WITHDRAW_SIGNAL)
    log.info("draining (grace %.1fs)", grace_s)
    await health_servicer.enter_graceful_shutdown()
    if draining is not None:
        draining.set()
    await server.stop(grace_s)
    if on_stop is not None:
        result = on_stop()
        if asyncio.iscoroutine(result):
            await result
    log.info("stopped")


def configure_logging(level: str, service: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [{service}] %(name)s: %(message)s",
    )


def die_with_parent() -> None:
    """Asks the kernel for SIGTERM when the process that started this one ends
    (PR_SET_PDEATHSIG), where the launcher asked for it (DIE_WITH_PARENT names
    its pid); a parent already gone ends this process now."""
    parent = os.environ.get(DIE_WITH_PARENT)
    if not parent:
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)


# Set by the launcher (services/launcher/mesh.py) for the services it starts: each asks
# for its own death signal as it starts, since code run between fork and exec
# (preexec_fn) makes Python fork a process whose gRPC threads are running, and the
# child may then abort in gRPC's poller.
DIE_WITH_PARENT = "INFERMESH_DIE_WITH_PARENT"


def main(config_cls, env_prefix: str, serve, description: str) -> int:
    """The whole of a service's __main__: parse and check the config once,
    configure logging, run `serve(config)` until a signal drains it."""
    parser = argparse.ArgumentParser(description=description)
    add_dataclass_arguments(parser, config_cls, env_prefix)
    # Every service takes the same tracing flags (INFERMESH_OTLP_ENDPOINT, ...): one setting for a whole mesh.
    add_dataclass_arguments(parser, tracing.TracingConfig, "INFERMESH_")
    try:
        namespace = parser.parse_args()
        config = from_arguments(config_cls, namespace)
        tracing_config = from_arguments(tracing.TracingConfig, namespace)
    except ValueError as exc:
        parser.error(str(exc))
    die_with_parent()  # a local mesh's service ends with its launcher
    name = env_prefix.removeprefix("INFERMESH_").rstrip("_").lower()
    configure_logging(config.log_level, name)
    collector.measure_pauses()
    tracing.configure(f"infermesh-{name.replace('_', '-')}", tracing_config)
    try:
        asyncio.run(serve(config))
    finally:
        tracing.shutdown()  # what is buffered is sent before the process ends
    return 0
