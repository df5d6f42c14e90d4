"""SGLang's side of the wire, as the client (`gateway.sglang`) reads it: the errors it raises, a generation's result
and stream chunks, the event-stream reader, and the parsing of `/generate` answers and of SGLang's error shapes into
those errors (the module docstring of `gateway.sglang` says which error means what)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson

# Transport failures that say nothing about the request: another backend may well succeed.
TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)


class BackendError(Exception):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class BackendUnavailable(BackendError):
    pass


class BackendRejected(BackendError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message, status)


@dataclass(slots=True)
class GenResult:
    """One finished (or aborted) generation. Logprob lists are as long as `output_ids`."""

    output_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    """Per output position: (token id, logprob) pairs, best first; [] where the server sent null."""
    finish_reason: dict[str, Any] | None
    """SGLang's raw dict: {"type": "stop"|"length"|"abort", "matched"|"length"|"message": ...}."""
    weight_version: str | None
    prompt_tokens: int
    cached_tokens: int
    rid: str

    @property
    def finish_type(self) -> str | None:
        return None if self.finish_reason is None else self.finish_reason.get("type")


@dataclass(slots=True)
class GenChunk(GenResult):
    """One streamed step: the tokens new since the previous chunk (maybe none); the last has finish_reason."""


_R = TypeVar("_R", bound=GenResult)


# -- parsing ---------------------------------------------------------------------------------------


class SSEReader:
    """Splits an event stream into `data:` payloads. Events can be far longer than aiohttp's line
    limit (a cumulative chunk carries every logprob so far), so this buffers by itself."""

    __slots__ = ("_buf", "_eof", "_resp", "_url")

    def __init__(self, resp: aiohttp.ClientResponse, url: str) -> None:
        self._resp = resp
        self._url = url
        self._buf = bytearray()
        self._eof = False

    async def next(self) -> bytes | None:
        """The next event's data, or None at the end of the body."""
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0 and self._eof:
                if not self._buf:
                    return None
                end = len(self._buf)  # a last event without its blank line
            if end >= 0:
                event = bytes(self._buf[:end])
                del self._buf[: end + 2]
                if (data := _event_data(event)) is not None:
                    return data
                continue
            try:
                piece = await self._resp.content.readany()
            except TRANSPORT_ERRORS as e:
                raise BackendUnavailable(f"{self._url}/generate: stream broken: {e!r}") from e
            if piece:
                self._buf += piece
            else:
                self._eof = True

    async def drain(self) -> bool:
        """Read to the end of the body so the connection can be reused; False if that failed."""
        try:
            await self._resp.content.read()
        except TRANSPORT_ERRORS:  # recovery: the stream is complete; only connection reuse is lost
            return False
        return True


PARTIAL = "-partial"
"""The suffix of the version a server reports while it holds part of an update (gateway/weight_sync.py marks it)."""


def whole_version(res: _R, url: str) -> _R:
    """`res`, unless a server holding part of an update produced it: requests parked in SGLang's tokenizer manager
    during a pause are out of reach of `abort_all` and run once it continues, on a mix of two versions. Such tokens
    are never served nor recorded: BackendUnavailable takes the backend out and the reply goes on elsewhere."""
    if res.weight_version is not None and res.weight_version.endswith(PARTIAL):
        raise BackendUnavailable(f"{url} generated on a partially updated model (version {res.weight_version}): "
                                 "its tokens are discarded")
    return res


def _event_data(event: bytes) -> bytes | None:
    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def stream_chunk(obj: dict[str, Any], seen: int) -> GenChunk:
    """The increment in a cumulative or incremental chunk, `seen` tokens in (see the module docstring)."""
    try:
        total = int(obj["meta_info"]["completion_tokens"])
    except (KeyError, TypeError, ValueError) as e:
        raise BackendUnavailable(f"stream chunk without meta_info.completion_tokens: {e!r}") from e
    if total < seen:
        raise BackendUnavailable(f"completion_tokens went back from {seen} to {total}")
    return parse_answer(obj, GenChunk, total=total, new=total - seen)


