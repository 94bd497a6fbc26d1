"""Pathological ModelInferRequests: messages of up to 16 MB built to be slow to
parse or check, each with the field its refusal must name.

The messages are serialised once (a client sends them as bytes), so that what
a flood of them costs is the server's work, not the client's.
"""

import dataclasses
import struct

from inference import grpc_predict_v2_pb2 as pb

SIZE_BYTES = 16 * 1024 * 1024 - 64 * 1024  # within the router's default max_request_bytes (16 MiB)


@dataclasses.dataclass(frozen=True)
class Attack:
    """One kind of pathological request: its bytes and what its refusal names."""

    kind: str
    raw: bytes
    names: str  # a fragment the refusal's message must hold: the field or input at fault


def empty_bytes_raw(size: int = SIZE_BYTES) -> Attack:
    """minilm's TEXT of shape [1] whose raw contents hold millions of empty BYTES elements."""
    request = pb.ModelInferRequest(model_name="minilm", id="empty-bytes-raw")
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", 0) * (size // 4))
    return Attack("empty_bytes_raw", request.SerializeToString(), "TEXT")


def empty_bytes_typed(size: int = SIZE_BYTES) -> Attack:
    """minilm's TEXT of shape [1] whose typed bytes_contents hold millions of empty elements (2 bytes each)."""
    request = pb.ModelInferRequest(model_name="minilm", id="empty-bytes-typed")
    tensor = request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.extend([b""] * (size // 2))
    return Attack("empty_bytes_typed", request.SerializeToString(), "TEXT")


def long_text(size: int = 15 * 1024 * 1024) -> Attack:
    """One text of `size` bytes (15 MB by default) in minilm's TEXT."""
    request = pb.ModelInferRequest(model_name="minilm", id="long-text")
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", size) + b"a" * size)
    return Attack("long_text", request.SerializeToString(), "TEXT")


def many_inputs(size: int = SIZE_BYTES) -> Attack:
    """About a million tiny inputs (each a name, a datatype and one dimension)."""
    one = pb.ModelInferRequest()
    one.inputs.add(name="x", datatype="FP32", shape=[1])
    each = len(one.SerializeToString())
    request = pb.ModelInferRequest(model_name="mlp", id="many-inputs")
    for _ in range(size // each):
        request.inputs.add(name="x", datatype="FP32", shape=[1])
    return Attack("many_inputs", request.SerializeToString(), "inputs")


KINDS = {
    "empty_bytes_raw": empty_bytes_raw,
    "empty_bytes_typed": empty_bytes_typed,
    "long_text": long_text,
    "many_inputs": many_inputs,
}


def all_attacks(scale: float = 1.0) -> list[Attack]:
    """One Attack of each kind, of `scale` times its full size."""
    return [
        build(int((15 * 1024 * 1024 if kind == "long_text" else SIZE_BYTES) * scale)) for kind, build in KINDS.items()
    ]
