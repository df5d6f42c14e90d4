"""The Responses API's objects, whole and streamed: the response, its output items, and the event sequence
of `stream: true` (what the OpenAI SDK's `responses.stream` and the Agents SDK's `Runner.run_streamed`
consume, with the event and field names of the `openai` package's `types/responses`).

A streamed reply is a `ResponseEvents` format for the shared streaming core (`streaming.stream_turn`):

    response.created, response.in_progress
    per output item, in the order the reply produced them:
      reasoning   output_item.added, reasoning_summary_part.added, reasoning_summary_text.delta...,
                  reasoning_summary_text.done, reasoning_summary_part.done, output_item.done
      message     output_item.added, content_part.added, output_text.delta..., output_text.done,
                  content_part.done, output_item.done
      tool call   output_item.added, function_call_arguments.delta, function_call_arguments.done,
                  output_item.done (one per call, when the reply is complete: calls are parsed whole)
    response.completed (response.incomplete at max_output_tokens) with the whole response and usage, or
    response.failed (status "failed", `error`) when the reply failed after the stream started.

Every event carries `sequence_number` (0, 1, ...) and is sent as `event: <type>` + `data: <json>`, with no
`[DONE]`, as OpenAI sends them. The reasoning text is the item's summary, as in the whole answer.
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.generation import Generation
from gateway.protocol import ResponsesRequest
from gateway.tool_decoders import ParsedToolCall
from gateway.tool_parsers import ParsedReply
from gateway.turn_types import FinishedTurn, PreparedTurn


def new_item_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [{"type": "summary_text", "text": text}]}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def function_call_item(tc: ParsedToolCall, arguments: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{tc.id[5:]}", "call_id": tc.id, "name": tc.name,
            "arguments": tc.arguments if arguments is None else arguments, "status": status}


def response_object(model: str, body: ResponsesRequest, prepared: PreparedTurn, output: list[dict[str, Any]], *,
                    status: str, gen: Generation | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The response as `POST /v1/responses` answers it (and every lifecycle event carries it); `gen` None:
    no usage yet."""
    usage = None
    if gen is not None:
        n_prompt, n_out = len(prepared.prompt_ids), len(gen.ids)
        usage = {"input_tokens": n_prompt, "output_tokens": n_out, "total_tokens": n_prompt + n_out,
                 "input_tokens_details": {"cached_tokens": gen.cached_tokens, "cache_write_tokens": 0},
                 "output_tokens_details": {"reasoning_tokens": 0}}
    return {
        "id": prepared.turn_id, "object": "response", "created_at": int(prepared.started), "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": error, "model": model, "output": output,
        "instructions": body.instructions, "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
        "temperature": body.temperature, "top_p": body.top_p, "tool_choice": body.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "max_output_tokens": body.max_output_tokens,
        "text": body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {"format": {"type": "text"}},
        "usage": usage,
    }


class ResponseEvents:
    """The `StreamFormat` of a streamed Responses call (the event sequence in the module docstring)."""

    def __init__(self, model: str, body: ResponsesRequest, prepared: PreparedTurn) -> None:
        self.model = model
        self.body = body
        self.prepared = prepared
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        """Items closed so far, as `response.completed` lists them."""
        self.open: dict[str, Any] | None = None
        self.open_text = ""

    def event(self, kind: str, **fields: Any) -> bytes:
        data = orjson.dumps({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def _response(self, status: str, gen: Generation | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.model, self.body, self.prepared, list(self.output), status=status, gen=gen,
                               error=error)

    # --- StreamFormat ---

    def start(self, gen: Generation) -> list[bytes]:
        snapshot = self._response("in_progress", None)
        return [self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot)]

    def text(self, kind: str, piece: str, span: tuple[int, int] | None) -> list[bytes]:
        want = "reasoning" if kind == "reasoning_content" else "message"
        out = []
        if self.open is None or self.open["type"] != want:
            out += self._close()
            out += self._open(want)
        assert self.open is not None
        self.open_text += piece
        where = {"item_id": self.open["id"], "output_index": len(self.output)}
        if want == "reasoning":
            out.append(self.event("response.reasoning_summary_text.delta", **where, summary_index=0, delta=piece))
        else:
            out.append(self.event("response.output_text.delta", **where, content_index=0, delta=piece,
                                  logprobs=[]))
        return out

    def tokens(self, span: tuple[int, int]) -> list[bytes]:
        return []

    def end(self, done: FinishedTurn, final: ParsedReply, gen: Generation) -> list[bytes]:
        out = self._close()
        for tc in done.parsed.tool_calls:  # the stored reply's calls: their ids are the record's
            index = len(self.output)
            item = function_call_item(tc)
            where = {"item_id": item["id"], "output_index": index}
            out.append(self.event("response.output_item.added", output_index=index,
                                  item=function_call_item(tc, "", "in_progress")))
            out.append(self.event("response.function_call_arguments.delta", **where, delta=tc.arguments))
            out.append(self.event("response.function_call_arguments.done", **where, arguments=tc.arguments,
                                  name=tc.name))
            out.append(self.event("response.output_item.done", output_index=index, item=item))
            self.output.append(item)
        incomplete = done.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        out.append(self.event(f"response.{status}", response=self._response(status, gen)))
        return out

    def error(self, exc: GatewayError) -> list[bytes]:
        err = exc.body()["error"]
        failed = self._response("failed", None, {"code": "server_error" if exc.status >= 500 else "invalid_prompt",
                                                 "message": err["message"]})
        return [self.event("response.failed", response=failed)]

    # --- items ---

    def _open(self, kind: str) -> list[bytes]:
        index = len(self.output)
        if kind == "reasoning":
            self.open = {"type": "reasoning", "id": new_item_id("rs_"), "summary": []}
            return [self.event("response.output_item.added", output_index=index, item=self.open),
                    self.event("response.reasoning_summary_part.added", item_id=self.open["id"], output_index=index,
                               summary_index=0, part={"type": "summary_text", "text": ""})]
        self.open = message_item(new_item_id("msg_"), "", "in_progress")
        self.open["content"] = []
        return [self.event("response.output_item.added", output_index=index, item=self.open),
                self.event("response.content_part.added", item_id=self.open["id"], output_index=index,
                           content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        index, item_id, text = len(self.output), self.open["id"], self.open_text
        where = {"item_id": item_id, "output_index": index}
        if self.open["type"] == "reasoning":
            item = reasoning_item(item_id, text)
            part = item["summary"][0]
            out = [self.event("response.reasoning_summary_text.done", **where, summary_index=0, text=text),
                   self.event("response.reasoning_summary_part.done", **where, summary_index=0, part=part)]
        else:
            item = message_item(item_id, text)
            part = item["content"][0]
            out = [self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                   self.event("response.content_part.done", **where, content_index=0, part=part)]
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        self.open, self.open_text = None, ""
        return out
