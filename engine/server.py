"""The engine's HTTP server: SGLang's native API (docs/sglang-contract.md) on top of the batching scheduler.

`create_app(model_dir)` loads the model and tokenizer and returns a FastAPI app; the model thread
starts with the app's lifespan (or on the first request, for transports that skip the lifespan).
`serve(model_dir)` runs it under uvicorn until SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager, suppress
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from transformers import AutoTokenizer, PreTrainedModel

from engine.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, ApiKeys, add_key_arguments
from engine.grammar import GrammarCompiler, GrammarError, grammar_key
from engine.liveness import Liveness, add_liveness_routes
from engine.lora import (
    REQUEST_ADAPTER,
    LoRAError,
    LoRAManager,
    LoRAOptions,
    add_lora_routes,
    select_adapter,
    setup,
)
from engine.memory import add_memory_routes
from engine.protocol import GenerateCall, GenerateSpec, Result, parse_generate
from engine.sampling import InvalidRequest, UnknownSamplingKey
from engine.scheduler import GenRequest, Scheduler
from engine.tensor_sync import add_tensor_routes
from engine.weight_sync import add_routes as add_weight_sync_routes
from engine.weights import load_like, load_model

log = logging.getLogger(__name__)

VERSION = "0.5.23+rollway"  # the SGLang API level this engine speaks, PEP 440 local to mark it ours
PRE_SESSION_VERSION = "0.5.20+rollway"
"""What it reports with `weight_update_session=False`: an SGLang before /begin_weight_update and /end_weight_update."""
PAUSE_MODES = ("abort", "retract", "in_place")


class Engine:
    """The model, its tokenizer and the scheduler, plus what /model_info and /server_info report."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        served_model_name: str | None,
        max_batch_size: int,
        context_length: int | None,
        incremental_streaming_output: bool,
        weight_update_session: bool = True,
    ) -> None:
        self.model_path = str(model_dir)
        self.liveness = Liveness()
        self.weight_update_session = weight_update_session
        self.tokenizer_path = str(model_dir)
        self.served_model_name = served_model_name or Path(model_dir).name
        self.incremental_streaming_output = incremental_streaming_output
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model = load_model(self.model_path)
        self.context_length = context_length or int(model.config.get_text_config().max_position_embeddings)
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        self.max_batch_size = max_batch_size
        self.lora: LoRAManager | None = None
        """Set by `create_app` with --enable-lora (engine/lora.py)."""
        self._grammars: GrammarCompiler | None = None
        self.scheduler = Scheduler(
            model,
            self.tokenizer,
            eos_ids=_eos_ids(model, self.tokenizer),
            max_batch_size=max_batch_size,
            context_length=self.context_length,
        )

    async def generate(self, spec: GenerateSpec) -> AsyncGenerator[Result, None]:
        """Yield the growing result after each batch of new tokens; abort the request if left early."""
        self.scheduler.start()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        req = GenRequest(
            rid=spec.rid,
            input_ids=spec.input_ids,
            params=spec.params,
            loop=asyncio.get_running_loop(),
            queue=queue,
            return_logprob=spec.return_logprob,
            top_logprobs_num=spec.top_logprobs_num,
            logprob_start_len=spec.logprob_start_len,
            stream=spec.stream,
            lora=REQUEST_ADAPTER.get(),
            grammar=spec.grammar,
        )
        result = Result(spec, self.tokenizer)
        self.scheduler.submit(req)
        try:
            while not result.done:
                result.add(await queue.get())
                while not queue.empty():
                    result.add(queue.get_nowait())
                yield result
        finally:
            if not result.done:  # the client went away (or this task was cancelled)
                self.scheduler.abort(spec.rid, exact=True)

    async def collect(self, spec: GenerateSpec) -> Result:
        final = Result(spec, self.tokenizer)
        async with aclosing(self.generate(spec)) as stream:
            async for partial in stream:
                final = partial
        return final

    def with_grammars(self, call: GenerateCall) -> GenerateCall:
        """`call` with each spec's grammar compiled (InvalidRequest: one does not compile). Blocking: run it
        off the event loop. The compiler is built on first use (its vocabulary table takes a moment)."""
        key = grammar_key(call.specs[0].params)  # one sampling_params for every spec of a call
        if key is None:
            return call
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        compiled = self._grammars.compile(key)
        return dataclasses.replace(call, specs=[dataclasses.replace(s, grammar=compiled) for s in call.specs])

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version,
        }

    def server_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "context_length": self.context_length,
            "max_req_input_len": self.context_length - 1,
            "max_total_num_tokens": self.context_length * self.max_batch_size,
            "max_running_requests": self.max_batch_size,
            "incremental_streaming_output": self.incremental_streaming_output,
            "skip_tokenizer_init": False,
            "weight_version": self.scheduler.weight_version,
            "version": VERSION if self.weight_update_session else PRE_SESSION_VERSION,
        }


