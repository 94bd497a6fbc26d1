"""How a failed call to a model server is read: the replica gone, a status it
sent, our own deadline; what is worth a try elsewhere; the domain error."""

import grpc

from services.common import errors

# How grpc reports a connection that failed or a stream that was lost, as
# opposed to a status our servers sent.
TRANSPORT_MARKERS = (
    "failed to connect",
    "socket closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "goaway",
    "stream removed",
    "connect failed",
)


def retry_elsewhere(exc: grpc.aio.AioRpcError) -> bool:
    """Down or without a ready version of the model, or refused for being busy
    (our servers' refusals carry a retry hint)."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE or (
        exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and errors.retry_after_ms(exc.trailing_metadata()) > 0
    )


def domain_error(exc: grpc.aio.AioRpcError) -> errors.InfermeshError:
    """The model server's status as our error, with its retry hint when it sent
    one (a refused batch carries `retry-after-ms` in its trailers)."""
    code = exc.code()
    return errors.from_code(code.value[0], exc.details() or code.name, errors.retry_after_ms(exc.trailing_metadata()))


def local_origin(exc: grpc.aio.AioRpcError) -> bool:
    """A failure on our side of the call: the connection failed, or our own
    deadline ran out (gRPC's own "Deadline Exceeded"; a server that sends
    DEADLINE_EXCEEDED says more than that)."""
    return transport_failure(exc) or (
        exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and (exc.details() or "") == "Deadline Exceeded"
    )


def gone(exc: grpc.aio.AioRpcError) -> bool:
    """The replica is not there: nothing listens, or the connection was torn
    down. A ping or a handshake that timed out is not that: a starved process
    misses those too."""
    details = (exc.details() or "").lower()
    return transport_failure(exc) and not any(slow in details for slow in ("ping timeout", "keepalive", "timed out"))


def transport_failure(exc: grpc.aio.AioRpcError) -> bool:
    """gRPC's UNAVAILABLE for a connection or stream that failed; never a
    status our server sent, whose message may quote such a failure of its own."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE or errors.is_server_status(exc.trailing_metadata()):
        return False
    details = (exc.details() or "").lower()
    return any(marker in details for marker in TRANSPORT_MARKERS)
