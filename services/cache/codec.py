"""The cache's value format: a compact, self-describing and safe encoding of a
list of tensors (name, datatype, shape, raw bytes) — never pickle: decoding
a foreign or corrupt value can fail, never execute anything.

    magic "IMC1" | flags u8 | count u8 | per tensor:
        name_len u16 | name | dtype_len u8 | dtype | ndim u8 | dims i64 × ndim | data_len u32 | data

flags bit 0: the body after the header is zstd-compressed (kept only when it
saves ≥ 5%; embeddings barely compress). bit 1: FP32 tensors were stored as
FP16 and are widened back on read (an L2 option; see bench/cache_store.py);
a tensor with a finite value beyond FP16's range stays FP32.
"""

import struct

import numpy as np
import zstandard

from services.common import errors
from services.common.tensors import DATATYPES, NUMPY_DTYPES, TensorData, count_bytes_elements, element_count

MAGIC = b"IMC1"
ZSTD = 1
FP16 = 2
_HEAD = struct.Struct("<4sBB")
_compressor = zstandard.ZstdCompressor(level=3)
_decompressor = zstandard.ZstdDecompressor()
MAX_VALUE_BYTES = 64 << 20


MAX_TENSORS = 255


class CorruptValue(ValueError):
    """A stored value that is not ours or is damaged: treated as a miss."""


class UnstorableValue(ValueError):
    """Tensors this format cannot hold, or that contradict their own shape."""


def check(tensors: list[TensorData]) -> None:
    """Raises UnstorableValue unless `tensors` would decode back as they are."""
    if not 1 <= len(tensors) <= MAX_TENSORS:
        raise UnstorableValue(f"holds {len(tensors)} tensors; 1 to {MAX_TENSORS} fit")
    for t in tensors:
        name = errors.shown(t.name)
        if len(t.name.encode()) > 0xFFFF or t.datatype not in DATATYPES or len(t.shape) > 0xFF:
            raise UnstorableValue(f"tensor {name} has datatype {errors.shown(t.datatype)} and {len(t.shape)} dims")
        if any(d < 0 for d in t.shape) or len(t.data) > 0xFFFFFFFF:
            raise UnstorableValue(f"tensor {name} has shape {list(t.shape)} and {len(t.data)} bytes")
        if t.datatype != "BYTES" and len(t.data) != element_count(t.shape) * NUMPY_DTYPES[t.datatype].itemsize:
            raise UnstorableValue(
                f"tensor {name} holds {len(t.data)} bytes; {t.datatype} of shape "
                f"{list(t.shape)} needs {element_count(t.shape) * NUMPY_DTYPES[t.datatype].itemsize}"
            )
        if t.datatype == "BYTES" and _bytes_elements(t.data) != element_count(t.shape):
            raise UnstorableValue(f"tensor {name} of shape {list(t.shape)} does not frame that many BYTES elements")


def encode(tensors: list[TensorData], compress: bool = False, fp16: bool = False) -> bytes:
    """Raises UnstorableValue (see `check`) for tensors it cannot hold."""
    check(tensors)
    flags = 0
    parts = []
    for t in tensors:
        datatype, data = t.datatype, t.data
        if fp16 and datatype == "FP32":
            wide = np.frombuffer(data, "<f4")
            with np.errstate(over="ignore"):  # an overflow is checked for just below
                narrow = wide.astype("<f2")
            # Only a tensor whose finite values stay finite: beyond ±65504 FP16 has only inf.
            if not np.any(np.isinf(narrow) & np.isfinite(wide)):
                data, datatype = narrow.tobytes(), "FP16>FP32"
                flags |= FP16
        name = t.name.encode()
        dtype = datatype.encode()
        parts.append(
            struct.pack(
                f"<H{len(name)}sB{len(dtype)}sB{len(t.shape)}qI",
                len(name),
                name,
                len(dtype),
                dtype,
                len(t.shape),
                *t.shape,
                len(data),
            )
        )
        parts.append(data)
    body = b"".join(parts)
    if compress:
        packed = _compressor.compress(body)
        if len(packed) <= 0.95 * len(body):
            body, flags = packed, flags | ZSTD
    return _HEAD.pack(MAGIC, flags, len(tensors)) + body


def decode(value: bytes) -> list[TensorData]:
    try:
        magic, flags, count = _HEAD.unpack_from(value, 0)
    except struct.error:
        raise CorruptValue(f"value of {len(value)} bytes is too short for a header") from None
    if magic != MAGIC:
        raise CorruptValue(f"value does not start with {MAGIC!r}")
    body = value[_HEAD.size :]
    if flags & ZSTD:
        try:
            body = _decompressor.decompress(body, max_output_size=MAX_VALUE_BYTES)
        except zstandard.ZstdError as exc:
            raise CorruptValue(f"zstd body does not decompress: {exc}") from None
    try:
        return _tensors(memoryview(body), count)
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise CorruptValue(f"malformed value: {exc}") from None


def _tensors(body: memoryview, count: int) -> list[TensorData]:
    out = []
    offset = 0
    for _ in range(count):
        (name_len,) = struct.unpack_from("<H", body, offset)
        offset += 2
        name = bytes(body[offset : offset + name_len]).decode()
        offset += name_len
        (dtype_len,) = struct.unpack_from("<B", body, offset)
        offset += 1
        datatype = bytes(body[offset : offset + dtype_len]).decode()
        offset += dtype_len
        (ndim,) = struct.unpack_from("<B", body, offset)
        offset += 1
        shape = struct.unpack_from(f"<{ndim}q", body, offset)
        offset += 8 * ndim
        (data_len,) = struct.unpack_from("<I", body, offset)
        offset += 4
        if offset + data_len > len(body):
            raise ValueError(f"tensor '{name}' declares {data_len} bytes, {len(body) - offset} remain")
        data = bytes(body[offset : offset + data_len])
        offset += data_len
        if datatype == "FP16>FP32":
            data = np.frombuffer(data, "<f2").astype("<f4").tobytes()
            datatype = "FP32"
        if datatype not in DATATYPES or any(d < 0 for d in shape):
            raise ValueError(f"tensor '{name}' has datatype {datatype!r} and shape {list(shape)}")
        if datatype != "BYTES" and len(data) != element_count(shape) * NUMPY_DTYPES[datatype].itemsize:
            raise ValueError(f"tensor '{name}' holds {len(data)} bytes, shape {list(shape)} needs more or fewer")
        if datatype == "BYTES" and _bytes_elements(data) != element_count(shape):
            raise ValueError(f"tensor '{name}' of shape {list(shape)} does not frame that many BYTES elements")
        out.append(TensorData(name, datatype, tuple(shape), data))
    if offset != len(body):
        raise ValueError(f"{len(body) - offset} trailing bytes")
    return out


def _bytes_elements(data: bytes) -> int | None:
    """How many length-prefixed elements `data` frames; None where its framing is broken."""
    try:
        return count_bytes_elements(data, "a cached BYTES tensor")
    except errors.InvalidArgument:
        return None
