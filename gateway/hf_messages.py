"""Messages as HF chat templates expect them: content as one string, null fields dropped, tool-call arguments as
objects, reasoning under the names templates read it by."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gateway.errors import BadRequest

Message = Mapping[str, Any]
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _text(content: Any) -> str:
    """Message content as the template wants it: a string (text parts joined, null as "")."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise BadRequest(
                f"content parts of type {part.get('type')!r} are not supported by this text model; send text",
                param="messages",
            )
        texts.append(part.get("text") or "")
    return "".join(texts)


def _hf_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or call)
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:  # not JSON, or an integer past int_max_str_digits: the template renders the string as it came
            pass
        except RecursionError:  # the request boundary refuses these (routes.common.check_json_shape)
            raise BadRequest("tool call arguments are nested too deeply", param="messages") from None
    elif args is None:
        fn["arguments"] = {}
    out = {k: v for k, v in call.items() if v is not None}
    out["type"] = "function"
    out["function"] = fn
    return out


def hf_message(msg: Message) -> dict[str, Any]:
    """An OpenAI-form message in the form HF templates expect.

    Null fields are dropped (Llama's template tests `'tool_calls' in message`), content becomes a
    string, and tool-call arguments become dicts (templates render them with `tojson`).
    """
    out = {k: v for k, v in msg.items() if v is not None}
    out["content"] = _text(msg.get("content"))
    if out.get("tool_calls"):
        out["tool_calls"] = [_hf_tool_call(c) for c in out["tool_calls"]]
    else:
        out.pop("tool_calls", None)
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:  # the names templates read it by, as transformers aliases them
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out
