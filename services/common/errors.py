"""Domain errors, each naming the gRPC status it becomes at the transport edge.

The core modules raise these; they never import grpc. `code` is the numeric
grpc.StatusCode value, so an error can also travel inside a stream message.
"""

from collections.abc import Iterable

# A status's trailing metadata, as grpc gives it: (key, value) pairs, or None.
Trailers = Iterable[tuple[str, str | bytes]] | None

MAX_MESSAGE_CHARS = 2000  # a status message travels in a header, which gRPC caps at 16 KiB
SHOWN_CHARS = 120  # of one value a caller sent, echoed in a message
SHOWN_ITEMS = 8  # of a list of them


def shown(value: str) -> str:
    """A value the caller sent, quoted for a message: cut short when long, so
    that an error about it is not itself too large to send."""
    if len(value) <= SHOWN_CHARS:
        return repr(value)
    return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"


def shown_list(values: Iterable[object]) -> str:
    """A list of values the caller sent, for a message: the first few, each cut short."""
    values = list(values)
    listed = ", ".join(shown(str(v)) for v in values[:SHOWN_ITEMS])
    more = f", and {len(values) - SHOWN_ITEMS} more" if len(values) > SHOWN_ITEMS else ""
    return f"[{listed}{more}]"


def clipped(message: str) -> str:
    """A whole status message, cut to what a header carries."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... (message cut at {MAX_MESSAGE_CHARS} of {len(message)} characters)"


class InfermeshError(Exception):
    """Base of every error a caller may see; the message says what to fix."""

    code = 13  # INTERNAL
    code_name = "INTERNAL"
    retryable = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(InfermeshError):
    """INVALID_ARGUMENT: a tensor, shape, datatype or parameter is wrong."""

    code = 3
    code_name = "INVALID_ARGUMENT"


class DeadlineExceeded(InfermeshError):
    """DEADLINE_EXCEEDED: the request's deadline passed before it could run."""

    code = 4
    code_name = "DEADLINE_EXCEEDED"


class NotFound(InfermeshError):
    """NOT_FOUND: no such model or version."""

    code = 5
    code_name = "NOT_FOUND"


# A refusal's retry hint travels as this trailer (gRPC status) or the Error message's
# field (stream); the refusing side leaves this much of the caller's time for the
# refusal itself to arrive, even on a busy machine.
RETRY_AFTER_METADATA = "retry-after-ms"
REFUSAL_MARGIN_S = 0.025


def retry_after_ms(trailing_metadata: Trailers) -> int:
    """The retry hint a status carried in its trailers, 0 without one."""
    value = next((value for key, value in (trailing_metadata or ()) if key == RETRY_AFTER_METADATA), "")
    return int(value) if value.isdigit() else 0


# Every status one of our servers sends carries this trailer (the status's code
# name), so that a client can tell it from one gRPC made up for a connection that
# failed or a stream that was lost, whatever either's message says.
ERROR_METADATA = "infermesh-error"


def is_server_status(trailing_metadata: Trailers) -> bool:
    """Whether one of our servers sent the status (see ERROR_METADATA)."""
    return any(key == ERROR_METADATA for key, _ in (trailing_metadata or ()))


class ResourceExhausted(InfermeshError):
    """RESOURCE_EXHAUSTED: a queue is full or a request too large; Envoy does not
    count it as a server failure, so busy replicas are not ejected. A queue
    that is full says when to come back (`retry_after_ms`)."""

    code = 8
    code_name = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class FailedPrecondition(InfermeshError):
    """FAILED_PRECONDITION: the operation cannot run in the current state, e.g.
    a model version that fails verification, or model control that is off."""

    code = 9
    code_name = "FAILED_PRECONDITION"


class Internal(InfermeshError):
    """INTERNAL: a bug or an unexpected failure; details are in the log."""

    code = 13
    code_name = "INTERNAL"


class Unavailable(InfermeshError):
    """UNAVAILABLE: the model is not loaded or no replica is ready; retryable."""

    code = 14
    code_name = "UNAVAILABLE"
    retryable = True


class PermissionDenied(InfermeshError):
    """PERMISSION_DENIED: the operation is disabled or not allowed."""

    code = 7
    code_name = "PERMISSION_DENIED"


class Unauthenticated(InfermeshError):
    """UNAUTHENTICATED: the operation needs credentials that were missing or wrong."""

    code = 16
    code_name = "UNAUTHENTICATED"


class Cancelled(InfermeshError):
    """CANCELLED: the caller went away."""

    code = 1
    code_name = "CANCELLED"


class Unimplemented(InfermeshError):
    """UNIMPLEMENTED: this service does not offer the operation (the message says who does)."""

    code = 12
    code_name = "UNIMPLEMENTED"


BY_CODE: dict[int, type[InfermeshError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        ResourceExhausted,
        Internal,
        Unavailable,
        Cancelled,
        PermissionDenied,
        Unauthenticated,
        FailedPrecondition,
        Unimplemented,
    )
}


def from_code(code: int, message: str, retry_after_ms: int = 0) -> InfermeshError:
    """Rebuilds the domain error that a stream message or a status carried."""
    if code == ResourceExhausted.code:
        return ResourceExhausted(message, retry_after_ms)
    return BY_CODE.get(code, Internal)(message)
