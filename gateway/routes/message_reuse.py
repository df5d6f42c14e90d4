"""Chat messages sent again, validated and converted once.

An agent replays its whole conversation with every call, so a long session's request is mostly messages the
gateway validated (pydantic) and converted (`message_dict`) on the previous call, byte for byte. Both cost
microseconds per message, which grew a session's per-call CPU with its length. `MessageReuse` keeps the
validated `ChatMessage` of each message by its exact JSON (orjson's serialisation of the decoded message:
the same JSON validates to the same model, whatever body it came in) and each one's converted dict by its
index (the dict depends on the index only through default tool-call ids). A message seen before is handed to
pydantic as its model, which pydantic takes as it is; a new one is validated as before, with the same error
and the same location in the body. Nothing else changes: what is recorded is what the conversion gives.

Memory: the JSON of the messages kept, at most MAX_BYTES for the process (least recently used out first),
plus their models and dicts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import orjson

MAX_BYTES = 64 << 20
"""The most message JSON kept (about the replayed history of a few hundred long sessions)."""
MIN_MESSAGES = 8
"""Requests with fewer messages are validated as they are (short calls: nothing to save)."""


class MessageReuse:
    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._models: OrderedDict[bytes, Any] = OrderedDict()
        self._dicts: dict[int, dict[int, dict[str, Any]]] = {}
        """id of a kept model -> its converted dict by message index (an entry for each kept model, removed with
        it: the model is alive while kept, so its id is its own)."""
        self._bytes = 0

    def swap(self, data: dict[str, Any], name: str = "messages") -> list[bytes | None] | None:
        """Replace, in the decoded body `data`, each message kept before by its model; the messages' JSON keys
        (None where a message is not a plain JSON object), for `keep` once the body validated."""
        messages = data.get(name)
        if not isinstance(messages, list) or len(messages) < MIN_MESSAGES:
            return None
        keys: list[bytes | None] = []
        models = self._models
        for i, m in enumerate(messages):
            key = None
            if type(m) is dict:
                try:
                    key = orjson.dumps(m)
                except (TypeError, orjson.JSONEncodeError):
                    key = None
                if key is not None:
                    model = models.get(key)
                    if model is not None:
                        messages[i] = model
                        models.move_to_end(key)
            keys.append(key)
        return keys

    def keep(self, keys: list[bytes | None], validated: list[Any]) -> list[Any]:
        """Keep the validated models of the messages whose JSON `swap` read. Returns `validated` with the model
        kept for each message's JSON in its place (another one was kept for it meanwhile: two sessions sent the
        same message at once), the models whose conversions are kept (`converted`)."""
        models = self._models
        out = list(validated)
        for i, (key, model) in enumerate(zip(keys, validated, strict=True)):
            if key is None:
                continue
            kept = models.get(key)
            if kept is not None:
                out[i] = kept
                continue
            models[key] = model
            self._dicts.setdefault(id(model), {})
            self._bytes += len(key)
        while self._bytes > self.max_bytes and models:
            old, model = models.popitem(last=False)
            self._bytes -= len(old)
            self._dicts.pop(id(model), None)
        return out

    def converted(self, model: Any, index: int, convert: Callable[[Any, int], dict[str, Any]]) -> dict[str, Any]:
        """`convert(model, index)`, once per kept model and index (a model not kept is converted each time)."""
        done = self._dicts.get(id(model))
        if done is None:
            return convert(model, index)
        out = done.get(index)
        if out is None:
            out = done[index] = convert(model, index)
        return out
