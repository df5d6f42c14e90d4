"""Chat templating and the token chain of multi-turn sessions, on locally trained tokenizers.

The session tests play the gateway's part turn by turn (choose_parent -> extension_ids -> the model's
ids -> parse -> stored reply) and check the chain against one render of the final conversation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.continuity import Candidate, choose_parent
from gateway.templating import ChatTemplate
from tests.gateway.template_calls import extension_ids, parse, render_ids
from tests.gateway.text_tokenizers import chatml, llama31, model_reply_ids

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

TEMPLATES = {"chatml": chatml, "llama31": llama31}


def call(city: str, content: str | None = None, call_id: str = "call_x") -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
            }
        ],
    }


# (new messages of each turn, the reply the model gives); tool results get the call's id filled in
SCRIPT: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    (
        [
            {"role": "system", "content": "You answer weather questions."},
            {"role": "user", "content": "What is the weather in Paris?"},
        ],
        call("Paris"),
    ),
    ([{"role": "tool", "content": "sunny, 21 C"}], {"role": "assistant", "content": "It is sunny in Paris."}),
    ([{"role": "user", "content": "And in Rome?"}], call("Rome", "Checking Rome.")),
    ([{"role": "tool", "content": "rain, 14 C"}], {"role": "assistant", "content": "It is raining in Rome."}),
]


@dataclass
class Session:
    """The gateway's view of one session: candidates, chains (prompt + completion) and masks."""

    ct: ChatTemplate
    candidates: list[Candidate] = field(default_factory=list)
    chains: dict[str, list[int]] = field(default_factory=dict)
    masks: dict[str, list[int]] = field(default_factory=dict)
    completions: dict[str, list[int]] = field(default_factory=dict)
    extensions: list[list[int]] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)

    def turn(self, messages: list[dict[str, Any]], completion: list[int]) -> dict[str, Any]:
        """One chat call: returns the stored reply (what the client gets back)."""
        choice = choose_parent(self.candidates, messages, TOOLS)
        self.reasons.append(choice.reason)
        if choice.parent_turn_id is not None:
            parent = next(c for c in self.candidates if c.turn_id == choice.parent_turn_id)
            ext = extension_ids(
                self.ct, parent.messages, self.completions[parent.turn_id], messages[len(parent.messages) :], TOOLS
            )
            assert ext is not None
            self.extensions.append(ext)
            prompt = self.chains[parent.turn_id] + ext
            mask = self.masks[parent.turn_id] + [0] * len(ext)
        else:
            prompt = render_ids(self.ct, messages, TOOLS)
            mask = [0] * len(prompt)
        turn_id = f"t{len(self.candidates)}"
        reply = self.ct.assistant_message(parse(self.ct, completion))
        self.candidates.append(Candidate(turn_id, [*messages, reply], TOOLS, len(self.candidates)))
        self.chains[turn_id] = prompt + completion
        self.masks[turn_id] = mask + [1] * len(completion)
        self.completions[turn_id] = completion
        return reply


def play(
    ct: ChatTemplate, replay: Any = lambda m: m
) -> tuple[Session, list[dict[str, Any]], list[list[int]]]:
    """Run SCRIPT; `replay` is what the client does to its history before sending it back."""
    session, history, model_ids = Session(ct), [], []
    for new, target in SCRIPT:
        new = [dict(m) for m in new]
        for m in new:
            if m["role"] == "tool":
                m["tool_call_id"] = history[-1]["tool_calls"][0]["id"]
        request = [*[replay(m) for m in history], *new]
        ids = model_reply_ids(ct, request, target, TOOLS)
        model_ids.append(ids)
        history = [*request, session.turn(request, ids)]
    return session, history, model_ids


@pytest.mark.parametrize("name", ["chatml", "llama31"])
def test_session_is_one_chain_equal_to_one_render(name: str) -> None:
    ct = TEMPLATES[name]()
    session, history, model_ids = play(ct)
    assert session.reasons == ["first_turn", None, None, None]
    chain, mask = session.chains["t3"], session.masks["t3"]

    # Token for token what one render of the final conversation gives, up to the last end-of-turn;
    # after it the template only adds its bridge (ChatML "\n", Llama nothing).
    final = ct.render_text(history, TOOLS, add_generation_prompt=False)
    end = len(final) - len({"<|im_end|>": "\n", "<|eot_id|>": ""}[ct.end_of_turn])
    assert ct.decode(chain) == final[:end]
    assert chain == ct.encode(final[:end])

    # The loss mask covers exactly the model's own ids, in order.
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append(chain[start:i])
            start = None
    assert spans == model_ids

    # The replies parsed back from those ids are what the client saw and sent back.
    replies = [m for m in history if m["role"] == "assistant"]
    assert [
        [(c["function"]["name"], c["function"]["arguments"]) for c in r.get("tool_calls", [])]
        for r in replies
    ] == [[("get_weather", '{"city": "Paris"}')], [], [("get_weather", '{"city": "Rome"}')], []]
    tool_ids = [m["tool_call_id"] for m in history if m["role"] == "tool"]
    assert tool_ids == [replies[0]["tool_calls"][0]["id"], replies[2]["tool_calls"][0]["id"]]


