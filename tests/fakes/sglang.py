"""A scripted fake SGLang server that follows docs/sglang-contract.md, for tests and demos without a GPU.

    with FakeSGLang(token_delay=0.01) as fake:    # uvicorn on a free loopback port, in a thread
        fake.script([[11, 12, 2]])                # the next /generate outputs exactly these ids
        ... POST f"{fake.url}/generate" {"input_ids": [...], "sampling_params": {"stop_token_ids": [2]}} ...
        assert fake.requests[-1]["input_ids"] == [...]

Generation: each output position draws a token from `vocab` and a logprob in (-5, 0) from an RNG seeded
with the input ids, the fake's `seed` and `sampling_seed`; with temperature > 0 and no `sampling_seed`
every request also mixes in a counter, so identical prompts differ like sampled siblings. A scripted
output replaces the drawn ids position by position (logprobs stay the RNG's); past its end the RNG
goes on. A token in `stop_token_ids` or `eos_token_ids` ends with `{"type": "stop", "matched": id}`
(not before `min_new_tokens`, never with `ignore_eos`); `max_new_tokens` ends with "length". Stop
strings are accepted and ignored (no tokenizer). `text` is "<id><id>..." unless
`skip_tokenizer_init`. `legacy=True` acts like a 0.4 server: only /get_model_info and
/get_server_info, and the old error shape for unknown sampling keys.

Test handles: `requests` (/generate payloads), `calls` (control calls as (path, body)), `aborted` and
`disconnected` (rids), `running` (requests in flight), `script()`, `fail_next()` (HTTP errors),
`fail_stream()` (an SSE error event or a dropped connection mid-stream), `down` (drop every connection),
`healthy` (503 on /health), `stop()`/`start()` (connection refused, same port). /health blocks while paused or
loading (up to `health_check_timeout`), /ping does not; `weight_session=False` is a server before 0.5.21 (no
/begin_weight_update, /end_weight_update).
The process-group weight endpoints check their bodies and record the groups (`groups`: name -> init body) and
buckets, but receive no tensors (no torch here): `fail_sync_at = k` fails the k-th bucket call (0-based) with
SGLang's `success: false` answer, as a server whose broadcast broke.

As a process: python -m tests.fakes.sglang --port 30000 [--incremental] [--token-delay 0.01]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollway_common.json_schema_check import unsupported_reason
from tests.fakes.serve import ServerThread, serve_forever
from tests.fakes.sglang_gen import Generation, abort_finish, bad, cached_prefix, event, render, step, validate
from tests.fakes.sglang_weights import POLL, WeightRoutes, until


class _Dropped(Exception):
    """Raised after the response head so uvicorn closes the connection (the `down` switch)."""


class FakeSGLang(WeightRoutes):
    """The fake server: an ASGI app (itself) plus test handles; `start()`/`with` serves it on `url`.

    `vocab` the ids drawn, `eos_token_ids` ids that always stop (besides `stop_token_ids`),
    `incremental` streams deltas (`incremental_logprobs` may differ, as in some SGLang versions),
    `token_delay` seconds per token (lets tests pause or disconnect mid-generation), `stream_interval`
    tokens per chunk, `context_length`/`max_req_input_len` the limits /generate enforces and /server_info
    reports, `load_delay` seconds a weight update takes, `legacy` a 0.4-style server."""

    def __init__(
        self,
        *,
        vocab: range = range(100, 1000),
        eos_token_ids: Iterable[int] = (),
        incremental: bool = False,
        incremental_logprobs: bool | None = None,
        token_delay: float = 0.0,
        stream_interval: int = 1,
        context_length: int = 4096,
        max_req_input_len: int | None = None,
        model_path: str = "fake/model",
        weight_version: str = "default",
        load_delay: float = 0.0,
        skip_tokenizer_init: bool = False,
        legacy: bool = False,
        seed: int = 0,
        enable_lora: bool = False,
        max_loaded_loras: int | None = None,
        weight_session: bool = True,
        health_check_timeout: float = 20.0,
        port: int = 0,
    ) -> None:
        self.vocab = vocab
        self.eos_token_ids = frozenset(eos_token_ids)
        self.incremental = incremental
        self.incremental_logprobs = incremental if incremental_logprobs is None else incremental_logprobs
        self.token_delay = token_delay
        self.stream_interval = stream_interval
        self.context_length = context_length
        self.max_req_input_len = context_length - 1 if max_req_input_len is None else max_req_input_len
        self.model_path = model_path
        self.weight_version = weight_version
        self.load_delay = load_delay
        self.skip_tokenizer_init = skip_tokenizer_init
        self.legacy = legacy
        self.seed = seed
        self.down = False
        self.healthy = True
        self.paused: str | None = None
        # Liveness as SGLang 0.5.23 answers it (srt/entrypoints/http_server.py `health_generate`, `ready`,
        # `sagemaker_health`; srt/managers/tokenizer_manager.py `is_healthy`, `is_ready`): /health waits for a
        # one-token generation, which a pause or a weight load holds back, for at most `health_check_timeout`
        # (SGLANG_HEALTH_CHECK_TIMEOUT, 20 s), then answers 503 and marks the server unhealthy (`unhealthy`), after
        # which /ping and /ready answer 503 too until a /health passes; /ping is a flag check, 200 while paused.
        self.health_check_timeout = health_check_timeout
        self.unhealthy = False
        self.loading = 0
        """Weight loads in progress (/update_weights_from_disk, /update_weights_from_distributed)."""
        self.health_probes: list[str] = []
        """The liveness paths called (/health, /ping, /ready), in order."""
        self.health_while_busy = 0
        """/health calls that arrived while paused or loading (each blocks, and may mark the server unhealthy)."""
        # The weight-update session of SGLang 0.5.21+ (srt/managers/scheduler_components/weight_updater.py
        # `begin_weight_update`, `end_weight_update`): /update_weights_from_distributed refuses to run outside one.
        # weight_session=False is a server before 0.5.21: neither route, no session demanded, /server_info 0.5.20.
        self.weight_session = weight_session
        self.session_open = False
        self._parked: set[str] = set()
        """rids that arrived while paused: held in the tokenizer manager, out of reach of `abort_all`."""
        self.requests: list[dict[str, Any]] = []
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.aborted: list[str] = []
        self.disconnected: list[str] = []
        self._scripts: deque[list[int]] = deque()
        self._failures: deque[int] = deque()
        self._stream_failures: deque[tuple[int, str | None]] = deque()
        self._status_aborts: deque[tuple[str, int]] = deque()
        self._gens: dict[str, Generation] = {}
        self._history: deque[list[int]] = deque(maxlen=256)
        self._draws = 0
        self.groups: dict[str, dict[str, Any]] = {}
        self.buckets_received = 0
        self.fail_sync_at: int | None = None
        self.enable_lora = enable_lora  # LoRA as SGLang 0.5.23 serves it (docs/sglang-contract.md "LoRA adapters")
        self.max_loaded_loras = max_loaded_loras
        self.loras: dict[str, str] = {}  # name -> path, least recently used first
        self._lora_of: dict[str, str] = {}  # rid -> the adapter it runs on (an unload waits for them)
        self.lora_refs: dict[str, str] = {}  # every adapter ever loaded (SGLang's lora_ref_cache; a restart clears)
        self.reloaded: list[str] = []  # adapters a /generate loaded again
        info = "/get_model_info" if legacy else "/model_info"
        server = "/get_server_info" if legacy else "/server_info"
        self._app = Starlette(
            routes=[
                Route("/generate", self._generate, methods=["POST"]),
                Route("/abort_request", self._abort_request, methods=["POST"]),
                Route("/pause_generation", self._pause, methods=["POST"]),
                Route("/continue_generation", self._continue, methods=["POST"]),
                Route("/update_weights_from_disk", self._update_weights, methods=["POST"]),
                Route("/update_weight_version", self._update_weight_version, methods=["POST"]),
                Route("/init_weights_update_group", self._init_group, methods=["POST"]),
                Route("/update_weights_from_distributed", self._update_distributed, methods=["POST"]),
                Route("/destroy_weights_update_group", self._destroy_group, methods=["POST"]),
                Route("/load_lora_adapter", self._load_lora, methods=["POST"]),
                Route("/unload_lora_adapter", self._unload_lora, methods=["POST"]),
                Route("/flush_cache", self._flush_cache, methods=["GET", "POST"]),
                Route(info, self._model_info, methods=["GET"]),
                Route(server, self._server_info, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/health_generate", self._health, methods=["GET"]),
                Route("/ping", self._ping, methods=["GET"]),
                Route("/ready", self._ready, methods=["GET"]),
                *([Route("/begin_weight_update", self._begin_session, methods=["POST"]),
                   Route("/end_weight_update", self._end_session, methods=["POST"])] if weight_session else []),
            ]
        )
        self._server = ServerThread(self, port=port)

    # -- test handles ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._server.url

    @property
    def running(self) -> int:
        """Requests admitted and not finished."""
        return len(self._gens)

    def script(self, outputs: Iterable[list[int]]) -> None:
        """Queue exact output ids for the next requests, one list per request, in arrival order."""
        self._scripts.extend(list(o) for o in outputs)

    def fail_next(self, n: int = 1, status: int = 503) -> None:
        """Answer the next n /generate calls with this HTTP status."""
        self._failures.extend([status] * n)

    def fail_stream(self, after_tokens: int, message: str | None = "fake: error mid-stream") -> None:
        """Break the next streamed /generate once it has produced `after_tokens` tokens: with an SSE
        `{"error": {"message"}}` event, or with message=None by dropping the connection."""
        self._stream_failures.append((after_tokens, message))

    def abort_next(self, message: str, status: int = 400) -> None:
        """Finish the next /generate at once with SGLang's `FINISH_ABORT(message, status)` (a grammar xgrammar does
        not compile: 400; a failed step: 500): a streamed call gets HTTP 200 and one chunk carrying it, a
        non-streamed one the status (`TokenizerManager._handle_abort_finish_reason`)."""
        self._status_aborts.append((message, status))

    def start(self) -> FakeSGLang:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()
        self._gens.clear()

    def __enter__(self) -> FakeSGLang:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.down:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"9")]})
            raise _Dropped("fake is down")
        await self._app(scope, receive, send)

    # -- /generate ---------------------------------------------------------------------------------

    async def _generate(self, request: Request) -> Response:
        try:
            payload = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:
            return bad(f"invalid JSON: {e}")
        self.requests.append(payload)
        record(request, payload)
        if self._failures:
            status = self._failures.popleft()
            return JSONResponse({"error": {"message": f"fake: injected failure {status}"}}, status)
        error = validate(payload, self.context_length, self.max_req_input_len, self.legacy)
        if error is not None:
            return error
        found = grammar_error(payload.get("sampling_params") or {})
        if found is None and self._status_aborts:
            message, status = self._status_aborts.popleft()
            if not payload.get("stream"):
                return JSONResponse({"error": {"message": message}}, status)
            found = (message, "compile")
        if found is not None:
            message, stage = found
            if payload.get("stream") and stage != "contract":
                return StreamingResponse(grammar_stream(payload, message, stage), media_type="text/event-stream")
            return bad(message)
        lora = payload.get("lora_path")
        if lora is not None and lora not in self.loras:
            # SGLang 0.5.23's `TokenizerManager._resolve_lora_path`: a name loaded before is loaded again,
            # silently (evicting the least recently used past the cap); one never loaded is refused.
            if not self.enable_lora:
                message = f"LoRA adapter '{lora}' was requested, but LoRA is not enabled."
            elif lora not in self.lora_refs:
                message = (f"Got LoRA adapter that has never been loaded: {lora}\n"
                           f"All loaded adapters: dict_keys({list(self.lora_refs)}).")
            else:
                message = ""
                self.loras[lora] = self.lora_refs[lora]
                self.reloaded.append(lora)
                while self.max_loaded_loras is not None and len(self.loras) > self.max_loaded_loras:
                    self.loras.pop(next(n for n in self.loras if n != lora))
            if message:
                return JSONResponse({"error": {"message": message}}, 400)
        if lora is not None:
            self.loras[lora] = self.loras.pop(lora)  # a use (LRU)
            self._lora_of[str(payload.get("rid"))] = lora
        ids = payload["input_ids"]
        sp = payload.get("sampling_params") or {}
        n = sp.get("n") or 1
        top_n = payload.get("top_logprobs_num") or 0
        if n == 1 and not isinstance(ids[0], list):
            gen = self._admit(ids, sp, payload.get("rid"), top_n)
            if payload.get("stream"):
                return StreamingResponse(self._stream(gen, payload), media_type="text/event-stream")
            await self._finish(gen)
            return JSONResponse(self._render(gen, payload))
        if payload.get("stream"):
            return bad("fake: streaming a batch or n > 1 is not supported")
        gens = [self._admit(p, sp, None, top_n) for p in (ids if isinstance(ids[0], list) else [ids] * n)]
        await asyncio.gather(*(self._finish(g) for g in gens))
        return JSONResponse([self._render(g, payload) for g in gens])

    def _admit(self, input_ids: list[int], sp: dict[str, Any], rid: str | None, top_n: int) -> Generation:
        seed = sp.get("sampling_seed")
        if seed is None and (sp.get("temperature") is None or sp["temperature"] > 0):
            self._draws += 1  # sampling without a seed: identical prompts get different outputs
            seed = f"draw-{self._draws}"
        digest = hashlib.blake2b(orjson.dumps([self.seed, seed, input_ids]), digest_size=8).digest()
        gen = Generation(
            rid=rid or uuid.uuid4().hex,
            input_ids=input_ids,
            sp=sp,
            rng=random.Random(int.from_bytes(digest, "little")),
            script=self._scripts.popleft() if self._scripts else None,
            cached=cached_prefix(self._history, input_ids),
            top_n=top_n,
        )
        self._gens[gen.rid] = gen
        if self.paused is not None:
            self._parked.add(gen.rid)
        return gen

    async def _run(self, gen: Generation) -> AsyncIterator[None]:
        """Generate token by token, yielding after each; honours pause, abort and the token delay."""
        # The waiting queue: a paused server holds new requests until continue (or their abort).
        await until(lambda: self.paused is None or gen.abort_message is not None)
        self._parked.discard(gen.rid)
        if gen.abort_message is not None:
            gen.finish = abort_finish(
                "Abort before prefill" if self.legacy else gen.abort_message, running=False
            )
            return
        gen.started = True
        while gen.finish is None:
            if gen.abort_message is not None:
                gen.finish = abort_finish(gen.abort_message, running=True)
                return
            if self.paused in ("retract", "in_place"):
                await asyncio.sleep(POLL)
                continue
            step(gen, self.vocab, self.eos_token_ids)
            yield
            if self.token_delay and gen.finish is None:
                await asyncio.sleep(self.token_delay)

    async def _finish(self, gen: Generation) -> None:
        try:
            async for _ in self._run(gen):
                pass
        finally:
            self._retire(gen)

    def _retire(self, gen: Generation) -> None:
        self._gens.pop(gen.rid, None)
        self._parked.discard(gen.rid)
        if gen.finish is not None and gen.finish["type"] == "abort":
            self.aborted.append(gen.rid)
        self._history.append(gen.input_ids + gen.output)

    async def _stream(self, gen: Generation, payload: dict[str, Any]) -> AsyncIterator[bytes]:
        sent = 0
        failure = self._stream_failures.popleft() if self._stream_failures else None
        try:
            async for _ in self._run(gen):
                if failure is not None and len(gen.output) >= failure[0]:
                    gen.finish = {"type": "abort", "message": failure[1] or "dropped"}
                    if failure[1] is None:
                        raise _Dropped("fake: connection dropped mid-stream")
                    yield event({"error": {"message": failure[1]}})
                    yield b"data: [DONE]\n\n"
                    return
                if gen.finish is None and len(gen.output) - sent >= self.stream_interval:
                    yield event(self._render(gen, payload, sent))
                    sent = len(gen.output)
            yield event(self._render(gen, payload, sent))
            yield b"data: [DONE]\n\n"
        finally:
            if gen.finish is None:  # the client went away (Starlette cancelled us): SGLang aborts
                gen.finish = {"type": "abort", "message": "client disconnected"}
                self.disconnected.append(gen.rid)
            self._retire(gen)

    def _render(self, gen: Generation, payload: dict[str, Any], sent: int = 0) -> dict[str, Any]:
        """The answer (sent = 0), or a stream chunk after `sent` tokens went out."""
        return render(
            gen,
            payload,
            since=sent if self.incremental else 0,
            lp_from=sent if self.incremental_logprobs else 0,
            weight_version=gen.version_at_abort or self.weight_version,
            text=not self.skip_tokenizer_init,
        )

    # -- control -----------------------------------------------------------------------------------

    async def _json(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        body: dict[str, Any] = orjson.loads(raw) if raw.strip() else {}
        self.calls.append((request.url.path, body))
        record(request, body)
        return body

    def _abort_matching(self, prefix: str, abort_all: bool, message: str = "Aborted") -> None:
        if not abort_all and prefix not in self._gens:
            return  # SGLang's tokenizer manager drops an abort of a rid it does not hold (one tokenizer worker)
        for gen in list(self._gens.values()):
            if abort_all and gen.rid in self._parked:
                continue  # SGLang's abort_all goes to the scheduler, which has not seen a parked request yet
            if abort_all or (prefix and gen.rid.startswith(prefix)):
                gen.abort_message = message if gen.started else "Abort in waiting queue"
                gen.version_at_abort = self.weight_version

    async def _abort_request(self, request: Request) -> Response:
        body = await self._json(request)
        self._abort_matching(body.get("rid") or "", bool(body.get("abort_all")))
        return Response(status_code=200)

    async def _pause(self, request: Request) -> Response:
        mode = (await self._json(request)).get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            return bad(f"Invalid mode: {mode}")
        self.paused = mode
        if mode == "abort":
            self._abort_matching("", abort_all=True)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: Request) -> Response:
        await self._json(request)
        self.paused = None
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def _model_info(self, request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
            }
        )

    async def _server_info(self, request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": self.model_path,
                "context_length": self.context_length,
                "max_req_input_len": self.max_req_input_len,
                "max_total_num_tokens": 64 * self.context_length,
                "skip_tokenizer_init": self.skip_tokenizer_init,
                "incremental_streaming_output": self.incremental,
                "version": "0.4.10-fake" if self.legacy else "0.5.23-fake" if self.weight_session else "0.5.20-fake",
            }
        )

    async def _health(self, request: Request) -> Response:
        self.health_probes.append(request.url.path)
        if not self.healthy:
            return Response(status_code=503)
        self.health_while_busy += self.paused is not None or self.loading > 0
        deadline = asyncio.get_running_loop().time() + self.health_check_timeout
        while self.paused is not None or self.loading:  # the one-token generation waits, as a request would
            if asyncio.get_running_loop().time() >= deadline:
                self.unhealthy = True
                return Response(status_code=503)
            await asyncio.sleep(0.05)
        self.unhealthy = False
        return Response(status_code=200)

    async def _ping(self, request: Request) -> Response:
        self.health_probes.append(request.url.path)
        return Response(status_code=200 if self.healthy and not self.unhealthy else 503)

    async def _ready(self, request: Request) -> Response:
        self.health_probes.append(request.url.path)
        return Response(status_code=200 if self.healthy and not self.unhealthy and self.paused is None else 503)


def grammar_error(sp: dict[str, Any]) -> tuple[str, str] | None:
    """SGLang's checks of the grammar keys (docs/sglang-contract.md "Constrained decoding") as (message, stage),
    by where SGLang 0.5.23 makes them: "contract" (`api_contract.generate_contract_error`: each key a string; a
    400 before anything runs), "verify" (`SamplingParams.verify` in the tokenizer manager: at most one of
    json_schema, regex, ebnf, structural_tag), "compile" (the scheduler's grammar manager: JSON that does not
    parse, a structural tag of neither form, a json_schema xgrammar would not enforce,
    `validate_xgrammar_json_schema`). The fake compiles nothing and constrains nothing: scripts decide what
    comes out."""
    for key in ("json_schema", "regex", "ebnf", "structural_tag"):
        if sp.get(key) is not None and not isinstance(sp[key], str):
            return f"{key} must be a string", "contract"
    given = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if sp.get(k) is not None]
    if len(given) > 1:
        return "Only one of json_schema, regex, ebnf, or structural_tag can be set.", "verify"
    kind = {"json_schema": "json", "structural_tag": "structural_tag"}
    for key in ("json_schema", "structural_tag"):
        text = sp.get(key)
        if text is None or text == "$$ANY$$":
            continue
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            return f"Failed to compile {kind[key]} grammar: {e}", "compile"
        if key == "json_schema" and (reason := unsupported_reason(value)) is not None:
            return f"Failed to compile json grammar: {reason}", "compile"
        if key == "structural_tag" and not (
            isinstance(value, dict)
            and (isinstance(value.get("format"), dict) or ("structures" in value and "triggers" in value))
        ):
            return "Failed to compile structural_tag grammar: needs 'format' or 'structures' and 'triggers'", "compile"
    return None


async def grammar_stream(payload: dict[str, Any], message: str, stage: str) -> AsyncIterator[bytes]:
    """A streamed call's grammar error, as SGLang streams it with HTTP 200: the tokenizer manager's ValueError as
    an `error` event (`http_server.serve_generate_request`), a compile failure as one chunk finishing with an abort
    that carries status 400 (`Req.set_finish_with_abort`: no tokens, no logprobs)."""
    if stage == "verify":
        yield event({"error": {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}})
    else:
        finish = {"type": "abort", "message": message, "status_code": 400, "err_type": "BadRequestError"}
        meta = {"id": payload.get("rid") or uuid.uuid4().hex, "finish_reason": finish,
                "prompt_tokens": len(payload.get("input_ids") or []), "completion_tokens": 0, "cached_tokens": 0,
                "e2e_latency": 0.0}
        yield event({"text": "", "output_ids": [], "meta_info": meta})
    yield b"data: [DONE]\n\n"


RECORD_ENV = "ROLLWAY_RECORD_SGLANG"
"""A file: every body a fake receives is appended to it as a JSON line {"path", "test", "agent", "body"}, for the
conformance suite (tests/sglang_conformance), which checks them with SGLang's own request types."""


def record(request: Request, body: Any) -> None:
    target = os.environ.get(RECORD_ENV)
    if not target:
        return
    line = {"path": request.url.path, "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
            "agent": request.headers.get("user-agent", ""), "body": body}
    with open(target, "ab") as f:
        f.write(orjson.dumps(line) + b"\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Scripted fake SGLang server (see the module docstring).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--incremental", action="store_true", help="like --incremental-streaming-output")
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds per generated token")
    parser.add_argument("--context-length", type=int, default=4096)
    parser.add_argument("--eos-token-id", type=int, action="append", default=[])
    args = parser.parse_args(argv)
    fake = FakeSGLang(
        incremental=args.incremental,
        token_delay=args.token_delay,
        context_length=args.context_length,
        eos_token_ids=args.eos_token_id,
    )
    serve_forever(fake, args.host, args.port)


if __name__ == "__main__":
    main()
