"""Real model families (docs/models.md): each family's own chat template and vocabulary (tests/realfiles.py).

The first run downloads the pinned llama-cpp-python sdist (77 MB) into ~/.cache/rollway-test-files and builds
16 tokenizers there (a few minutes on 2 cores); later runs load them in about a second each. Without a package
index these tests skip, saying why.

    pytest tests/gateway/test_model_families.py

The fake backend's replies are never written by hand: they are the family's template's rendering of an
assistant message (tests/model_checks.py), which the gateway must give back whole and streamed. Then, through
the gateway: DeepSeek-R1's opened `<think>`, Qwen3's `enable_thinking`, a template whose tool format is
unknown, and the multi-turn cases of docs/models.md "Multi-turn" with the training samples they make.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.samples import Sequence, session_sequences
from gateway.services import app_serving
from gateway.store.db import upgrade
from gateway.store.store import TurnRow
from gateway.templating import ChatTemplate
from rollway_common.wire import pack
from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway
from tests.model_checks import (
    ANSWER,
    CALL,
    REASONING,
    RESULT,
    SYSTEM,
    TOOLS,
    USER,
    check_family,
    render_reply,
    template_of,
)
from tests.realfiles import BY_NAME, FAMILIES, Unavailable, models_dir, tokenizer_dir


def _db(folder: Path) -> str:
    """A fresh, migrated SQLite database in `folder` (several gateways here, one database each)."""
    url = f"sqlite:///{folder / 'rollway.db'}"
    upgrade(url)
    return url


THINKING = {"Qwen3", "QwQ", "DeepSeek-R1-Distill", "DeepSeek V3.1", "GLM-4.6", "gpt-oss", "Nemotron Nano 2"}


@pytest.fixture(scope="module")
def real_files() -> Path:
    try:
        return models_dir()
    except Unavailable as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_family(real_files: Path, name: str) -> None:
    """Every matrix cell of the family holds (a cell that does not apply must be a family without reasoning)."""
    res = check_family(BY_NAME[name])
    failed = {col: text for col, (ok, text) in res.cells.items() if ok is False}
    assert not failed
    skipped = {col for col, (ok, _) in res.cells.items() if ok is None}
    assert skipped == (set() if name in THINKING else {"reasoning split"})


FORMATS = {
    "Qwen2.5": "hermes", "Qwen3": "hermes", "Qwen3-Coder": "qwen3_coder", "QwQ": "hermes", "Llama 3.1": "llama3_json",
    "Llama 3.2": "llama3_json", "Hermes 3": "hermes", "DeepSeek-R1-Distill": "deepseek", "DeepSeek V3.1": "deepseek",
    "Mistral Nemo": "mistral", "Mistral Small 3.2": "mistral", "GLM-4.6": "glm45", "Kimi-K2": "kimi_k2",
    "gpt-oss": "harmony", "Granite 3.3": "granite", "Granite 4.0": "hermes", "Nemotron Nano 2": "nemotron_json",
}


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_the_format_is_told_from_the_real_template(real_files: Path, name: str) -> None:
    formats = template_of(BY_NAME[name]).formats
    assert (formats.tool_parser, formats.tool_source) == (FORMATS[name], "template")
    assert formats.reasoning_parser == ("harmony" if name == "gpt-oss" else "think")


# --- through the gateway ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def families_gw(real_files: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One fake backend and a gateway per family, started on first use."""
    started: dict[str, Any] = {}
    fake = FakeSGLang(vocab=range(100, 1000)).start()
    try:
        def gateway(name: str) -> tuple[LiveGateway, ChatTemplate]:
            if name not in started:
                db = _db(tmp_path_factory.mktemp("db"))
                gw = LiveGateway(backends=[fake.url], tokenizer=str(tokenizer_dir(BY_NAME[name])), db=db).__enter__()
                started[name] = gw
            gw = started[name]
            return gw, app_serving(gw.app).template

        yield {"fake": fake, "gateway": gateway}
    finally:
        for gw in started.values():
            gw.__exit__(None, None, None)
        fake.stop()


