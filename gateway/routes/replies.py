"""What the OpenAI-shaped routes share: a prepared turn run to its end, and the pieces of a reply.

`openai_api` (chat completions, completions), `streaming` (streamed chat completions) and `responses`
all import from here and never from each other.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from gateway import disconnect
from gateway.errors import BadRequest
from gateway.generation import Generation
from gateway.routes.body_prefix import BodyPrefixes
from gateway.routes.common import M, parse_body, read_raw_body
from gateway.routes.message_reuse import MessageReuse
from gateway.services import services
from gateway.settings import Settings
from gateway.turn_types import FinishedTurn, PreparedTurn
from gateway.turns import TurnService


async def read_turn_body(request: Request, model: type[M], messages: str | None,
                         reuse: MessageReuse | None = None, prefixes: BodyPrefixes | None = None,
                         session: str | None = None) -> tuple[M, int]:
    """The body of an OpenAI call (read after its key was checked) and its size in bytes. `messages` names
    the list counted against `max_messages` (and `tools` against `max_tools`; None: neither, a completion
    has no such lists) on the decoded JSON, before validation: validating 230k messages (7 MB) took 3 s of
    the event loop. `reuse`: that list's messages seen before are not validated again (`MessageReuse`).
    `prefixes` (chat `messages` only), with the caller's `session`: a body that replays the session's previous
    one byte for byte is decoded from its new bytes (`BodyPrefixes`)."""
    raw = await read_raw_body(request)
    if messages is None:
        return parse_body(raw, model), len(raw)
    settings: Settings = services(request).settings
    keys: list[bytes | None] | None = None
    spliced = prefixes.decode(session, raw) if prefixes is not None and session is not None else None
    seen: dict[str, Any] | None = None

    def precheck(data: dict[str, Any]) -> bool:
        """True (walk the body without scanning its bytes) when most of its messages were handed over as
        models validated before: what is left to walk is small (`check_json_shape`)."""
        nonlocal keys, seen
        seen = data
        check_counts(data, settings, messages)
        if reuse is None:
            return False
        keys = reuse.swap(data, messages)
        if keys is None:
            return False
        kept = sum(1 for m in data[messages] if type(m) is not dict)
        return kept * 2 >= len(keys)

    if spliced is not None:
        body = parse_body(raw, model, precheck, spliced.data, len(spliced.data[messages]) - spliced.reused)
    else:
        body = parse_body(raw, model, precheck)
    validated = getattr(body, messages)
    if reuse is not None and keys is not None:
        validated = reuse.keep(keys, validated)
    if prefixes is not None and session is not None and seen is not None:
        prefixes.keep(session, raw, seen, validated, spliced)
    return body, len(raw)


def check_counts(data: dict[str, Any], settings: Settings, messages: str) -> None:
    for name, limit, setting in ((messages, settings.max_messages, "max_messages"),
                                 ("tools", settings.max_tools, "max_tools")):
        items = data.get(name)
        if isinstance(items, list) and len(items) > limit:
            raise BadRequest(
                f"{name} holds {len(items)} items; a request may carry at most {limit} ({setting}; raise it "
                f"with ROLLWAY_{setting.upper()})", param=name, code="array_above_max_length",
            )


async def run_to_end(request: Request, prepared: PreparedTurn) -> tuple[Generation, FinishedTurn]:
    """Non-streaming generation, then the durable store of the turn; a client that leaves meanwhile aborts
    the backend request and leaves its partial turn recorded (gateway.disconnect)."""
    return await disconnect.run_to_end(request, prepared)


def logprobs_content(
    turns: TurnService, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]]
) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content` for generated ids (stop ids left out: they are not text)."""
    out = []
    stop, known, token_text = turns.stop_ids, turns.token_texts, turns.token_text  # every token of every reply
    n_tops = len(tops)
    for i, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
        if tid in stop:
            continue
        text, raw = known.get(tid) or token_text(tid)
        entry: dict[str, Any] = {"token": text, "logprob": lp, "bytes": raw, "top_logprobs": []}
        if i < n_tops and tops[i]:
            entry["top_logprobs"] = [
                {"token": (tb := token_text(cand))[0], "logprob": clp, "bytes": tb[1]} for cand, clp in tops[i]
            ]
        out.append(entry)
    return out


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