def _tail(items: list[Any], total: int | None, new: int | None, what: str) -> list[Any]:
    """The last `new` items of a cumulative list, or the whole of an incremental one."""
    if total is None or new is None or len(items) == new:
        return items
    if len(items) == total:
        return items[total - new :]
    raise BackendUnavailable(f"stream chunk has {len(items)} {what} for {total} tokens of which {new} are new")


def parse_answer(obj: dict[str, Any], cls: type[_R], *, total: int | None = None, new: int | None = None) -> _R:
    try:
        meta = obj["meta_info"]
        ids = _tail(obj["output_ids"], total, new, "output_ids")
        lp = meta.get("output_token_logprobs")
        logprobs = None if lp is None else [float(t[0]) for t in _tail(lp, total, new, "logprobs")]
        top = meta.get("output_top_logprobs")
        if top is not None:
            top = [[(int(t[1]), float(t[0])) for t in row or ()] for row in _tail(top, total, new, "top")]
        version = meta.get("weight_version")
        return cls(
            output_ids=[int(t) for t in ids],
            logprobs=logprobs,
            top_logprobs=top,
            finish_reason=meta.get("finish_reason"),
            weight_version=None if version is None else str(version),
            prompt_tokens=int(meta.get("prompt_tokens") or 0),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            rid=str(meta.get("id", "")),
        )
    except (KeyError, TypeError, ValueError, IndexError) as e:
        # A 200 this client cannot read is that server failing (a proxy's error page, a broken build), not
        # the request: the pool fails over to another backend.
        raise BackendUnavailable(f"malformed /generate answer: {e!r}") from e


def loads_answer(data: bytes, where: str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:  # as in parse_answer: the server failing, not the request
        raise BackendUnavailable(f"{where}: not JSON: {data[:200]!r}") from e


WEIGHT_SESSION_SINCE = (0, 5, 21)
"""The first SGLang with `/begin_weight_update` and `/end_weight_update`, and the demand for them."""


def has_weight_session(version: str) -> bool:
    """Whether a server of this `/server_info` version has the weight-update session (an unknown one: assume so,
    a 404 on begin says otherwise)."""
    parts = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if parts is None:
        return True
    return tuple(int(x) for x in parts.groups()) >= WEIGHT_SESSION_SINCE


def error_message(body: bytes) -> str:
    """The message of any of SGLang's error shapes: {"error": {"message"}}, {"error": "<text>"},
    {"object": "error", "message", "code"}, FastAPI's {"detail"}, or the body as text."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:2000].decode("utf-8", "replace").strip()
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if key in obj:
                return obj[key] if isinstance(obj[key], str) else orjson.dumps(obj[key]).decode()
    return orjson.dumps(obj).decode()[:2000]


def status_error(status: int, body: bytes, url: str) -> BackendError:
    message = error_message(body)
    # Busy, broken, redirecting, or refusing this gateway's key (401, 403: SGLang's `--api-key` scheme, a
    # configuration of that server's): not the request, which another backend may well serve.
    if status >= 500 or status in (401, 403, 408, 429) or status < 400:
        return BackendUnavailable(f"{url}: HTTP {status}: {message}", status)
    return BackendRejected(status, message)


def abort_error(finish: dict[str, Any] | None) -> BackendError | None:
    """The error an abort finish reason with an HTTP status carries (SGLang's `FINISH_ABORT(message, status_code)`:
    a grammar that does not compile, 400; a failed step, 500), else None (a plain abort is resubmitted). A streamed
    call gets it as its last chunk, with HTTP 200 (`TokenizerManager._handle_abort_finish_reason`): it is the
    same error a non-streamed call gets as its HTTP status."""
    if not finish or finish.get("type") != "abort":
        return None
    status = finish.get("status_code")
    if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status < 600:
        return None
    return status_error(status, orjson.dumps({"error": {"message": str(finish.get("message") or "")}}),
                         "/generate")


def event_error(obj: dict[str, Any]) -> BackendError:
    """An `error` event: SGLang sends it for what a non-streaming call answers with 400."""
    err = obj["error"]
    code = err.get("code") if isinstance(err, dict) else obj.get("code")
    status = code if isinstance(code, int) and code >= 400 else 400
    return status_error(status, orjson.dumps(obj), "/generate stream")
