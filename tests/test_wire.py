"""rollway_common.wire: `pack` through `struct` gives the bytes, the errors and the conversions `array` gives."""

from __future__ import annotations

import sys
from array import array
from typing import Any

import pytest

from rollway_common.wire import decode_array, encode_array, int32_array, pack, unpack

CODES = {"int32": "i", "float32": "f", "uint8": "B"}


def _as_array(values: Any, dtype: str) -> bytes:
    arr = array(CODES[dtype], values)
    if sys.byteorder == "big" and dtype != "uint8":
        arr.byteswap()
    return arr.tobytes()


@pytest.mark.parametrize(("values", "dtype"), [
    ([1, 2, 2**31 - 1, -(2**31)], "int32"), ([], "int32"), ([True, 3], "int32"),
    ([0.5, -1.25, float("-inf"), 1e300, 3], "float32"), ([0, 255], "uint8"),
])
def test_pack_is_the_little_endian_array(values: list[Any], dtype: Any) -> None:
    assert pack(values, dtype) == _as_array(values, dtype)  # a list: through struct
    assert pack(tuple(values), dtype) == _as_array(values, dtype)  # anything else: through array
    assert unpack(pack(values, dtype), dtype) == array(CODES[dtype], values).tolist()
    assert decode_array(encode_array(values, dtype)) == array(CODES[dtype], values).tolist()


@pytest.mark.parametrize(("values", "dtype"), [([2**31], "int32"), ([1.5], "int32"), ([256], "uint8"),
                                               (["x"], "float32"), ([None], "int32")])
def test_pack_refuses_what_array_refuses(values: list[Any], dtype: Any) -> None:
    with pytest.raises(Exception) as expected:
        array(CODES[dtype], values)
    with pytest.raises(expected.type):
        pack(values, dtype)


def test_int32_array_is_array_i() -> None:
    for values in ([1, -2, 2**31 - 1], [], (5, 6)):
        assert int32_array(values) == array("i", values)
    with pytest.raises(OverflowError):
        int32_array([2**31])
