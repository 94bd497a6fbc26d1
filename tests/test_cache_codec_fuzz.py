"""A fuzz test of the cache's value codec: whatever bytes a cache level hands
back (foreign, truncated, bit-flipped, a zstd bomb), decode returns tensors
that agree with their own shapes or raises CorruptValue, nothing else; and
every value it can encode decodes back exactly."""

import struct

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.cache import codec
from services.common.tensors import (
    DATATYPES,
    NUMPY_DTYPES,
    TensorData,
    count_bytes_elements,
    element_count,
    pack_bytes_elements,
)
from tests.conftest import fuzz_examples

pytestmark = pytest.mark.unit
# make test runs 1000 examples per property; make test-fast fewer (tests/conftest.py, fuzz_examples).
FUZZ = settings(max_examples=fuzz_examples(1000), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw) -> TensorData:
    name = draw(st.text(max_size=12))
    datatype = draw(st.sampled_from(sorted(DATATYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    if datatype == "BYTES":
        data = pack_bytes_elements(
            draw(st.lists(st.binary(max_size=8), min_size=element_count(shape), max_size=element_count(shape)))
        )
    else:
        data = draw(
            st.binary(
                min_size=element_count(shape) * NUMPY_DTYPES[datatype].itemsize,
                max_size=element_count(shape) * NUMPY_DTYPES[datatype].itemsize,
            )
        )
    return TensorData(name, datatype, shape, data)


def _encodings(draw) -> bytes:
    values = draw(st.lists(tensors(), min_size=1, max_size=4))
    return codec.encode(values, compress=draw(st.booleans()), fp16=draw(st.booleans()))


@st.composite
def damaged(draw) -> bytes:
    """A real encoding, then cut, flipped, spliced or extended."""
    value = bytearray(_encodings(draw))
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["cut", "flip", "splice", "extend", "count"]))
        at = draw(st.integers(0, max(len(value) - 1, 0)))
        if how == "cut":
            del value[at:]
        elif how == "flip" and value:
            value[at] ^= 1 << draw(st.integers(0, 7))
        elif how == "splice":
            value[at:at] = draw(st.binary(max_size=16))
        elif how == "extend":
            value += draw(st.binary(max_size=16))
        elif len(value) >= 6:  # the tensor count or the flags
            value[draw(st.sampled_from([4, 5]))] = draw(st.integers(0, 255))
    return bytes(value)


def _decodes_or_is_corrupt(value: bytes) -> None:
    try:
        decoded = codec.decode(value)
    except codec.CorruptValue:
        return
    for t in decoded:  # what it returns is whole: the router serves it as it is
        assert isinstance(t, TensorData) and t.datatype in DATATYPES and all(d >= 0 for d in t.shape)
        if t.datatype == "BYTES":
            assert count_bytes_elements(t.data, t.name) == element_count(t.shape)
        else:
            assert len(t.data) == element_count(t.shape) * NUMPY_DTYPES[t.datatype].itemsize


@FUZZ
@given(st.binary(max_size=512))
def test_foreign_bytes_decode_or_raise_corrupt_value(value):
    _decodes_or_is_corrupt(value)


@FUZZ
@given(st.binary(max_size=256), st.integers(0, 3), st.integers(0, 255))
def test_bytes_behind_the_magic_decode_or_raise_corrupt_value(body, flags, count):
    _decodes_or_is_corrupt(codec.MAGIC + bytes([flags, count]) + body)


@FUZZ
@given(damaged())
def test_damaged_encodings_decode_or_raise_corrupt_value(value):
    _decodes_or_is_corrupt(value)


@FUZZ
@given(st.lists(tensors(), min_size=1, max_size=4), st.booleans())
def test_every_encodable_value_decodes_back_exactly(values, compress):
    assert codec.decode(codec.encode(values, compress=compress)) == values


@pytest.mark.parametrize("dims", [(2**62, 4), (-1,), (2**63 - 1, 2**63 - 1)])
def test_dims_that_overflow_or_are_negative_are_corrupt(dims):
    header = struct.pack(f"<H1sB4sB{len(dims)}qI", 1, b"X", 4, b"FP32", len(dims), *dims, 0)
    with pytest.raises(codec.CorruptValue):
        codec.decode(codec.MAGIC + bytes([0, 1]) + header)


def test_a_zstd_bomb_is_corrupt_not_unpacked():
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (codec.MAX_VALUE_BYTES + 1))
    with pytest.raises(codec.CorruptValue):
        codec.decode(codec.MAGIC + bytes([codec.ZSTD, 1]) + bomb)
    stream = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (codec.MAX_VALUE_BYTES + 1))
    with pytest.raises(codec.CorruptValue):
        codec.decode(codec.MAGIC + bytes([codec.ZSTD, 1]) + stream)


def test_an_fp16_body_of_odd_length_is_corrupt():
    body = struct.pack("<H1sB9sB1qI", 1, b"X", 9, b"FP16>FP32", 1, 1, 3) + b"\0\0\0"
    with pytest.raises(codec.CorruptValue):
        codec.decode(codec.MAGIC + bytes([codec.FP16, 1]) + body)


def _raw_value(name: bytes, datatype: bytes, shape: tuple[int, ...], data: bytes) -> bytes:
    """One tensor in the value format, written by hand (encode refuses what it should not hold)."""
    header = struct.pack(
        f"<H{len(name)}sB{len(datatype)}sB{len(shape)}qI",
        len(name),
        name,
        len(datatype),
        datatype,
        len(shape),
        *shape,
        len(data),
    )
    return codec.MAGIC + bytes([0, 1]) + header + data


@FUZZ
@given(st.lists(st.binary(max_size=8), max_size=4), st.integers(0, 6), st.integers(0, 40))
def test_bytes_tensors_whose_framing_disagrees_with_their_shape_are_corrupt(items, rows, cut):
    data = pack_bytes_elements(items)[:cut]
    _decodes_or_is_corrupt(_raw_value(b"T", b"BYTES", (rows,), data))


def test_a_bytes_tensor_framing_fewer_elements_than_its_shape_is_corrupt():
    with pytest.raises(codec.CorruptValue):
        codec.decode(_raw_value(b"T", b"BYTES", (3,), pack_bytes_elements([b"a"])))
    with pytest.raises(codec.UnstorableValue):
        codec.encode([TensorData("T", "BYTES", (3,), pack_bytes_elements([b"a"]))])
