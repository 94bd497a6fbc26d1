"""The tensor codec: Open Inference Protocol datatypes as raw little-endian bytes.

BYTES tensors hold each element as a 4-byte little-endian length and the bytes.
Fixed-size tensors are C-ordered rows, so a batch is a concatenation of bytes
and splitting it back is slicing: no decode on the batching path.
"""

import dataclasses
import math
import struct
from collections.abc import Sequence

import numpy as np

from services.common.errors import InvalidArgument

NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
DATATYPES = frozenset(NUMPY_DTYPES) | {"BYTES"}
_LENGTH = struct.Struct("<I")


@dataclasses.dataclass(frozen=True, slots=True)
class TensorData:
    """One tensor: name, OIP datatype, shape (batch first) and raw bytes."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1


def element_count(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _bytes_spans(view: memoryview, what: str, count: int | None = None):
    """(offset, length) of each length-prefixed BYTES element, `count` of them
    at most; raises InvalidArgument naming `what` where the framing is broken."""
    offset = index = 0
    size = len(view)
    unpack = _LENGTH.unpack_from
    while offset < size and index != count:
        if offset + 4 > size:
            raise InvalidArgument(
                f"{what}: malformed BYTES contents: {size - offset} trailing byte(s) at offset {offset} "
                "cannot hold a 4-byte length prefix"
            )
        (length,) = unpack(view, offset)
        offset += 4
        if offset + length > size:
            raise InvalidArgument(
                f"{what}: malformed BYTES contents: element {index} declares length {length} "
                f"at offset {offset - 4} but only {size - offset} byte(s) remain"
            )
        yield offset, length
        offset += length
        index += 1


def split_bytes_elements(data: bytes, what: str) -> list[bytes]:
    """Parses length-prefixed BYTES elements; `what` names the tensor in errors."""
    view = memoryview(data)
    return [bytes(view[offset : offset + length]) for offset, length in _bytes_spans(view, what)]


def count_bytes_elements(data: bytes, what: str) -> int:
    """Checks the framing of BYTES contents and counts the elements, copying nothing."""
    return sum(1 for _ in _bytes_spans(memoryview(data), what))


def check_bytes_elements(data: bytes, shape, what: str, max_element_bytes: int | None = None) -> None:
    """Checks that BYTES contents hold exactly the shape's element count, each
    framed and of at most `max_element_bytes`. The walk stops at that count:
    its cost is the shape's, never that of what a caller appended."""
    count = element_count(shape)
    view = memoryview(data)
    offset = seen = 0
    for offset, length in _bytes_spans(view, what, count):
        if max_element_bytes is not None and length > max_element_bytes:
            raise InvalidArgument(
                f"{what}: element {seen} is {length} bytes long; the limit is {max_element_bytes} bytes per element"
            )
        seen += 1
        offset += length
    if seen < count:
        raise InvalidArgument(f"{what} holds {seen} BYTES element(s) but shape {list(shape)} needs {count}")
    if offset < len(view):
        raise InvalidArgument(
            f"{what} holds more than {count} BYTES element(s): shape {list(shape)} holds {count}, "
            f"and {len(view) - offset} byte(s) follow element {count - 1}"
        )


def check_tensor_data(tensor: "TensorData", what: str, max_element_bytes: int | None = None) -> None:
    """Checks that a tensor's data holds what its shape and datatype say (see
    check_bytes_elements); `what` names the tensor in errors."""
    if tensor.datatype == "BYTES":
        check_bytes_elements(tensor.data, tensor.shape, what, max_element_bytes)
        return
    need = element_count(tensor.shape) * NUMPY_DTYPES[tensor.datatype].itemsize
    if len(tensor.data) != need:
        raise InvalidArgument(
            f"{what} has {len(tensor.data)} bytes of data but shape {list(tensor.shape)} of "
            f"{tensor.datatype} needs {need}"
        )


def check_tensor_size(tensor: "TensorData", what: str) -> None:
    """The checks of check_tensor_data that cost nothing per element: a numeric
    tensor's exact size, and room for a BYTES tensor's length prefixes."""
    count = element_count(tensor.shape)
    if tensor.datatype == "BYTES":
        if len(tensor.data) < 4 * count:
            raise InvalidArgument(
                f"{what} has {len(tensor.data)} bytes of data, too few for the {count} BYTES "
                f"element(s) of shape {list(tensor.shape)} (4 bytes of length each at least)"
            )
        return
    need = count * NUMPY_DTYPES[tensor.datatype].itemsize
    if len(tensor.data) != need:
        raise InvalidArgument(
            f"{what} has {len(tensor.data)} bytes of data but shape {list(tensor.shape)} of "
            f"{tensor.datatype} needs {need}"
        )