def _eos_ids(model: PreTrainedModel, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (model.generation_config.eos_token_id, model.config.eos_token_id, tokenizer.eos_token_id):
        if source is not None:
            ids.update(source if isinstance(source, list) else [source])
    return ids


def create_app(
    model_dir: str | Path,
    *,
    served_model_name: str | None = None,
    max_batch_size: int = 32,
    context_length: int | None = None,
    incremental_streaming_output: bool = False,
    lora: LoRAOptions | None = None,
    api_key: str = "",
    admin_api_key: str = "",
    weight_update_session: bool = True,
) -> FastAPI:
    """`api_key` / `admin_api_key`: SGLang's `--api-key` / `--admin-api-key` scheme (engine.auth); empty: open.
    `weight_update_session=False` serves as SGLang before 0.5.21: no /begin_weight_update, /end_weight_update,
    and /update_weights_from_distributed runs without a session."""
    engine = Engine(
        model_dir,
        served_model_name=served_model_name,
        max_batch_size=max_batch_size,
        context_length=context_length,
        incremental_streaming_output=incremental_streaming_output,
        weight_update_session=weight_update_session,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.scheduler.start()
        yield
        await asyncio.to_thread(engine.scheduler.stop)

    app = FastAPI(title="rollway engine", lifespan=lifespan)
    app.state.engine = engine
    if lora is not None and lora.enable_lora:
        setup(engine, lora)
    engine.scheduler.keep_retired = engine.lora is None  # with adapters, weight updates load whole (no buffer)
    add_lora_routes(app, engine)
    _add_error_handlers(app)
    _add_routes(app, engine)
    add_liveness_routes(app, engine)
    sync = add_weight_sync_routes(app, engine, _json_body)  # the process-group path (gloo)
    add_tensor_routes(app, sync, _json_body)  # the tensor path (same machine: shared memory / CUDA IPC)
    add_memory_routes(app, engine, _json_body)  # colocated: free the cache for the trainer's step
    app.add_middleware(GenerateRoute, engine=engine)
    if api_key or admin_api_key:  # added last: the outermost, before /generate's fast path too
        app.add_middleware(ApiKeys, api_key=api_key, admin_api_key=admin_api_key)
    return app


def _client_error(exc: Exception) -> JSONResponse:
    """A request the engine refuses: 400, in SGLang's shapes."""
    if isinstance(exc, UnknownSamplingKey):
        return JSONResponse({"error": str(exc)}, status_code=400)
    return JSONResponse({"error": {"message": str(exc)}}, status_code=400)


CLIENT_ERRORS = (UnknownSamplingKey, LoRAError, InvalidRequest)


def _add_error_handlers(app: FastAPI) -> None:
    for kind in CLIENT_ERRORS:
        app.add_exception_handler(kind, lambda request, exc: _client_error(exc))


class GenerateRoute:
    """ASGI middleware: `POST /generate` served without FastAPI's router, dependency solving and exception
    middleware (every other path goes on to them). That machinery was ~7% of the engine's CPU in the demo's loop
    (py-spy on benchmarks/loop.py), where every rollout is a /generate call. Answers as the route would: the same
    handler, the same 400s; an unexpected exception is logged and answered with a 500."""

    def __init__(self, app: Any, engine: Engine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/generate" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await generate(self.engine, request)
        except CLIENT_ERRORS as exc:
            response = _client_error(exc)
        except ClientDisconnect:
            return
        except Exception as exc:  # a bug: the client gets an answer, the log the traceback
            log.exception("/generate failed")
            response = JSONResponse({"error": {"message": f"{type(exc).__name__}: {exc}"}}, status_code=500)
        await response(scope, receive, send)


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"invalid JSON body: {exc}") from exc


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def generate(engine: Engine, request: Request) -> Response:
    """SGLang's `POST /generate` (served by `GenerateRoute`, and by the app's route when called without it)."""
    body = await _json_body(request)
    call = parse_generate(body, engine.tokenizer, engine.context_length, engine.vocab_size)
    select_adapter(engine.lora, body)  # lora_path: the adapter its rows use (400 when never loaded)
    try:
        if grammar_key(call.specs[0].params) is not None:
            call = await asyncio.to_thread(engine.with_grammars, call)
    except InvalidRequest as exc:
        if not call.stream:
            raise
        # SGLang checks grammars after the stream started: its tokenizer manager's ValueError (more than one
        # grammar) is an `error` event, a grammar that does not compile an abort chunk with status 400.
        events = _grammar_abort(call.specs[0], str(exc)) if isinstance(exc, GrammarError) else _error_event(exc)
        return StreamingResponse(events, media_type="text/event-stream")
    if call.stream:
        return StreamingResponse(_sse(engine, call.specs[0]), media_type="text/event-stream")
    work: asyncio.Future[list[Result]] = asyncio.ensure_future(
        asyncio.gather(*(engine.collect(s) for s in call.specs))
    )
    watch: asyncio.Future[Any] = asyncio.ensure_future(_until_disconnect(request))
    await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if not work.done():  # client disconnected: cancelling aborts the requests
        work.cancel()
        with suppress(asyncio.CancelledError):
            await work
        return Response(status_code=499)
    results: list[Result] = work.result()
    for r in results:
        if r.error is not None:
            return JSONResponse({"error": {"message": r.error}}, status_code=500)
    status = max((r.finish or {}).get("status_code") or 200 for r in results)
    body = [r.response() for r in results]
    return JSONResponse(body if call.batched else body[0], status_code=status)


def _add_routes(app: FastAPI, engine: Engine) -> None:
    scheduler = engine.scheduler

    @app.post("/generate")
    async def generate_route(request: Request) -> Response:
        return await generate(engine, request)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _json_body(request)
        if body.get("abort_all"):
            await asyncio.wrap_future(scheduler.abort(None))
        elif body.get("rid"):
            await asyncio.wrap_future(scheduler.abort(str(body["rid"])))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, str]:
        mode = (await _json_body(request)).get("mode") or "abort"
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"mode must be one of {', '.join(PAUSE_MODES)}")
        engine.liveness.paused = True
        await asyncio.wrap_future(scheduler.pause(mode))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict[str, str]:
        await asyncio.wrap_future(scheduler.resume())
        engine.liveness.paused = False
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        with engine.liveness.loads():  # /health waits while weights load, as SGLang's does
            return await _update_weights_from_disk(request)

    async def _update_weights_from_disk(request: Request) -> JSONResponse:
        body = await _json_body(request)
        path = body.get("model_path")
        try:
            if not path:
                raise ValueError("model_path is required")
            # With adapters loaded the served model is wrapped (engine/lora.py): loaded whole, then wrapped again.
            load = functools.partial(load_model, path) if engine.lora is not None \
                else functools.partial(load_like, scheduler.model, path, scheduler.take_retired)
            model = await asyncio.to_thread(load)
            if engine.lora is not None:  # the new weights serve the loaded adapters too
                engine.lora.wrap(model)
        except Exception as exc:  # any unloadable checkpoint: refuse it and keep serving the old weights
            message = f"Failed to update weights from {path!r}: {type(exc).__name__}: {exc}"
            return JSONResponse({"success": False, "message": message, "num_paused_requests": 0}, 400)
        version = body.get("weight_version")
        swap = scheduler.swap_model(
            model, None if version is None else str(version), bool(body.get("abort_all_requests"))
        )
        paused = await asyncio.wrap_future(swap)
        engine.model_path = str(path)
        message = "Succeeded to update model weights."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": paused})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        version = str(body["new_version"])
        if body.get("abort_all_requests", True):
            await asyncio.wrap_future(scheduler.abort(None))
        await asyncio.wrap_future(scheduler.call(lambda: setattr(scheduler, "weight_version", version)))
        return {"success": True, "message": "Weight version updated.", "new_version": version}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return engine.model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return engine.server_info()

    @app.get("/metrics")
    async def metrics() -> Response:
        """The scheduler's counters in Prometheus' text format (`rollway_engine_*`; SGLang's own /metrics, with
        --enable-metrics, has other names: the gateway does not read it)."""
        lines = [f"rollway_engine_{k}_total {float(v)}" for k, v in scheduler.stats_now().items()]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, str]:
        return {"weight_version": scheduler.weight_version}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await asyncio.wrap_future(scheduler.busy()):
            return Response("Cache not flushed: requests are running.", status_code=400)
        return Response("Cache flushed.", status_code=200)


