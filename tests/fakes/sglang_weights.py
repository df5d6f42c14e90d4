"""The fake SGLang's weight routes (`tests.fakes.sglang.FakeSGLang` mixes them in): a load from disk, the weight version,
the process groups and their buckets inside SGLang 0.5.21+'s weight-update session, the cache flush and LoRA adapters,
each answering as SGLang 0.5.23 does (docs/sglang-contract.md)."""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tests.fakes.sglang_gen import Generation, bad

POLL = 0.005


class WeightRoutes:
    """The routes; the state they read and change is `FakeSGLang`'s (its `__init__` sets every attribute below)."""

    paused: str | None
    loading: int
    model_path: str
    weight_version: str
    load_delay: float
    weight_session: bool
    session_open: bool
    groups: dict[str, dict[str, Any]]
    buckets_received: int
    fail_sync_at: int | None
    enable_lora: bool
    max_loaded_loras: int | None
    loras: dict[str, str]
    lora_refs: dict[str, str]
    calls: list[tuple[str, dict[str, Any]]]
    _gens: dict[str, Generation]
    _history: deque[list[int]]
    _lora_of: dict[str, str]

    async def _json(self, request: Request) -> dict[str, Any]:
        raise NotImplementedError

    def _abort_matching(self, prefix: str, abort_all: bool, message: str = "Aborted") -> None:
        raise NotImplementedError

    async def _update_weights(self, request: Request) -> Response:
        body = await self._json(request)
        path = body.get("model_path") or ""
        if not await asyncio.to_thread(os.path.exists, path):
            message = f"Failed to update weights: {path!r} does not exist."
            return JSONResponse({"success": False, "message": message, "num_paused_requests": 0}, 400)
        if body.get("abort_all_requests"):
            self._abort_matching("", abort_all=True)
        await until(lambda: self.paused is not None or not self._gens)  # unpaused: let running ones finish
        self.loading += 1
        try:
            await asyncio.sleep(self.load_delay)
        finally:
            self.loading -= 1
        self.model_path = path
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        if body.get("flush_cache", True):
            self._history.clear()
        return JSONResponse({"success": True, "message": "Weights updated.", "num_paused_requests": 0})

    async def _update_weight_version(self, request: Request) -> Response:
        body = await self._json(request)
        if body.get("abort_all_requests", True):
            self._abort_matching("", abort_all=True)
        self.weight_version = str(body["new_version"])
        return JSONResponse({"success": True, "message": "Weight version updated.", "new_version": self.weight_version})

    async def _init_group(self, request: Request) -> Response:
        body = await self._json(request)
        name = body.get("group_name") or "weight_update_group"
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
        if missing or name in self.groups:
            message = f"missing {missing}" if missing else f"group {name} exists"
            return JSONResponse({"success": False, "message": f"Failed to initialize custom process group: {message}."}, 400)
        self.groups[name] = {**body, "backend": body.get("backend") or "nccl"}
        return JSONResponse({"success": True, "message": "Succeeded to initialize custom process group."})

    async def _update_distributed(self, request: Request) -> Response:
        body = await self._json(request)
        name = body.get("group_name") or "weight_update_group"
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if name not in self.groups:
            message = f"Group {name} not in {sorted(self.groups)}. Please call `init_weights_update_group` first."
            return JSONResponse({"success": False, "message": message}, 400)
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            return bad("names, dtypes and shapes must be lists of one length")
        if self.weight_session and not self.session_open:
            message = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            return JSONResponse({"success": False, "message": message}, 400)
        if self.fail_sync_at is not None and self.buckets_received >= self.fail_sync_at:
            message = "Failed to update parameter online: fake. The full weights of the ModelRunner are partially updated."
            return JSONResponse({"success": False, "message": message}, 400)
        self.loading += 1
        try:
            await asyncio.sleep(self.load_delay)
        finally:
            self.loading -= 1
        self.buckets_received += 1
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        if body.get("flush_cache", True):
            self._history.clear()
        return JSONResponse({"success": True, "message": "Succeeded to update parameter online."})

    async def _begin_session(self, request: Request) -> Response:
        await self._json(request)
        if self.session_open:
            message = "a weight-update session is already open; call end_weight_update() first"
            return JSONResponse({"success": False, "message": message}, 400)
        self.session_open = True
        return JSONResponse({"success": True, "message": "Success"})

    async def _end_session(self, request: Request) -> Response:
        await self._json(request)
        if not self.session_open:
            message = "no weight-update session is open; call begin_weight_update() first"
            return JSONResponse({"success": False, "message": message}, 400)
        self.session_open = False
        return JSONResponse({"success": True, "message": "Success"})

    async def _destroy_group(self, request: Request) -> Response:
        body = await self._json(request)
        if self.groups.pop(body.get("group_name") or "weight_update_group", None) is None:
            return JSONResponse({"success": False, "message": "The group to be destroyed does not exist."}, 400)
        return JSONResponse({"success": True, "message": "Succeeded to destroy custom process group."})

    async def _flush_cache(self, request: Request) -> Response:
        self.calls.append((request.url.path, {}))
        if self._gens:
            text = f"Cache not flushed because there are pending requests. #queue-req: 0, #running-req: {len(self._gens)}"
            return Response(text, status_code=400)
        self._history.clear()
        return Response("Cache flushed.\nPlease check backend logs for more details.")

    def _lora_result(self, error: str | None = None) -> Response:
        body = {"success": error is None, "error_message": error or "", "loaded_adapters": dict(self.loras)}
        return JSONResponse(body, 200 if error is None else 400)

    async def _load_lora(self, request: Request) -> Response:
        body = await self._json(request)
        name, path = body.get("lora_name") or "", body.get("lora_path") or ""
        if not self.enable_lora:
            return self._lora_result("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if name in self.loras:
            return self._lora_result(f"Failed to load LoRA adapter {name} because it is already loaded")
        if not await asyncio.to_thread(os.path.exists, os.path.join(path, "adapter_config.json")):
            return self._lora_result(f"Failed to load LoRA adapter {name}: no adapter_config.json in {path!r}")
        await asyncio.sleep(self.load_delay)
        self.loras[name] = path
        self.lora_refs[name] = path
        while self.max_loaded_loras is not None and len(self.loras) > self.max_loaded_loras:
            self.loras.pop(next(iter(self.loras)))  # SGLang unloads the least recently used one
        return self._lora_result()

    async def _unload_lora(self, request: Request) -> Response:
        name = (await self._json(request)).get("lora_name") or ""
        if not self.enable_lora:
            return self._lora_result("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if name not in self.loras:
            return self._lora_result(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.loras)}")
        await until(lambda: not any(self._lora_of.get(rid) == name for rid in self._gens))
        del self.loras[name]
        return self._lora_result()


async def until(condition: Callable[[], bool]) -> None:
    # Polling, not asyncio.Event: the state is flipped from test threads and must outlive a server
    # restart, which brings a new event loop.
    while not condition():  # noqa: ASYNC110
        await asyncio.sleep(POLL)
