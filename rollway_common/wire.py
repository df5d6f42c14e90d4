"""Wire format of token arrays: `{"dtype": "int32" | "float32" | "uint8", "b64": ...}`, little-endian.

The gateway produces it (leases, docs/http-api.md "POST /v1/batches") and stores the same bytes (turn rows);
the trainer decodes it with `decode_array`. It lives here, in the leaf package `rollway_common` (every install has it; it imports nothing of ours),
so that the trainer reads it without importing the gateway: the trainer reaches the gateway only over HTTP.
Only the standard library here: the gateway carries no numpy/torch on its hot path.
"""

from __future__ import annotations

import base64
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Literal, TypedDict

LEASE_FORMAT = 2
"""The lease's shape (docs/http-api.md "POST /v1/batches"), asked for with `lease_format`: 2 carries each
sample's turns (`turn_ends`, `completion_starts`, `turn_rewards`) and the trainer computes returns; 1 (what a
request without `lease_format` gets) carries per-token `returns` computed by the gateway."""
LEASE_FORMATS = (1, 2)
INT32_MAX = 2**31 - 1
"""The largest int32: token ids and weight versions travel and are stored as int32 arrays."""

Dtype = Literal["int32", "float32", "uint8"]
_TYPECODE: dict[str, str] = {"int32": "i", "float32": "f", "uint8": "B"}
_BIG_ENDIAN = sys.byteorder == "big"


class WireArray(TypedDict):
    dtype: Dtype
    b64: str


def pack(values: Sequence[int] | Sequence[float], dtype: Dtype) -> bytes:
    """Little-endian bytes of `values` as `dtype`.

    A list goes through `struct` (little-endian by its format): `array(code, list)` converts each item through
    an argument parser, ~4x the cost, and this runs for every array of every stored turn. What `struct` refuses
    (an item out of range or of another type) goes the `array` way, which raises or converts as it always did."""
    code = _TYPECODE[dtype]
    if isinstance(values, list):
        try:
            return struct.pack(f"<{len(values)}{code}", *values)
        except (struct.error, OverflowError):
            pass
    arr = array(code, values)
    if _BIG_ENDIAN and dtype != "uint8":
        arr.byteswap()
    return arr.tobytes()


def int32_array(values: Sequence[int]) -> array[int]:
    """`array("i", values)` (native order), through `struct` for a list as `pack` does."""
    if isinstance(values, list):
        try:
            out = array("i")
            out.frombytes(struct.pack(f"={len(values)}i", *values))
            return out
        except (struct.error, OverflowError):
            pass
    return array("i", values)


def unpack(data: bytes, dtype: Dtype) -> list[int] | list[float]:
    """Inverse of `pack`."""
    arr = array(_TYPECODE[dtype])
    arr.frombytes(data)
    if _BIG_ENDIAN and dtype != "uint8":
        arr.byteswap()
    return arr.tolist()


def encode_array(values: Sequence[int] | Sequence[float], dtype: Dtype) -> WireArray:
    return {"dtype": dtype, "b64": base64.b64encode(pack(values, dtype)).decode("ascii")}


def decode_array(obj: WireArray) -> list[int] | list[float]:
    dtype = obj["dtype"]
    if dtype not in _TYPECODE:
        raise ValueError(f"unknown wire dtype {dtype!r}")
    return unpack(base64.b64decode(obj["b64"]), dtype)


def turn_returns(rewards: list[float | None], session_reward: float | None, gamma: float) -> list[float]:
    """Per turn of one chain: the discounted sum of its and later turns' rewards when any turn has one, else the
    session reward (0 without one). The one definition: the gateway uses it for lease format 1's returns, the
    trainer for format 2's (it computes them itself)."""
    if not any(r is not None for r in rewards):
        return [float(session_reward or 0.0)] * len(rewards)
    out = [0.0] * len(rewards)
    acc = 0.0
    for i in range(len(rewards) - 1, -1, -1):
        acc = float(rewards[i] or 0.0) + gamma * acc
        out[i] = acc
    return out
