"""The lease wire format end to end: what the gateway encodes from stored turns, the trainer decodes to the
same numbers (docs/http-api.md "POST /v1/batches"). Both sides import `rollway_common.wire`; this pins the two
paths that use it (gateway.samples -> JSON -> trainer.client) to each other.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

import orjson
import pytest

from gateway.samples import session_sequences
from gateway.store.store import TurnRow
from rollway_common.wire import decode_array, encode_array, pack
from trainer.client import parse_group


def turn(turn_id: str, parent: str | None, prompt_delta: list[int], completion: list[int],
         logprobs: list[float], versions: list[int]) -> TurnRow:
    """A stored turn as the gateway writes it (token arrays packed little-endian)."""
    return TurnRow(
        id=turn_id, seq=0, parent_id=parent, request={}, reply={},
        prompt_ids=pack(prompt_delta, "int32"), completion_ids=pack(completion, "int32"),
        logprobs=pack(logprobs, "float32"), versions=pack(versions, "int32"),
        temperature=0.7, finish_reason="stop", continuity="extends" if parent else "new-chain",
        chain_reason=None, client_disconnected=False, reward=None, prompt_len=len(prompt_delta), timings={},
    )


def test_trainer_decodes_what_the_gateway_encodes() -> None:
    # Two turns of one chain; ids above 2**16 (Qwen's vocabulary), logprobs exact in float32.
    rows = [
        turn("t1", None, [1, 2, 3], [151643, 7], [-0.5, -0.25], [3, 3]),
        turn("t2", "t1", [9], [10], [-1.0], [4]),
    ]
    (seq,) = session_sequences(rows)
    group = {"group_id": "g", "task": {"prompt": "x"},
             "sessions": [{"session_id": "s", "reward": 1.0, "state": "finished"}],
             "samples": [seq.wire("g", "s", 1.0, lease_format=1)]}
    leased = parse_group(orjson.loads(orjson.dumps(group)))  # the trainer's side of POST /v1/batches
    (sample,) = leased.samples
    assert sample.token_ids == [1, 2, 3, 151643, 7, 9, 10]
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 1]  # the model's tokens only
    assert sample.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, -1.0]
    assert sample.versions == [-1, -1, -1, 3, 3, -1, 4]  # -1 where masked
    assert sample.returns == [0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert (sample.group_id, sample.session_id, sample.reward, sample.temperature) == ("g", "s", 1.0, 0.7)


def test_wire_bytes_are_little_endian_whatever_the_machine() -> None:
    """The documented byte layout, written out by hand (struct's '<' is little-endian on every machine)."""
    assert base64.b64decode(encode_array([1, -1], "int32")["b64"]) == struct.pack("<2i", 1, -1)
    assert base64.b64decode(encode_array([0.5], "float32")["b64"]) == struct.pack("<f", 0.5)
    assert base64.b64decode(encode_array([0, 1, 255], "uint8")["b64"]) == bytes([0, 1, 255])
    wire: Any = {"dtype": "int32", "b64": base64.b64encode(struct.pack("<3i", 7, 0, -2)).decode()}
    assert decode_array(wire) == [7, 0, -2]


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown wire dtype 'int64'"):
        decode_array({"dtype": "int64", "b64": ""})  # type: ignore[typeddict-item]