async def _grammar_abort(spec: GenerateSpec, message: str) -> AsyncGenerator[str, None]:
    """SGLang's stream for a grammar that does not compile (`Req.set_finish_with_abort`: no tokens, no logprobs;
    `TokenizerManager._handle_abort_finish_reason` passes the chunk on to a streamed call)."""
    finish = {"type": "abort", "message": message, "status_code": 400, "err_type": "BadRequestError"}
    meta = {"id": spec.rid, "finish_reason": finish, "prompt_tokens": len(spec.input_ids), "completion_tokens": 0,
            "cached_tokens": 0, "e2e_latency": 0.0}
    yield f"data: {json.dumps({'text': '', 'output_ids': [], 'meta_info': meta})}\n\n"
    yield "data: [DONE]\n\n"


async def _error_event(exc: Exception) -> AsyncGenerator[str, None]:
    """SGLang's stream for a ValueError its tokenizer manager raises (`http_server.serve_generate_request`)."""
    error = {"message": str(exc), "type": "invalid_request_error", "code": 400, "retryable": False}
    yield f"data: {json.dumps({'error': error})}\n\n"
    yield "data: [DONE]\n\n"


async def _sse(engine: Engine, spec: GenerateSpec) -> AsyncGenerator[str, None]:
    async with aclosing(engine.generate(spec)) as stream:
        async for result in stream:
            if result.error is not None:
                yield f"data: {json.dumps({'error': {'message': result.error}})}\n\n"
                break
            chunk = result.incremental_chunk() if engine.incremental_streaming_output else result.response()
            yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


