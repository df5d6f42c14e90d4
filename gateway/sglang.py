"""Async client for one SGLang server's native HTTP API (the subset in docs/sglang-contract.md).

One `SGLangClient` per server; all of them share the gateway's one `aiohttp.ClientSession` (made in
`gateway.app.create_app`) for streams and control calls (aiohttp keeps a proxied request near 0.3 ms of
gateway CPU, several times less than httpx). The non-streaming `/generate`, one per agent turn, goes over a
lean keep-alive client of the server's own (`gateway.http1`: ~0.03 ms instead of aiohttp's ~0.1 ms).

Exceptions (the pool fails over on `BackendUnavailable`; the app maps the rest to HTTP in one place):

    BackendError              the server answered something this client cannot use (a batch's list)
    ├── BackendUnavailable    connection refused/reset, timeout, truncated body or stream, 5xx, 408, 429,
    │                         a 200 that is not JSON or not a /generate answer: the server is the problem;
    │                         retry the request on another backend
    └── BackendRejected       any other 4xx, an SSE `error` event, `success: false`: the request itself
                              is bad and fails the same way anywhere. `.status`, `.message` (the server's)

`gateway.pool.NoBackendAvailable` (a BackendError too) means every backend was tried.

Streaming is normalized: whether a server streams cumulative chunks (the default) or deltas
(`--incremental-streaming-output`, in some versions with cumulative logprobs), `generate_stream` yields
only the new tokens of each chunk. The mode is read per chunk and per list from
`meta_info.completion_tokens`, which is cumulative in both modes. `text` is never read: servers run with
`--skip-tokenizer-init` send none.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any, Literal

import aiohttp
import orjson

from gateway.http1 import BadResponse, Http1Client
from gateway.sglang_wire import (
    PARTIAL,
    TRANSPORT_ERRORS,
    WEIGHT_SESSION_SINCE,
    BackendError,
    BackendRejected,
    BackendUnavailable,
    GenChunk,
    GenResult,
    SSEReader,
    abort_error,
    error_message,
    event_error,
    has_weight_session,
    loads_answer,
    parse_answer,
    status_error,
    stream_chunk,
    whole_version,
)

log = logging.getLogger(__name__)
PauseMode = Literal["abort", "retract", "in_place"]
_JSON_HEADERS = {"Content-Type": "application/json"}
NORMAL_ROUTES = frozenset({"/generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info"})
"""The routes this client calls that SGLang 0.5.23 marks NORMAL (`--api-key` only; every other route it calls is
ADMIN_OPTIONAL: `--admin-api-key` when the server has one, else `--api-key`; /health is open):
`sglang.srt.utils.auth.decide_request_auth` and the `@auth_level` marks in its http_server.py."""

__all__ = [
    "NORMAL_ROUTES",
    "PARTIAL",
    "WEIGHT_SESSION_SINCE",
    "BackendError",
    "BackendRejected",
    "BackendUnavailable",
    "GenChunk",
    "GenResult",
    "PauseMode",
    "SGLangClient",
    "has_weight_session",
]


class SGLangClient:
    """Client for one server. `connect_timeout` bounds connecting, `read_timeout` each wait for bytes
    of a generation (long: one reply can take minutes), `control_timeout` a whole control call,
    `health_timeout` one health probe."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 600.0,
        control_timeout: float = 60.0,
        health_timeout: float = 5.0,
        api_key: str = "",
        admin_api_key: str = "",
    ) -> None:
        self.url = url.rstrip("/")
        self._session = session
        # SGLang's scheme: `Authorization: Bearer <key>`, the API key on NORMAL routes, the admin key (else the
        # API key) on the admin ones. An empty key sends no header, as for a server started without keys.
        api = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        admin = {"Authorization": f"Bearer {admin_api_key or api_key}"} if admin_api_key or api_key else {}
        self._normal_headers = {**_JSON_HEADERS, **api}
        self._admin_headers = {**_JSON_HEADERS, **admin}
        self._http1 = Http1Client(self.url, connect_timeout=connect_timeout, headers=api)
        self._read_timeout_s = read_timeout
        self._connect_timeout = connect_timeout
        self._gen_timeout = self._read_timeout(read_timeout)
        self._control_timeout = aiohttp.ClientTimeout(total=control_timeout, sock_connect=connect_timeout)
        self._health_timeout = aiohttp.ClientTimeout(total=health_timeout, sock_connect=connect_timeout)
        self.paused = False
        """Set when this client sent `/pause_generation`, cleared once `/continue_generation` succeeded: while it is
        set the liveness probe is `/ping`, never `/health` (which blocks on a paused server, `probe`)."""
        self.resume_pending = False
        """A `/continue_generation` was sent after a pause and has not succeeded yet (the server was unreachable)."""
        self.weight_session: bool | None = None
        """Whether the server has `/begin_weight_update` (SGLang 0.5.21+): None until known (`weight_session_open`)."""

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r})"

    def _read_timeout(self, read_timeout: float | None) -> aiohttp.ClientTimeout:
        if read_timeout is None:
            return self._gen_timeout
        return aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout, sock_read=read_timeout)

    # -- generation --------------------------------------------------------------------------------

    async def generate(self, payload: dict[str, Any], *, read_timeout: float | None = None) -> GenResult:
        """POST /generate for one prompt (flat `input_ids`, n = 1). An abort partial comes back as a
        result with `finish_type == "abort"`, not as an error."""
        url = self.url + "/generate"
        body = orjson.dumps({**payload, "stream": False}, option=orjson.OPT_SERIALIZE_NUMPY)
        timeout = self._read_timeout_s if read_timeout is None else read_timeout
        try:
            status, data = await self._http1.post("/generate", body, timeout=timeout)
        except (TimeoutError, OSError, BadResponse) as e:  # refused, reset, timed out, cut short, not HTTP
            raise BackendUnavailable(f"{url}: {e!r}") from e
        if status >= 400:
            raise status_error(status, data, url)
        obj = loads_answer(data, "/generate")
        if not isinstance(obj, dict):
            raise BackendError("/generate answered a list: send one prompt with n = 1")
        result = whole_version(parse_answer(obj, GenResult), self.url)
        if (error := abort_error(result.finish_reason)) is not None:
            raise error
        return result

    def close(self) -> None:
        """Close this client's idle connections (the aiohttp session is the caller's)."""
        self._http1.close()

    async def generate_stream(
        self, payload: dict[str, Any], *, read_timeout: float | None = None
    ) -> AsyncGenerator[GenChunk, None]:
        """POST /generate with `stream: true`, yielding normalized increments.

        Closing the iterator early (`aclose()`, or leaving `contextlib.aclosing`) closes the
        connection, which makes SGLang abort the request."""
        resp = await self._open_stream({**payload, "stream": True}, self._read_timeout(read_timeout))
        clean = False
        try:
            events = SSEReader(resp, self.url)
            seen, finished = 0, False
            while (data := await events.next()) is not None:
                if data == b"[DONE]":
                    clean = await events.drain()
                    break
                obj = loads_answer(data, "/generate stream")
                if not isinstance(obj, dict):
                    raise BackendUnavailable(f"{self.url}/generate: a stream event that is not an object")
                if "error" in obj:
                    raise event_error(obj)
                chunk = whole_version(stream_chunk(obj, seen), self.url)
                if (error := abort_error(chunk.finish_reason)) is not None:
                    raise error
                seen += len(chunk.output_ids)
                finished = chunk.finish_reason is not None
                yield chunk
            if not finished:
                raise BackendUnavailable(f"{self.url}/generate: stream ended before the last chunk")
        finally:
            # An unfinished stream must not go back to the pool: closing it aborts the request.
            if clean:
                resp.release()
            else:
                resp.close()

    # -- control -----------------------------------------------------------------------------------

    async def abort(self, rid: str, *, abort_all: bool = False) -> None:
        """Abort requests whose rid starts with `rid` (or all of them)."""
        await self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause(self, mode: PauseMode = "abort") -> None:
        self.paused, self.resume_pending = True, False  # before the call: one that timed out may still take effect
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def continue_(self) -> None:
        try:
            await self._call("POST", "/continue_generation", {})
        except BaseException:  # failed (or cancelled): the health loop tries again once the server answers
            self.resume_pending = True  # not while the call is in flight: the loop would send a second continue
            raise
        self.paused = self.resume_pending = False

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str, *, abort_all_requests: bool = False
    ) -> None:
        """Load an HF folder readable by the server (and flush its cache). BackendRejected on `success:
        false`. Loading takes a while, and an unpaused server first waits for its running requests."""
        body: dict[str, Any] = {"model_path": model_path, "weight_version": weight_version}
        body["abort_all_requests"] = abort_all_requests
        obj = loads_answer(await self._call("POST", "/update_weights_from_disk", body, self._gen_timeout), "update")
        if not (isinstance(obj, dict) and obj.get("success")):
            raise BackendRejected(200, error_message(orjson.dumps(obj)))

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """POST /load_lora_adapter: SGLang's LoRAUpdateOutput `{success, error_message, loaded_adapters}`;
        BackendRejected on `success: false` (HTTP 400: not loadable, name taken, rank or modules not served)."""
        body = {"lora_name": lora_name, "lora_path": lora_path}
        obj = loads_answer(await self._call("POST", "/load_lora_adapter", body, self._gen_timeout), "load_lora_adapter")
        if not (isinstance(obj, dict) and obj.get("success")):
            raise BackendRejected(200, error_message(orjson.dumps(obj)))
        return obj

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """POST /unload_lora_adapter: answers once the requests using it ended. BackendRejected when the name
        is not loaded (400 `success: false`)."""
        body = {"lora_name": lora_name}
        obj = loads_answer(await self._call("POST", "/unload_lora_adapter", body, self._gen_timeout), "unload_lora_adapter")
        if not (isinstance(obj, dict) and obj.get("success")):
            raise BackendRejected(200, error_message(orjson.dumps(obj)))
        return obj

    async def weight_call(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """POST one of the process-group weight endpoints, which answer `{success, message}` (docs/sglang-contract.md
        "The process-group path"), within `timeout` seconds. BackendRejected on `success: false`."""
        limit = aiohttp.ClientTimeout(total=timeout, sock_connect=self._connect_timeout)
        obj = loads_answer(await self._call("POST", path, body, limit), path)
        if not isinstance(obj, dict) or obj.get("success") is False:
            raise BackendRejected(200, error_message(orjson.dumps(obj)))
        return obj

    async def weight_session_open(self, timeout: float) -> bool:
        """`POST /begin_weight_update`, which SGLang 0.5.21+ demands around `/update_weights_from_distributed` and
        `/update_weights_from_tensor` (`srt/managers/scheduler_components/weight_updater.py`). True when a session
        is now open; False for a server without the routes (older than 0.5.21 by `/server_info`'s `version`, or a
        404 on begin), which takes the updates without one. A session left open (a publisher that died
        mid-session: "already open") is ended and begun again, once. BackendRejected if it still refuses."""
        if self.weight_session is None:
            try:
                self.weight_session = has_weight_session(str((await self.server_info()).get("version") or ""))
            except BackendError:  # no server info: the 404 on begin decides
                self.weight_session = True
        if not self.weight_session:
            return False
        try:
            await self.weight_call("/begin_weight_update", {}, timeout)
        except BackendRejected as e:
            if e.status == 404:
                self.weight_session = False
                return False
            if "already open" not in e.message:
                raise
            log.warning("%s: a weight-update session was left open; ending it and beginning again", self.url)
            await self.weight_call("/end_weight_update", {}, timeout)
            await self.weight_call("/begin_weight_update", {}, timeout)
        return True

    async def memory_occupation(self, action: Literal["release", "resume"], tags: list[str] | None,
                                timeout: float) -> None:
        """`POST /release_memory_occupation` or `/resume_memory_occupation` with SGLang's `{tags}` body (a colocated
        trainer's step, docs/scaling.md "One device"). SGLang answers 200 with no body, 400 with an error."""
        limit = aiohttp.ClientTimeout(total=timeout, sock_connect=self._connect_timeout)
        await self._call("POST", f"/{action}_memory_occupation", {"tags": tags}, limit)

    async def weight_session_close(self, timeout: float) -> None:
        """`POST /end_weight_update` (after a failed update too: a session left open refuses the next begin)."""
        await self.weight_call("/end_weight_update", {}, timeout)

    async def model_info(self) -> dict[str, Any]:
        return await self._get_json("/model_info", "/get_model_info")

    async def server_info(self) -> dict[str, Any]:
        return await self._get_json("/server_info", "/get_server_info")

    async def health(self) -> bool:
        """True iff GET /health answers 200; never raises for an unreachable server."""
        try:  # never redirected: a probe that followed one would report on whatever it leads to
            async with self._session.get(self.url + "/health", timeout=self._health_timeout,
                                         allow_redirects=False) as resp:
                await resp.read()
                return resp.status == 200
        except (*TRANSPORT_ERRORS, aiohttp.ClientError, ValueError):  # recovery: unreachable, or a URL no
            return False  # client can use (a registry row written before URLs were checked) is not healthy

    async def ping(self) -> bool:
        """Liveness: True iff GET /ping answers 200 (SGLang 0.5.20+: a flag check, 200 while paused; 503 once the
        server was marked unhealthy or shuts down). A server without /ping (404) is alive if it answers at all."""
        try:
            async with self._session.get(self.url + "/ping", timeout=self._health_timeout,
                                         headers=self._normal_headers) as resp:  # a NORMAL route: the API key
                await resp.read()
                return resp.status in (200, 404)
        except (*TRANSPORT_ERRORS, aiohttp.ClientError, ValueError):  # recovery: not alive
            return False

    async def probe(self) -> bool:
        """The liveness policy (docs/architecture.md "Liveness"): `/ping` while this client has the server paused
        (SGLang's `/health` runs a one-token generation, which waits out a pause or a weight load for
        SGLANG_HEALTH_CHECK_TIMEOUT = 20 s, then answers 503 and marks the server unhealthy, after which `/ping`
        and `/ready` answer 503 too); `/health` otherwise, which also proves the server generates."""
        return await (self.ping() if self.paused else self.health())

    async def flush_cache(self) -> bool:
        """Flush the prefix cache. False when the server refused because requests are running."""
        try:
            await self._call("GET", "/flush_cache", None)  # 0.4 servers take GET only
        except BackendRejected as e:
            if e.status == 400:
                return False
            raise
        return True

    # -- plumbing ----------------------------------------------------------------------------------

    async def _get_json(self, path: str, legacy_path: str) -> dict[str, Any]:
        try:
            data = await self._call("GET", path, None)
        except BackendRejected as e:
            if e.status != 404:
                raise
            data = await self._call("GET", legacy_path, None)  # servers before the rename
        obj = loads_answer(data, path)
        if not isinstance(obj, dict):
            raise BackendError(f"{self.url}{path}: expected a JSON object")
        return obj

    async def _open_stream(
        self, body: dict[str, Any], timeout: aiohttp.ClientTimeout
    ) -> aiohttp.ClientResponse:
        """POST /generate and return the open 200 response; any other answer raises the mapped error."""
        url = self.url + "/generate"
        try:
            resp = await self._session.post(
                url, data=orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), headers=self._normal_headers,
                timeout=timeout, allow_redirects=False,
            )
            if resp.status < 300:
                return resp
            raw = await resp.read()
        except TRANSPORT_ERRORS as e:
            raise BackendUnavailable(f"{url}: {e!r}") from e
        resp.release()
        raise status_error(resp.status, raw, url)

    async def _call(
        self, method: str, path: str, body: Any, timeout: aiohttp.ClientTimeout | None = None
    ) -> bytes:
        """One request; returns the body of a 2xx answer, raises the mapped error otherwise."""
        url = self.url + path
        data = None if body is None else orjson.dumps(body)
        try:
            headers = self._normal_headers if path in NORMAL_ROUTES else self._admin_headers
            async with self._session.request(
                method, url, data=data, headers=headers, timeout=timeout or self._control_timeout,
                allow_redirects=False,
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except TRANSPORT_ERRORS as e:
            raise BackendUnavailable(f"{url}: {e!r}") from e
        if status >= 300:  # a redirect is followed nowhere (a registered URL is the server, not a signpost)
            raise status_error(status, raw, url)
        return raw
