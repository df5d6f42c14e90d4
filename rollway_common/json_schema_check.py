"""The JSON schema constraints SGLang 0.5.23 refuses in a `json_schema` grammar (stdlib only, shared by the
gateway, which refuses them up front, and the engine, which refuses them as SGLang does).

SGLang's `srt/constrained/json_schema_validation.py` `validate_xgrammar_json_schema` (called from
`xgrammar_backend.py` `XGrammarGrammarBackend.dispatch_json`, never for a `structural_tag`'s schemas) walks every
subschema and refuses: the keywords xgrammar would ignore (`_XGRAMMAR_UNSUPPORTED_KEYWORDS`), a string `format`
xgrammar does not implement, and more than one of format / pattern / minLength-maxLength on one string. The
request then ends as `Failed to compile json grammar: JSON Schema at <pointer> is not supported by xgrammar:
<reason>` (a 400, or a streamed abort carrying status 400). `tests/sglang_conformance` runs SGLang's own
function against this one on the same schemas.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

_SINGLE_SUBSCHEMA_KEYWORDS = ("additionalItems", "additionalProperties", "contains", "contentSchema", "else", "if",
                              "items", "not", "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_ARRAY_KEYWORDS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAP_KEYWORDS = ("$defs", "definitions", "dependentSchemas", "patternProperties", "properties")

UNSUPPORTED_KEYWORDS = frozenset({
    "contains", "dependentRequired", "dependentSchemas", "else", "if", "maxContains", "minContains", "multipleOf",
    "not", "then", "uniqueItems",
})
"""SGLang 0.5.23's `_XGRAMMAR_UNSUPPORTED_KEYWORDS`."""
STRING_FORMATS = frozenset({
    "date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "json-pointer", "relative-json-pointer",
    "time", "uri", "uri-reference", "uri-template", "uuid",
})
"""SGLang 0.5.23's `_XGRAMMAR_STRING_FORMATS`."""


def _pointer_part(value: str) -> str:
    return value.replace("~", "~0").replace("/", "~1")


def _subschemas(schema: Any, pointer: str = "#") -> Iterator[tuple[dict[str, Any], str]]:
    """Every subschema with its JSON pointer, walking only schema-bearing keywords (SGLang's `_iter_subschemas`)."""
    if not isinstance(schema, dict):
        return
    yield schema, pointer
    for keyword in _SINGLE_SUBSCHEMA_KEYWORDS:
        child = schema.get(keyword)
        if isinstance(child, (bool, dict)):
            yield from _subschemas(child, f"{pointer}/{keyword}")
        elif keyword == "items" and isinstance(child, list):
            for i, item in enumerate(child):
                yield from _subschemas(item, f"{pointer}/{keyword}/{i}")
    for keyword in _SUBSCHEMA_ARRAY_KEYWORDS:
        children = schema.get(keyword)
        if isinstance(children, list):
            for i, child in enumerate(children):
                yield from _subschemas(child, f"{pointer}/{keyword}/{i}")
    for keyword in _SUBSCHEMA_MAP_KEYWORDS:
        children = schema.get(keyword)
        if isinstance(children, dict):
            for name, child in children.items():
                yield from _subschemas(child, f"{pointer}/{keyword}/{_pointer_part(name)}")
    dependencies = schema.get("dependencies")
    if isinstance(dependencies, dict):
        for name, child in dependencies.items():
            if isinstance(child, (bool, dict)):
                yield from _subschemas(child, f"{pointer}/dependencies/{_pointer_part(name)}")


def _describes_string(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind)


def unsupported_reason(schema: Any) -> str | None:
    """SGLang's refusal text for `schema` (`JSON Schema at <pointer> is not supported by xgrammar: ...`), or
    None when SGLang 0.5.23 compiles it."""
    for sub, pointer in _subschemas(schema):
        keywords = sorted(UNSUPPORTED_KEYWORDS.intersection(sub))
        if keywords:
            return f"JSON Schema at {pointer} is not supported by xgrammar: keyword(s) {', '.join(keywords)} " \
                   "would be ignored"
        if not _describes_string(sub):
            continue
        if "format" in sub and (not isinstance(sub["format"], str) or sub["format"] not in STRING_FORMATS):
            return f"JSON Schema at {pointer} is not supported by xgrammar: string format {sub['format']!r} " \
                   "is not implemented"
        groups = [g for g, present in (("format", "format" in sub), ("pattern", "pattern" in sub),
                                       ("minLength/maxLength", "minLength" in sub or "maxLength" in sub)) if present]
        if len(groups) > 1:
            return f"JSON Schema at {pointer} is not supported by xgrammar: constraints {', '.join(groups)} " \
                   "cannot be enforced together"
    return None