def serve(
    model_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    served_model_name: str | None = None,
    max_batch_size: int = 32,
    log_level: str = "warning",
    incremental_streaming_output: bool = False,
    context_length: int | None = None,
    lora: LoRAOptions | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn handles both and runs the lifespan shutdown). A key left None comes
    from the environment (engine.auth)."""
    app = create_app(
        model_dir,
        served_model_name=served_model_name,
        max_batch_size=max_batch_size,
        context_length=context_length,
        incremental_streaming_output=incremental_streaming_output,
        lora=lora,
        api_key=os.environ.get(API_KEY_ENV, "") if api_key is None else api_key,
        admin_api_key=os.environ.get(ADMIN_API_KEY_ENV, "") if admin_api_key is None else admin_api_key,
    )
    build_server(app, host=host, port=port, log_level=log_level).run()


def build_server(app: FastAPI, *, host: str, port: int, log_level: str = "warning") -> uvicorn.Server:
    """uvicorn for an engine app; `.run()` blocks until SIGINT/SIGTERM (or `handle_exit`)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    return EngineServer(config, app.state.engine.scheduler)


class EngineServer(uvicorn.Server):
    """On SIGINT/SIGTERM, abort every generation so in-flight requests answer with their partial output
    (finish_reason abort) and the graceful shutdown does not wait on long generations."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler) -> None:
        super().__init__(config)
        self._scheduler = scheduler

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._scheduler.abort(None)
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> None:
    """`python -m engine.server --model DIR [--port N]`: the engine alone (what `rollway engine` runs)."""
    import argparse

    parser = argparse.ArgumentParser(description="rollway engine: SGLang's HTTP API on CPU")
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--served-model-name")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--incremental-streaming-output", action="store_true")
    parser.add_argument("--log-level", default="warning")
    add_key_arguments(parser)
    LoRAOptions.add_arguments(parser)
    args = parser.parse_args(argv)
    serve(
        args.model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_batch_size=args.max_batch_size,
        log_level=args.log_level,
        incremental_streaming_output=args.incremental_streaming_output,
        context_length=args.context_length,
        lora=LoRAOptions.from_args(args),
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
    )


if __name__ == "__main__":
    main()
