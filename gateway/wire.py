"""The gateway's name for the wire format of token arrays, which lives in `rollway.wire` so that the
trainer can decode leases without importing the gateway."""

from rollway.wire import (
    LEASE_FORMAT,
    LEASE_FORMATS,
    Dtype,
    WireArray,
    decode_array,
    encode_array,
    pack,
    unpack,
)

__all__ = ["LEASE_FORMAT", "LEASE_FORMATS", "Dtype", "WireArray", "decode_array", "encode_array", "pack", "unpack"]
