"""Runs in the SGLang venv (tests/sglang_conformance/sglang_venv.py), with SGLang's own code: reads a JSON request
on stdin, writes a JSON report on stdout. Imports only the standard library and sglang's request-parsing modules
(its package `__init__`, which pulls in the whole server, is bypassed).

Request: {"generate": [body, ...], "schemas": [[schema, our_reason_or_null], ...], "vocab_size": int,
          "flags": ["--enable-lora", ...]}
Report:  {"version", "generate": [error_or_null, ...], "schemas": [sglang_reason_or_null, ...],
          "routes": {path: {"methods": [...], "type": name_or_null}}, "types": {name: [field, ...]},
          "meta_info": [key, ...], "flags": {flag: bool}}
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import sys
import types
from pathlib import Path
from typing import Any


def _bypass_package_init() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang is not installed"
    root = Path(next(iter(spec.submodule_search_locations)))
    pkg = types.ModuleType("sglang")
    pkg.__path__ = [str(root)]
    sys.modules["sglang"] = pkg
    return root


class _Tokenizer:
    """What `SamplingParams.normalize` asks of the tokenizer: the length of a stop string's ids."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


def check_generate(body: Any, vocab_size: int) -> str | None:
    """What SGLang 0.5.23 does with a /generate body before it runs: `http_server.generate_request` runs
    `api_contract.generate_contract_error` (GenerateRequest.from_json_value), then the tokenizer manager builds
    `SamplingParams(**sampling_params)`, normalizes it and `verify`s it against the vocabulary."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.sampling.sampling_params import SamplingParams

    error = generate_contract_error(body)
    if error is not None:
        return f"contract: {error}"
    try:
        params = SamplingParams(**(body.get("sampling_params") or {}))
        params.normalize(_Tokenizer())  # a server with its tokenizer (compose's); with --skip-tokenizer-init
        # SGLang refuses stop strings (`raise_if_tokenizer_required`)
        params.verify(vocab_size)
    except Exception as e:  # TypeError (unknown key), ValueError (verify): both the client's 400
        return f"sampling_params: {type(e).__name__}: {e}"
    return None


def check_schema(schema: Any) -> str | None:
    from sglang.srt.constrained.json_schema_validation import (
        UnsupportedJSONSchemaFeature,
        validate_xgrammar_json_schema,
    )

    try:
        validate_xgrammar_json_schema(schema)
    except UnsupportedJSONSchemaFeature as e:
        return str(e)
    return None


def _const(node: ast.AST) -> Any:
    return node.value if isinstance(node, ast.Constant) else None


def routes(http_server: Path) -> dict[str, dict[str, Any]]:
    """Every route `http_server.py` declares on `app` (`@app.get/post/put/api_route`), with its methods and the
    request type of its body parameter (`obj: X` or `obj: Annotated[X, Body()]`), read with `ast`."""
    out: dict[str, dict[str, Any]] = {}
    tree = ast.parse(http_server.read_text())
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body_type = None
        for arg in fn.args.args:
            ann = arg.annotation
            if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated":
                first = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
                ann = first
            if isinstance(ann, ast.Name) and ann.id not in ("Request", "Response", "str", "int", "bool"):
                body_type = ann.id
                break
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"):
                continue
            verb = dec.func.attr
            if verb not in ("get", "post", "put", "api_route") or not dec.args:
                continue
            path = _const(dec.args[0])
            if not isinstance(path, str):
                continue
            methods = [verb.upper()] if verb != "api_route" else ["GET"]
            for kw in dec.keywords:
                if kw.arg == "methods" and isinstance(kw.value, (ast.List, ast.Tuple)):
                    methods = [str(_const(e)) for e in kw.value.elts]
            entry = out.setdefault(path, {"methods": [], "type": body_type})
            entry["methods"] = sorted(set(entry["methods"]) | set(methods))
    return out


def request_types(io_struct: Path) -> dict[str, list[str]]:
    """Fields of every class in `io_struct.py` (annotated class attributes, inherited ones included)."""
    tree = ast.parse(io_struct.read_text())
    own: dict[str, list[str]] = {}
    bases: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            own[node.name] = [s.target.id for s in node.body
                              if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
            bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def fields(name: str) -> list[str]:
        out: list[str] = []
        for b in bases.get(name, []):
            out += fields(b)
        return out + own.get(name, [])

    return {name: sorted(set(fields(name))) for name in own}


def meta_info_keys(tokenizer_manager: Path) -> list[str]:
    """The keys the tokenizer manager puts in a /generate answer's `meta_info`: a dict literal assigned to
    `meta_info`, `meta_info["k"] = ...`, `meta_info.update({...})`."""
    keys: set[str] = set()
    for node in ast.walk(ast.parse(tokenizer_manager.read_text())):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id == "meta_info" and isinstance(node.value, ast.Dict):
                    keys |= {k for k in map(_const, node.value.keys) if isinstance(k, str)}
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == "meta_info":
                    k = _const(t.slice)
                    if isinstance(k, str):
                        keys.add(k)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "meta_info"
                and node.args and isinstance(node.args[0], ast.Dict)):
            keys |= {k for k in map(_const, node.args[0].keys) if isinstance(k, str)}
    return sorted(keys)


def main() -> None:
    request = json.load(sys.stdin)
    root = _bypass_package_init()
    from sglang.version import __version__

    srt = root / "srt"
    # launch_server's flags are the ServerArgs fields (`--a-b` for `a_b`), declared in these files.
    server_args = "\n".join(p.read_text() for p in [srt / "server_args.py", *(srt / "arg_groups").rglob("*.py")])
    report = {
        "version": __version__,
        "generate": [check_generate(b, int(request.get("vocab_size", 151936))) for b in request.get("generate", [])],
        "schemas": [check_schema(s) for s, _ in request.get("schemas", [])],
        "routes": routes(srt / "entrypoints" / "http_server.py"),
        "types": request_types(srt / "managers" / "io_struct.py"),
        "meta_info": meta_info_keys(srt / "managers" / "tokenizer_manager.py"),
        "flags": {f: re.search(rf"^\s+{f[2:].replace('-', '_')}\s*:", server_args, re.M) is not None
                  for f in request.get("flags", [])},
    }
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
