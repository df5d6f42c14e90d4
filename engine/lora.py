"""LoRA adapters on the CPU engine, with SGLang's HTTP contract (docs/sglang-contract.md "LoRA adapters").

`--enable-lora` wraps the targeted linears of the served model (`--lora-target-modules`, e.g. q_proj v_proj)
in `LoRALinear`. Adapters are PEFT folders (adapter_config.json + adapter_model.safetensors) loaded by name at
run time (`/load_lora_adapter`); each `/generate` names one (`lora_path`) or none (the base model). Rows of
one decode step may use different adapters: each targeted linear adds `scaling * (x B^T A^T)` per group of
rows that share an adapter (the base matmul stays one batched call), as SGLang's segmented LoRA kernels do.
Prefill groups hold one adapter each (the scheduler splits them), so identical prompts are still shared
only between rows that use the same adapter.

No peft import: the folder is read with json and safetensors, as SGLang reads it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from safetensors.torch import load_file
from torch import nn

log = logging.getLogger(__name__)

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


class LoRAError(ValueError):
    """A load/unload/generate that SGLang answers with 400 (the message is SGLang's where it has one)."""


@dataclass(eq=False)
class Adapter:
    """One loaded adapter: per module name (as in the served model), A (r, in) and B (out, r)."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def read_adapter(name: str, path: str | Path) -> Adapter:
    """A PEFT adapter folder -> Adapter (float32 on CPU). LoRAError if it is not one."""
    folder = Path(path)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError) as e:
        raise LoRAError(f"Failed to load LoRA adapter {name} from {str(path)!r}: {type(e).__name__}: {e}") from e
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"LoRA adapter {name}: peft_type {config.get('peft_type')!r} is not LORA")
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / (rank**0.5) if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"LoRA adapter {name}: unexpected tensor {key!r} (only lora_A/lora_B weights are served)")
        pairs.setdefault(m.group("module"), {})[m.group("ab")] = value.float()
    adapter = Adapter(name, str(path), rank, scaling)
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name}: {module} lacks lora_A or lora_B")
        adapter.weights[module] = (ab["A"].contiguous(), ab["B"].contiguous())
    return adapter


class _Rows:
    """What the next forward applies: one adapter (or None) for every row, or a list of (adapter, row index)."""

    def __init__(self) -> None:
        self.uniform: Adapter | None = None
        self.groups: list[tuple[Adapter, torch.Tensor]] = []


class LoRALinear(nn.Module):
    """`base(x)` plus each row's adapter delta. `name` is the module's path in the model (the adapter's key)."""

    def __init__(self, base: nn.Linear, name: str, rows: _Rows) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self._rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self._rows
        if rows.uniform is not None:
            w = rows.uniform.weights.get(self.name)
            if w is not None:
                y = y + (x @ w[0].T @ w[1].T) * rows.uniform.scaling
            return y
        for adapter, index in rows.groups:
            w = adapter.weights.get(self.name)
            if w is not None:
                y[index] += (x[index] @ w[0].T @ w[1].T) * adapter.scaling
        return y


class LoRAManager:
    """The engine's adapters: names -> Adapter, the cap on loaded ones, and the row selection of each forward.

    `loaded` is read by the HTTP thread (validation) and changed only on the event loop thread (load/unload
    handlers), so a request checked and submitted in one synchronous step is queued on the model thread
    before any unload of its adapter is (`engine/server.py`)."""

    def __init__(self, target_modules: list[str], max_lora_rank: int | None, max_loaded: int | None) -> None:
        self.targets = set(target_modules)
        self.max_lora_rank = max_lora_rank
        self.max_loaded = max_loaded
        self.loaded: OrderedDict[str, Adapter] = OrderedDict()
        self.refs: dict[str, str] = {}
        """Every adapter ever loaded, name -> folder, unloads included (SGLang's `TokenizerManager.lora_ref_cache`)."""
        self.rows = _Rows()

    def wrap(self, model: nn.Module) -> nn.Module:
        """Replace every targeted nn.Linear of `model` (in place) by a LoRALinear; returns the model."""
        wrapped = 0
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in self.targets:
                parent_name, _, child = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, child, LoRALinear(module, name, self.rows))
                wrapped += 1
        if not wrapped:
            raise ValueError(f"--lora-target-modules {sorted(self.targets)} match no linear layer of the model")
        return model

    def check_new(self, adapter: Adapter, model: nn.Module) -> None:
        """SGLang's checks before an adapter is registered (name taken, rank, target modules)."""
        if adapter.name in self.loaded:
            raise LoRAError(f"Failed to load LoRA adapter {adapter.name} because it is already loaded")
        served = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
        unknown = sorted(set(adapter.weights) - served)
        too_big = self.max_lora_rank is not None and adapter.rank > self.max_lora_rank
        if unknown or too_big:
            raise LoRAError(
                f"LoRA adapter {adapter.name} with rank {adapter.rank} is incompatible with the current LoRA memory "
                "pool configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
                + (f" (modules not served: {unknown[:4]})" if unknown else "")
            )

    def resolve(self, name: str | None) -> Adapter | None:
        """The adapter a /generate names (None: the base model); LoRAError as SGLang words it."""
        if name is None:
            return None
        adapter = self.loaded.get(name)
        if adapter is None:
            adapter = self._reload(name)
        self.loaded.move_to_end(name)  # a use, for the LRU eviction at the cap
        return adapter

    def _reload(self, name: str) -> Adapter:
        """SGLang 0.5.23's `TokenizerManager._resolve_lora_path`: a name loaded once and unloaded since (or evicted)
        is loaded again from its folder, silently, the least recently used others evicted past the cap; a name
        never loaded is refused."""
        path = self.refs.get(name)
        if path is None:
            raise LoRAError(f"Got LoRA adapter that has never been loaded: {name}\n"
                            f"All loaded adapters: {list(self.refs)}.")
        try:
            adapter = read_adapter(name, path)
        except Exception as e:
            raise LoRAError(f"Failed to implicitly load LoRA adapter {name}: {e}") from e
        log.info("reloading LoRA adapter %r for a request naming it (as SGLang does)", name)
        self.loaded[name] = adapter
        while self.max_loaded is not None and len(self.loaded) > self.max_loaded:
            self.loaded.pop(next(n for n in self.loaded if n != name))  # running rows keep their Adapter
        return adapter

    def lru(self) -> str | None:
        return next(iter(self.loaded), None)

    def result(self, success: bool, error: str = "") -> dict[str, Any]:
        """SGLang's LoRAUpdateOutput as JSON."""
        return {"success": success, "error_message": error,
                "loaded_adapters": {n: a.path for n, a in self.loaded.items()}}

    # ---- the model thread -------------------------------------------------------------------------

    def select(self, adapters: list[Adapter | None]) -> None:
        """Set the rows of the next forward: `adapters[i]` for row i."""
        rows = self.rows
        first = adapters[0] if adapters else None
        if all(a is first for a in adapters):
            rows.uniform, rows.groups = first, []
            return
        by: dict[int, tuple[Adapter, list[int]]] = {}
        for i, a in enumerate(adapters):
            if a is not None:
                by.setdefault(id(a), (a, []))[1].append(i)
        rows.uniform = None
        rows.groups = [(a, torch.tensor(idx)) for a, idx in by.values()]


# ---- the HTTP side ---------------------------------------------------------------------------------------

REQUEST_ADAPTER: ContextVar[Adapter | None] = ContextVar("rollway_lora_adapter", default=None)
"""The adapter of the /generate being handled: set by the route, read where its GenRequest is built (the
generation tasks copy the route's context)."""


@dataclass
class LoRAOptions:
    """SGLang's LoRA server flags, as the engine takes them (`rollway engine --enable-lora ...`)."""

    enable_lora: bool = False
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    max_lora_rank: int | None = None
    max_loaded_loras: int | None = None
    max_loras_per_batch: int = 8
    lora_paths: list[str] = field(default_factory=list)
    """name=path pairs loaded at start."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (/load_lora_adapter)")
        parser.add_argument("--lora-target-modules", nargs="+", default=None, metavar="NAME",
                            help="linear layers adapters may target (default: q_proj k_proj v_proj o_proj; "
                                 "'all': every linear of the decoder layers)")
        parser.add_argument("--max-lora-rank", type=int, default=None, help="refuse adapters of a higher rank")
        parser.add_argument("--max-loaded-loras", type=int, default=None,
                            help="adapters kept loaded; a load past it unloads the least recently used one")
        parser.add_argument("--max-loras-per-batch", type=int, default=8,
                            help="accepted for SGLang compatibility (the engine has no per-batch pool)")
        parser.add_argument("--lora-paths", nargs="+", default=[], metavar="NAME=PATH", help="adapters to load at start")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoRAOptions:
        targets = args.lora_target_modules or cls().lora_target_modules
        if targets == ["all"]:
            targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        return cls(bool(args.enable_lora or args.lora_paths), targets, args.max_lora_rank, args.max_loaded_loras,
                   args.max_loras_per_batch, list(args.lora_paths))


def select_adapter(manager: LoRAManager | None, body: Any) -> None:
    """Resolve the request's `lora_path` into REQUEST_ADAPTER; LoRAError (400) as SGLang answers."""
    name = body.get("lora_path") if isinstance(body, dict) else None
    if isinstance(name, list):
        names = {n for n in name if n is not None}
        if len(names) > 1:
            raise LoRAError("the engine takes one lora_path per request (a batch shares it)")
        name = names.pop() if names else None
    if name is None:
        REQUEST_ADAPTER.set(None)
        return
    if not isinstance(name, str):
        raise LoRAError("lora_path must be a string (the name an adapter was loaded under)")
    if manager is None:
        raise LoRAError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
    REQUEST_ADAPTER.set(manager.resolve(name))


class _EngineLike(Protocol):
    lora: LoRAManager | None
    scheduler: Any


def setup(engine: _EngineLike, options: LoRAOptions) -> LoRAManager:
    """Wrap the served model for adapters and load `--lora-paths` (before the model thread starts)."""
    manager = LoRAManager(options.lora_target_modules, options.max_lora_rank, options.max_loaded_loras)
    manager.wrap(engine.scheduler.model)
    engine.lora = manager
    engine.scheduler.lora = manager
    for pair in options.lora_paths:
        name, _, path = pair.partition("=")
        adapter = read_adapter(name, path or name)
        manager.check_new(adapter, engine.scheduler.model)
        manager.loaded[adapter.name] = adapter
        manager.refs[adapter.name] = path or name
    return manager


def _in_use(scheduler: Any, adapter: Adapter) -> bool:
    """On the model thread: does a waiting or running request use `adapter`?"""
    return any(s.req.lora is adapter for s in [*scheduler._waiting, *scheduler._rows])


async def _unload(engine: _EngineLike, name: str) -> dict[str, Any]:
    """Unregister at once, then wait for the requests using it to end (a later /generate naming it loads it again,
    as SGLang does: `LoRAManager._reload`)."""
    manager = engine.lora
    assert manager is not None
    adapter = manager.loaded.pop(name, None)
    if adapter is None:
        raise LoRAError(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(manager.loaded)}")
    engine.scheduler.start()  # the check runs on the model thread (started lazily by transports without lifespan)
    # The state lives on the model thread: polled there.
    while await asyncio.wrap_future(engine.scheduler.call(lambda: _in_use(engine.scheduler, adapter))):  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    return manager.result(True)


def add_lora_routes(app: FastAPI, engine: _EngineLike) -> None:
    """/load_lora_adapter and /unload_lora_adapter: 200 with SGLang's LoRAUpdateOutput, 400 with success false."""

    async def body_of(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            raise LoRAError(f"invalid JSON body: {e}") from e
        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
            raise LoRAError("lora_name is required")
        return body

    def failed(e: Exception) -> JSONResponse:
        manager = engine.lora
        loaded = None if manager is None else {n: a.path for n, a in manager.loaded.items()}
        return JSONResponse({"success": False, "error_message": str(e), "loaded_adapters": loaded}, 400)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        try:
            body = await body_of(request)
            manager = engine.lora
            if manager is None:
                raise LoRAError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
            path = body.get("lora_path")
            if not isinstance(path, str) or not path:
                raise LoRAError("lora_path is required")
            adapter = await asyncio.to_thread(read_adapter, body["lora_name"], path)
            manager.check_new(adapter, engine.scheduler.model)
            manager.loaded[adapter.name] = adapter
            manager.refs[adapter.name] = path
            while manager.max_loaded is not None and len(manager.loaded) > manager.max_loaded:
                lru = manager.lru()
                assert lru is not None
                log.info("unloading the least recently used LoRA adapter %r (cap %d)", lru, manager.max_loaded)
                await _unload(engine, lru)
            return JSONResponse(manager.result(True))
        except LoRAError as e:
            return failed(e)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        try:
            body = await body_of(request)
            if engine.lora is None:
                raise LoRAError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
            return JSONResponse(await _unload(engine, body["lora_name"]))
        except LoRAError as e:
            return failed(e)
