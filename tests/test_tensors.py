"""The tensor codec: BYTES framing, row concatenation and splitting."""

import numpy as np
import pytest

from services.common import errors
from services.common.tensors import (
    TensorData,
    concat_rows,
    count_bytes_elements,
    from_numpy,
    pack_bytes_elements,
    split_bytes_elements,
    split_rows,
    to_numpy,
)

pytestmark = pytest.mark.unit


def test_bytes_elements_round_trip_including_empty_and_non_latin():
    items = [b"", "héllo wörld".encode(), "你好".encode(), b"\x00\xff"]
    assert split_bytes_elements(pack_bytes_elements(items), "t") == items


@pytest.mark.parametrize(
    "data, fragment",
    [
        (b"\x01\x00", "cannot hold a 4-byte length prefix"),
        (b"\x05\x00\x00\x00abc", "declares length 5"),
        (pack_bytes_elements([b"ok"]) + b"\x01", "trailing byte"),
    ],
)
def test_malformed_bytes_framing_is_invalid_argument_naming_the_tensor(data, fragment):
    with pytest.raises(errors.InvalidArgument, match=fragment) as info:
        split_bytes_elements(data, "input 'TEXT'")
    assert "input 'TEXT'" in info.value.message


def test_fixed_size_rows_concatenate_and_split_back():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(6, 15, dtype=np.float32).reshape(3, 3)
    batch = concat_rows([from_numpy("X", a), from_numpy("X", b)])
    assert batch.shape == (5, 3)
    first, second = split_rows(batch, [2, 3])
    np.testing.assert_array_equal(to_numpy(first), a)
    np.testing.assert_array_equal(to_numpy(second), b)


def test_bytes_rows_concatenate_and_split_back():
    a = from_numpy("T", np.array([b"x", b"yy"], dtype=object))
    b = from_numpy("T", np.array([b"zzz"], dtype=object))
    batch = concat_rows([a, b])
    assert batch.shape == (3,)
    assert [t.data for t in split_rows(batch, [2, 1])] == [a.data, b.data]


def test_split_rejects_counts_that_do_not_add_up():
    with pytest.raises(ValueError, match="has 2 rows"):
        split_rows(TensorData("X", "FP32", (2, 1), b"\0" * 8), [1, 2])


def test_counting_bytes_elements_checks_the_same_framing():
    assert count_bytes_elements(pack_bytes_elements([b"", b"ab", b"c"]), "t") == 3
    with pytest.raises(errors.InvalidArgument, match="element 1 declares length 9"):
        count_bytes_elements(pack_bytes_elements([b"a"]) + b"\x09\x00\x00\x00ab", "t")
