"""Free loopback ports for processes that must be told theirs (Jaeger, etcd, peers)."""

import contextlib
import socket


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports on 127.0.0.1 (held together while chosen, so none repeats)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
