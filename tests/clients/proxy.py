"""A recording proxy between the gateway and the engine (the approach of tests/e2e/test_tool_agent.py).

It forwards every request unchanged, streams included, and keeps each /generate exchange: the input ids
the gateway sent, the output ids the engine answered and the sampling params (where a grammar shows), so
a test can compare what the gateway stored with what the engine produced.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any


class RecordingProxy:
    """An aiohttp server in a thread that forwards everything to `target`."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.records: list[dict[str, Any]] = []
        self.url = ""
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="recording-proxy", daemon=True)
        self._runner: Any = None
        self._session: Any = None

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()

    def generate_records(self, since: int = 0, timeout: float = 30.0) -> list[dict[str, Any]]:
        """The /generate exchanges recorded so far (from index `since`), once none is in flight: a streamed
        reply reaches the client before the proxy has read the engine's end of stream and recorded it."""
        with self._idle:
            assert self._idle.wait_for(lambda: self._in_flight == 0, timeout), "a /generate still in flight"
            return list(self.records[since:])

    def mark(self) -> int:
        return len(self.generate_records())

    async def _start(self) -> None:
        from aiohttp import ClientSession, ClientTimeout, web

        self._session = ClientSession(timeout=ClientTimeout(total=None, sock_read=300))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: Any) -> Any:
        generate = request.path == "/generate" and request.method == "POST"
        if generate:
            with self._idle:
                self._in_flight += 1
        try:
            return await self._pass(request, generate)
        finally:
            if generate:
                with self._idle:
                    self._in_flight -= 1
                    self._idle.notify_all()

    async def _pass(self, request: Any, generate: bool) -> Any:
        from aiohttp import web

        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        async with self._session.request(request.method, self.target + request.path_qs, data=body,
                                         headers=headers) as up:
            passed = {k: v for k, v in up.headers.items() if k.lower() == "content-type"}
            if not (generate and up.status == 200):
                return web.Response(body=await up.read(), status=up.status, headers=passed)
            req = json.loads(body)
            if req.get("stream"):
                resp = web.StreamResponse(status=up.status, headers=passed)
                await resp.prepare(request)
                raw = b""
                async for piece in up.content.iter_any():
                    raw += piece
                    await resp.write(piece)
                await resp.write_eof()
                self._record(req, last_sse_state(raw), stream=True)
                return resp
            data = await up.read()
            obj = json.loads(data)
            self._record(req, (obj["output_ids"], obj["meta_info"].get("finish_reason")), stream=False)
            return web.Response(body=data, status=up.status, headers=passed)

    def _record(self, req: dict[str, Any], result: tuple[list[int], Any], *, stream: bool) -> None:
        ids, finish = result
        with self._lock:
            self.records.append({"input_ids": list(req["input_ids"]), "output_ids": list(ids),
                                 "finish_reason": finish, "rid": req.get("rid"), "stream": stream,
                                 "sampling_params": req.get("sampling_params") or {}})


def last_sse_state(raw: bytes) -> tuple[list[int], Any]:
    """Output ids and finish reason of a /generate SSE stream, cumulative or incremental chunks alike
    (`meta_info.completion_tokens` is cumulative in both modes)."""
    ids: list[int] = []
    finish = None
    for event in raw.decode().split("\n\n"):
        data = event.strip().removeprefix("data:").strip()
        if not data or data == "[DONE]":
            continue
        obj = json.loads(data)
        out, meta = list(obj["output_ids"]), obj["meta_info"]
        ids = ids + out if len(ids) + len(out) == meta["completion_tokens"] else out
        finish = meta.get("finish_reason") or finish
    return ids, finish