def test_chatml_bridge_is_the_newline_after_im_end() -> None:
    ct = chatml()
    session, _, _ = play(ct)
    tok = ct.tokenizer
    for ext in session.extensions:
        assert tok.convert_ids_to_tokens(ext[:2]) == ["Ċ", "<|im_start|>"]  # "\n" the model never generated
        assert tok.convert_ids_to_tokens(ext[-4:]) == ["Ċ", "<|im_start|>", "assistant", "Ċ"]
    assert ct.decode(session.extensions[0]) == (
        "\n<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        ct.decode(session.extensions[1])
        == "\n<|im_start|>user\nAnd in Rome?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama31_bridge_is_empty_and_tool_calls_end_with_eom() -> None:
    ct = llama31()
    session, _, model_ids = play(ct)
    tok = ct.tokenizer
    assert tok.convert_ids_to_tokens([model_ids[0][0], model_ids[0][-1]]) == ["<|python_tag|>", "<|eom_id|>"]
    assert tok.convert_ids_to_tokens(model_ids[1][-1:]) == ["<|eot_id|>"]
    assert ct.decode(session.extensions[0]) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\nsunny, 21 C<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert ct.decode(session.extensions[1]) == (
        "<|start_header_id|>user<|end_header_id|>\n\nAnd in Rome?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # exactly one BOS, from the template (render_ids adds no special tokens of its own)
    chain = session.chains["t3"]
    assert chain.count(tok.convert_tokens_to_ids("<|begin_of_text|>")) == 1 and tok.convert_ids_to_tokens(
        chain[:1]
    ) == ["<|begin_of_text|>"]


def _client_rewrites(m: dict[str, Any]) -> dict[str, Any]:
    """What SDKs do to history: reorder keys, add nulls, re-serialise arguments, use content parts,
    drop reasoning."""
    out: dict[str, Any] = dict(reversed(list(m.items())))
    out.update({"name": None, "refusal": None})
    out.pop("reasoning_content", None)
    if isinstance(m.get("content"), str) and m["content"]:
        out["content"] = [
            {"type": "text", "text": m["content"][:3]},
            {"text": m["content"][3:], "type": "text"},
        ]
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {
                "function": {
                    "arguments": json.dumps(json.loads(c["function"]["arguments"]), indent=1),
                    "name": c["function"]["name"],
                },
                "type": "function",
                "id": c["id"],
            }
            for c in m["tool_calls"]
        ]
    return out


@pytest.mark.parametrize("name", ["chatml", "llama31"])
def test_rewritten_replays_extend_with_the_same_ids(name: str) -> None:
    ct = TEMPLATES[name]()
    exact, _, _ = play(ct)
    rewritten, _, _ = play(ct, _client_rewrites)
    assert rewritten.reasons == ["first_turn", None, None, None]
    assert rewritten.chains["t3"] == exact.chains["t3"]
    assert rewritten.masks["t3"] == exact.masks["t3"]


def test_edited_message_starts_a_new_chain() -> None:
    ct = chatml()
    session, history, _ = play(ct)
    edited = [
        *history[:1],
        {"role": "user", "content": "What is the weather in Lyon?"},
        *history[2:],
        {"role": "user", "content": "Thanks."},
    ]
    choice = choose_parent(session.candidates, edited, TOOLS)
    assert (choice.parent_turn_id, choice.reason) == (None, "edited_message")
    # the new chain is the conversation rendered afresh
    assert render_ids(ct, edited, TOOLS) == ct.encode(ct.render_text(edited, TOOLS))


@pytest.mark.parametrize("name", ["chatml", "llama31"])
def test_reply_cut_by_max_tokens_is_closed_by_the_extension(name: str) -> None:
    ct = TEMPLATES[name]()
    request = SCRIPT[0][0]
    cut = ct.encode("The weather in Paris is")  # no stop token: finish reason "length"
    reply = ct.assistant_message(parse(ct, cut, tools_offered=False))
    assert reply == {"role": "assistant", "content": "The weather in Paris is"}
    new = [{"role": "user", "content": "Go on."}]
    ext = extension_ids(ct, [*request, reply], cut, new, TOOLS)
    assert ext is not None
    assert ext[0] == ct.end_of_turn_id
    assert (
        ct.decode(ext)
        == ct.end_of_turn
        + {
            "<|im_end|>": "\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n",
            "<|eot_id|>": "<|start_header_id|>user<|end_header_id|>\n\nGo on.<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        }[ct.end_of_turn]
    )


def test_llama31_plain_json_reply_ending_in_eot_keeps_the_models_token() -> None:
    """Llama 3.1 may answer a call as plain JSON + <|eot_id|> where the template writes
    <|python_tag|>...<|eom_id|>: the chain keeps what the model emitted; the bridge is still empty."""
    ct = llama31()
    request = SCRIPT[0][0]
    ids = [*ct.encode('{"name": "get_weather", "parameters": {"city": "Paris"}}'), ct.end_of_turn_id]
    parsed = parse(ct, ids)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    reply = ct.assistant_message(parsed)
    result = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "sunny"}
    ext = extension_ids(ct, [*request, reply], ids, [result], TOOLS)
    assert ext is not None
    assert ct.decode(ext) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