def _chat(gw: LiveGateway, cred: dict[str, Any], messages: list[dict[str, Any]], stream: bool = False,
          **extra: Any) -> dict[str, Any]:
    """One chat completion as plain JSON: the message (whole, or assembled from the stream's deltas)."""
    body = {"model": "m", "messages": messages, "max_tokens": 200, "stream": stream, **extra}
    headers = {"Authorization": f"Bearer {cred['api_key']}"}
    import httpx

    with httpx.Client(base_url=cred["base_url"], timeout=60) as client:
        if not stream:
            r = client.post("/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            return dict(r.json()["choices"][0]["message"])
        out: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
        with client.stream("POST", "/chat/completions", json=body, headers=headers) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"]
                for key in ("content", "reasoning_content"):
                    out[key] += delta.get(key) or ""
                out["tool_calls"] += delta.get("tool_calls") or []
        return out


@pytest.mark.parametrize("stream", [False, True])
def test_deepseek_r1_reply_starts_inside_the_reasoning(families_gw: dict[str, Any], stream: bool) -> None:
    """R1's generation prompt opens `<think>`: the reply only closes it. The reasoning comes back as
    reasoning_content and the answer as content, with no stray `</think>`, whole and streamed."""
    gw, ct = families_gw["gateway"]("DeepSeek-R1-Distill")
    answer = {**ANSWER, "reasoning_content": REASONING}
    reply = render_reply(ct, [SYSTEM, USER], answer, None)
    assert ct.opens_reasoning(reply.prompt_text)
    families_gw["fake"].script([reply.ids])
    msg = _chat(gw, gw.group(1)["sessions"][0], [SYSTEM, USER], stream=stream)
    assert msg["content"] == ANSWER["content"]
    assert msg["reasoning_content"] == REASONING
    assert "</think>" not in msg["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_nemotron_forced_call_after_the_opened_reasoning(families_gw: dict[str, Any], stream: bool) -> None:
    """Nemotron Nano 2's generation prompt opens `<think>`: a forced tool_choice lets the reply reason up to
    `</think>`, then holds it to the family's `<TOOLCALL>[...]</TOOLCALL>`; the reply (the template's own
    rendering of the call) comes back as reasoning and the call, whole and streamed."""
    gw, ct = families_gw["gateway"]("Nemotron Nano 2")
    call = {**CALL, "reasoning_content": REASONING}
    reply = render_reply(ct, [SYSTEM, USER], call, TOOLS)
    assert ct.opens_reasoning(reply.prompt_text) and "<TOOLCALL>[" in ct.completion_text(reply.ids)
    families_gw["fake"].script([reply.ids])
    msg = _chat(gw, gw.group(1)["sessions"][0], [SYSTEM, USER], stream=stream, tools=TOOLS, tool_choice="required")
    tag = json.loads(families_gw["fake"].requests[-1]["sampling_params"]["structural_tag"])["format"]
    assert [e["type"] for e in tag["elements"]] == ["tag", "const_string", "tags_with_separator", "const_string"]
    assert (tag["elements"][0]["end"], tag["elements"][1]["value"], tag["elements"][3]["value"]) == \
        ("</think>", "<TOOLCALL>[", "]</TOOLCALL>")
    assert tag["elements"][2]["tags"][0]["begin"] == '{"name": "get_weather", "arguments": '
    assert msg["reasoning_content"] == REASONING and not msg["content"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("get_weather", {"city": "Paris", "days": 3})]


def test_enable_thinking_reaches_the_template_and_a_change_is_a_new_chain(families_gw: dict[str, Any]) -> None:
    """Qwen3's chat_template_kwargs (what clients send with extra_body) reach the template and are recorded on
    the turn. A tool call made with thinking on; its result sent with {"enable_thinking": false}: that prompt
    closes the thinking block (the reply has none) and cannot extend the first turn, whose prompt rendered
    otherwise: a new chain, and why; the same result with thinking on extends it."""
    gw, ct = families_gw["gateway"]("Qwen3")
    fake = families_gw["fake"]
    cred = gw.group(1)["sessions"][0]
    on, off = {"enable_thinking": True}, {"enable_thinking": False}
    call = {**CALL, "reasoning_content": REASONING}
    fake.script([render_reply(ct, [SYSTEM, USER], call, TOOLS, on).ids])
    msg = _chat(gw, cred, [SYSTEM, USER], tools=TOOLS, chat_template_kwargs=on)
    assert msg["reasoning_content"] == REASONING and msg["tool_calls"][0]["function"]["name"] == "get_weather"

    later = [SYSTEM, USER, {k: v for k, v in msg.items() if v is not None},
             {**RESULT, "tool_call_id": msg["tool_calls"][0]["id"]}]
    answers = {}
    for kwargs in (off, on):
        reply = render_reply(ct, later, {**ANSWER, **({} if kwargs is off else {"reasoning_content": "Sunny."})},
                             TOOLS, kwargs)
        fake.script([reply.ids])
        answers[str(kwargs)] = _chat(gw, cred, later, tools=TOOLS, chat_template_kwargs=kwargs)
        if kwargs is off:
            assert ct.decode(fake.requests[-1]["input_ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert answers[str(off)]["content"] == ANSWER["content"] and not answers[str(off)].get("reasoning_content")
    assert answers[str(on)]["reasoning_content"] == "Sunny."
    turns = gw.session(cred["session_id"])["turns"]
    assert [t["request"]["chat_template_kwargs"] for t in turns] == [on, off, on]
    assert [(t["continuity"], t["chain_reason"]) for t in turns] == [
        ("new-chain", "first_turn"), ("new-chain", "different_template_kwargs"), ("extends", None)]
    assert turns[2]["parent_id"] == turns[0]["id"]


def test_settings_give_default_template_kwargs(real_files: Path, tmp_path: Path) -> None:
    """Settings.chat_template_kwargs reach every render; a request's own override them key by key."""
    with FakeSGLang(vocab=range(100, 1000)) as fake, LiveGateway(
            backends=[fake.url], tokenizer=str(tokenizer_dir(BY_NAME["Qwen3"])), db=_db(tmp_path),
            chat_template_kwargs={"enable_thinking": False}) as gw:
        ct = app_serving(gw.app).template
        cred = gw.group(1)["sessions"][0]
        fake.script([ct.encode("Hi.<|im_end|>"), ct.encode("Hi.<|im_end|>")])
        _chat(gw, cred, [USER])
        assert ct.decode(fake.requests[-1]["input_ids"]).endswith("<think>\n\n</think>\n\n")
        _chat(gw, cred, [USER], chat_template_kwargs={"enable_thinking": True})
        assert ct.decode(fake.requests[-1]["input_ids"]).endswith("<|im_start|>assistant\n")


def test_unknown_tool_format_refuses_tools_and_serves_the_rest(real_files: Path, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A custom template that writes tool calls in no known format: a warning at start, a 400 naming
    --tool-parser for requests with tools, and requests without tools served as before."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir(BY_NAME["Qwen2.5"]))
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if tools %}<|im_start|>system\nCall tools as CALL name(args).<|im_end|>\n{% endif %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(tmp_path / "custom")
    with caplog.at_level("WARNING", logger="rollway.gateway"), FakeSGLang(vocab=range(100, 1000)) as fake, \
            LiveGateway(backends=[fake.url], tokenizer=str(tmp_path / "custom"), db=_db(tmp_path)) as gw:
        assert any("--tool-parser" in r.getMessage() for r in caplog.records)
        cred = gw.group(1)["sessions"][0]
        import httpx

        r = httpx.post(f"{cred['base_url']}/chat/completions", headers={"Authorization": f"Bearer {cred['api_key']}"},
                       json={"model": "m", "messages": [USER], "tools": TOOLS}, timeout=60)
        assert r.status_code == 400
        err = r.json()["error"]
        assert "--tool-parser" in err["message"] and err["param"] == "tools" and err["type"] == "invalid_request_error"
        fake.script([app_serving(gw.app).template.encode("Sunny.<|im_end|>")])
        assert _chat(gw, cred, [USER])["content"] == "Sunny."


# --- multi-turn semantics and the training samples they make ---------------------------------------------


def _rows(record: dict[str, Any]) -> list[TurnRow]:
    """The stored turns of a session record, as the lease path reads them."""
    rows = []
    for t in record["turns"]:
        delta = t["prompt_ids"][len(t["prompt_ids"]) - t["prompt_delta_len"]:]
        rows.append(TurnRow(
            id=t["id"], seq=t["seq"], parent_id=t["parent_id"], request=t["request"], reply=t["reply"],
            prompt_ids=pack(delta, "int32"), completion_ids=pack(t["completion_ids"], "int32"),
            logprobs=pack(t["logprobs"], "float32"), versions=pack(t["versions"], "int32"),
            temperature=t["temperature"], finish_reason=t["finish_reason"], continuity=t["continuity"],
            chain_reason=t["chain_reason"], client_disconnected=t["client_disconnected"], reward=t["reward"],
            prompt_len=len(t["prompt_ids"]), timings=t["timings"]))
    return rows


def _trained(seq: Sequence) -> list[int]:
    return [t for t, m in zip(seq.token_ids, seq.loss_mask, strict=True) if m]


def _session(families_gw: dict[str, Any], name: str, call_reply: dict[str, Any], answer: dict[str, Any],
             replies_as: dict[str, list[int]] | None = None) -> tuple[ChatTemplate, dict[str, Any], list[list[int]]]:
    """Three turns: a tool call, the tool's result, a new user message after the answer. The model's replies are
    the template's renderings (or `replies_as`: the ids a model emits that the template writes otherwise)."""
    gw, ct = families_gw["gateway"](name)
    fake = families_gw["fake"]
    cred = gw.group(1)["sessions"][0]
    emitted = []
    history: list[dict[str, Any]] = [SYSTEM, USER]
    for step, (reply_msg, then) in enumerate(((call_reply, RESULT), (answer, {"role": "user", "content": "Thanks!"}),
                                              ({"role": "assistant", "content": "Bye."}, None))):
        ids = (replies_as or {}).get(str(step)) or render_reply(ct, history, reply_msg, TOOLS).ids
        emitted.append(ids)
        fake.script([ids])
        msg = _chat(gw, cred, history, tools=TOOLS)
        if then is None:
            break
        history = [*history, {k: v for k, v in msg.items() if v is not None}, then]
        if history[-1]["role"] == "tool":
            history[-1] = {**RESULT, "tool_call_id": msg["tool_calls"][0]["id"]}
    return ct, gw.session(cred["session_id"]), emitted


def test_qwen3_drops_earlier_reasoning_so_a_new_user_turn_is_a_new_chain(families_gw: dict[str, Any]) -> None:
    """Qwen3 keeps reasoning only after the last user message: the tool-result turn extends (its reasoning is
    still rendered), the turn after a new user message renders the earlier reasoning away, so it is a new
    chain (template_not_prefix_stable). Samples: the first chain trains both of its replies, the new chain its
    own, each reply exactly once, and the new chain's prompt holds no reasoning of earlier turns."""
    call = {**CALL, "reasoning_content": REASONING}
    answer = {**ANSWER, "reasoning_content": "Sunny: say so."}
    ct, rec, emitted = _session(families_gw, "Qwen3", call, answer)
    turns = rec["turns"]
    assert [(t["continuity"], t["chain_reason"]) for t in turns] == [
        ("new-chain", "first_turn"), ("extends", None), ("new-chain", "template_not_prefix_stable")]
    seqs = session_sequences(_rows(rec))
    assert len(seqs) == 2
    first, second = seqs
    assert first.token_ids == turns[1]["prompt_ids"] + emitted[1]
    assert _trained(first) == emitted[0] + emitted[1]
    assert second.token_ids == turns[2]["prompt_ids"] + emitted[2]
    assert _trained(second) == emitted[2]
    assert REASONING not in ct.decode(turns[2]["prompt_ids"]) and "Sunny: say so." not in ct.decode(turns[2]["prompt_ids"])


def test_llama31_python_tag_call_stays_as_the_model_emitted_it(families_gw: dict[str, Any]) -> None:
    """Llama 3.1's template re-renders a call as bare JSON ending in <|eot_id|>; the model emitted
    `<|python_tag|>{...}<|eom_id|>`. The chain keeps what the model emitted (it is what it saw next) and extends;
    the sample trains those exact ids, and the prompt parts carry no python tag of their own."""
    _, ct = families_gw["gateway"]("Llama 3.1")
    tok = ct.tokenizer
    python_tag, eom = tok.convert_tokens_to_ids(["<|python_tag|>", "<|eom_id|>"])
    model_call = [python_tag, *ct.encode('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'), eom]
    _, rec, emitted = _session(families_gw, "Llama 3.1", CALL, ANSWER, replies_as={"0": model_call})
    turns = rec["turns"]
    assert [t["continuity"] for t in turns] == ["new-chain", "extends", "extends"]
    assert rec["tool_calls"][0]["name"] == "get_weather"
    (seq,) = session_sequences(_rows(rec))
    assert seq.token_ids == turns[2]["prompt_ids"] + emitted[2]
    assert _trained(seq) == model_call + emitted[1] + emitted[2]
    untrained = [t for t, m in zip(seq.token_ids, seq.loss_mask, strict=True) if not m]
    assert python_tag not in untrained and eom not in untrained


def test_hermes3_tool_response_rendered_as_last_then_not(families_gw: dict[str, Any]) -> None:
    """Hermes 3 closes a tool message's `</tool_response>` differently when it is the last message; the chain
    holds what the model saw (the prompt that ended with the tool result) and the later turns extend it; one
    sequence trains each reply once."""
    ct, rec, emitted = _session(families_gw, "Hermes 3", CALL, ANSWER)
    turns = rec["turns"]
    assert [t["continuity"] for t in turns] == ["new-chain", "extends", "extends"]
    (seq,) = session_sequences(_rows(rec))
    assert seq.token_ids == turns[2]["prompt_ids"] + emitted[2]
    assert _trained(seq) == emitted[0] + emitted[1] + emitted[2]
    # What follows the first reply in the second prompt is the template's own rendering of the tool result
    # as the last message, generation prompt included.
    second = turns[1]
    added = ct.decode(second["prompt_ids"][len(turns[0]["prompt_ids"]) + len(emitted[0]):])
    assert "</tool_response>" in added and ct.render_text(second["request"]["messages"], TOOLS).endswith(added)