def bytes_elements(tensors) -> int:
    """How many BYTES elements the shapes of `tensors` hold: what checking them walks."""
    return sum(element_count(t.shape) for t in tensors if t.datatype == "BYTES")


PACK_INLINE_ITEMS = 64  # below this a join per item is faster than numpy's set-up
PACK_CHUNK_ITEMS = 16384  # each a C-level step of a few milliseconds: a thread packing many lets others run between


def pack_bytes_elements(items: list[bytes]) -> bytes:
    """Length-prefixes and concatenates `items`: numpy scatters the prefixes,
    a chunk of items at a time."""
    if len(items) < PACK_INLINE_ITEMS:
        return b"".join(_LENGTH.pack(len(item)) + item for item in items)
    if len(items) > PACK_CHUNK_ITEMS:
        return b"".join(
            pack_bytes_elements(items[start : start + PACK_CHUNK_ITEMS])
            for start in range(0, len(items), PACK_CHUNK_ITEMS)
        )
    lengths = np.fromiter(map(len, items), dtype="<u4", count=len(items))
    out = np.empty(4 * len(items) + int(lengths.sum(dtype=np.int64)), dtype=np.uint8)
    starts = np.zeros(len(items), dtype=np.int64)  # where each prefix goes
    np.cumsum(lengths[:-1].astype(np.int64) + 4, out=starts[1:])
    prefix_at = (starts[:, None] + np.arange(4)).reshape(-1)
    out[prefix_at] = lengths.view(np.uint8)
    is_data = np.ones(len(out), dtype=bool)
    is_data[prefix_at] = False
    out[is_data] = np.frombuffer(b"".join(items), dtype=np.uint8)
    return out.tobytes()


def to_numpy(tensor: TensorData) -> np.ndarray:
    """Decodes a tensor; BYTES become an object array of bytes."""
    if tensor.datatype == "BYTES":
        items = split_bytes_elements(tensor.data, f"tensor '{tensor.name}'")
        array = np.empty(len(items), dtype=object)
        array[:] = items
        return array.reshape(tensor.shape)
    return np.frombuffer(tensor.data, dtype=NUMPY_DTYPES[tensor.datatype]).reshape(tensor.shape)


def from_numpy(name: str, array: np.ndarray, datatype: str | None = None) -> TensorData:
    """Encodes an array; object or string arrays become BYTES."""
    if datatype == "BYTES" or array.dtype == object or array.dtype.kind in "SU":
        items = [item.encode() if isinstance(item, str) else bytes(item) for item in array.reshape(-1)]
        return TensorData(name, "BYTES", tuple(array.shape), pack_bytes_elements(items))
    if datatype is None:
        datatype = next(k for k, v in NUMPY_DTYPES.items() if v == array.dtype.newbyteorder("<"))
    data = np.ascontiguousarray(array, dtype=NUMPY_DTYPES[datatype]).tobytes()
    return TensorData(name, datatype, tuple(array.shape), data)


def concat_rows(parts: list[TensorData]) -> TensorData:
    """Concatenates tensors of one name along the batch dimension."""
    first = parts[0]
    rows = sum(part.rows for part in parts)
    return TensorData(first.name, first.datatype, (rows, *first.shape[1:]), b"".join(part.data for part in parts))


def split_rows(tensor: TensorData, counts: list[int]) -> list[TensorData]:
    """Splits a batched tensor back into consecutive slices of `counts` rows."""
    if sum(counts) != tensor.rows:
        raise ValueError(f"tensor '{tensor.name}' has {tensor.rows} rows, cannot split into {counts}")
    tail = tensor.shape[1:]
    per_row = element_count(tail)
    parts = []
    if tensor.datatype == "BYTES":
        items = split_bytes_elements(tensor.data, f"tensor '{tensor.name}'")
        start = 0
        for count in counts:
            chunk = items[start * per_row : (start + count) * per_row]
            parts.append(TensorData(tensor.name, "BYTES", (count, *tail), pack_bytes_elements(chunk)))
            start += count
        return parts
    row_bytes = per_row * NUMPY_DTYPES[tensor.datatype].itemsize
    start = 0
    for count in counts:
        parts.append(
            TensorData(
                tensor.name,
                tensor.datatype,
                (count, *tail),
                tensor.data[start * row_bytes : (start + count) * row_bytes],
            )
        )
        start += count
    return parts
