"""Forced tool choice and response_format through the gateway, against the fake SGLang: the grammar the
backend gets is SGLang's exact `structural_tag` / `json_schema` (docs/sglang-contract.md "Constrained
decoding"), refusals are 400s naming what is wrong, and constrained turns are kept out of the loss unless
the lease asks for them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from rollway_common.wire import decode_array
from tests.fakes.sglang import FakeSGLang
from tests.gateway.conftest import ids_of
from tests.harness import LiveGateway

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PING = {"type": "function", "function": {"name": "ping"}}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def hermes_tag(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """One call as the tiny model's (Hermes/Qwen) template writes it, spelled out here on purpose."""
    return {"type": "tag", "begin": '<tool_call>\n{"name": "' + name + '", "arguments": ',
            "content": {"type": "json_schema", "json_schema": params}, "end": "}\n</tool_call>"}


def sent(fake: FakeSGLang) -> dict[str, Any]:
    return fake.requests[-1]["sampling_params"]  # type: ignore[no-any-return]


def client(gateway: LiveGateway) -> tuple[dict[str, Any], openai.OpenAI]:
    cred = gateway.group(2)["sessions"][0]
    return cred, gateway.openai(cred)


def test_required_sends_the_family_structural_tag(gateway: LiveGateway, fake: FakeSGLang, tokenizer: Any) -> None:
    _, oa = client(gateway)
    fake.script([ids_of(tokenizer, CALL)])
    r = oa.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER, PING], tool_choice="required")
    tag = json.loads(sent(fake)["structural_tag"])
    assert tag == {"type": "structural_tag", "format": {
        "type": "tags_with_separator", "separator": "\n", "at_least_one": True, "stop_after_first": False,
        "tags": [hermes_tag("get_weather", WEATHER["function"]["parameters"]),
                 hermes_tag("ping", {"type": "object", "properties": {}})]}}
    assert "json_schema" not in sent(fake)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_named_function_without_parallel_calls(gateway: LiveGateway, fake: FakeSGLang, tokenizer: Any) -> None:
    _, oa = client(gateway)
    fake.script([ids_of(tokenizer, CALL)])
    oa.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER, PING], parallel_tool_calls=False,
                               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    fmt = json.loads(sent(fake)["structural_tag"])["format"]
    assert fmt["stop_after_first"] is True and fmt["at_least_one"] is True
    assert fmt["tags"] == [hermes_tag("get_weather", WEATHER["function"]["parameters"])]


def test_auto_and_none_send_no_grammar(gateway: LiveGateway, fake: FakeSGLang, tokenizer: Any) -> None:
    _, oa = client(gateway)
    for choice in ("auto", "none"):
        fake.script([ids_of(tokenizer, "hi")])
        oa.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER], tool_choice=choice,
                                   parallel_tool_calls=False)
        assert not {"structural_tag", "json_schema", "regex", "ebnf"} & set(sent(fake))


def test_response_format_sends_json_schema(gateway: LiveGateway, fake: FakeSGLang, tokenizer: Any) -> None:
    _, oa = client(gateway)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fake.script([ids_of(tokenizer, '{"n": 3}')])
    r = oa.chat.completions.create(model="m", messages=MESSAGES, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert json.loads(sent(fake)["json_schema"]) == schema
    assert json.loads(r.choices[0].message.content) == {"n": 3}
    fake.script([ids_of(tokenizer, "{}")])
    oa.chat.completions.create(model="m", messages=MESSAGES, response_format={"type": "json_object"})
    assert json.loads(sent(fake)["json_schema"]) == {"type": "object"}


@pytest.mark.parametrize(("kwargs", "param", "needle"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
])
def test_refusals(gateway: LiveGateway, fake: FakeSGLang, kwargs: dict[str, Any], param: str, needle: str) -> None:
    _, oa = client(gateway)
    before = len(fake.requests)
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model="m", messages=MESSAGES, **kwargs)
    body = err.value.body
    assert isinstance(body, dict) and body.get("param") == param and needle in body["message"]
    assert len(fake.requests) == before  # refused before any backend was called


@pytest.fixture(scope="module")
def mistral_gateway(fake: FakeSGLang, tiny_model_dir: Path, sqlite_url: str) -> Iterator[LiveGateway]:
    with LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=sqlite_url, tool_parser="mistral") as gw:
        yield gw


def test_a_family_without_a_grammar_is_refused_by_name(mistral_gateway: LiveGateway, fake: FakeSGLang) -> None:
    _, oa = client(mistral_gateway)
    before = len(fake.requests)
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER], tool_choice="required")
    assert "(mistral)" in err.value.body["message"] and err.value.body["code"] == "unsupported_tool_choice"
    assert len(fake.requests) == before


def test_backend_grammar_errors_are_400s(gateway: LiveGateway, fake: FakeSGLang) -> None:
    """The fake checks the grammar keys as SGLang does: two at once is its 400, relayed as the agent's 400."""
    r = fake_post(fake, {"json_schema": "{}", "regex": "a"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "Only one of json_schema, regex, ebnf, or structural_tag can be set."
    r = fake_post(fake, {"regex": "a", "structural_tag": json.dumps({"type": "structural_tag", "format": {}})})
    assert r.status_code == 400 and "or structural_tag can be set" in r.json()["error"]["message"]  # 0.5.23
    r = fake_post(fake, {"structural_tag": json.dumps({"type": "structural_tag"})})
    assert r.status_code == 400 and "Failed to compile structural_tag grammar" in r.json()["error"]["message"]


def fake_post(fake: FakeSGLang, sampling: dict[str, Any]) -> Any:
    import httpx

    return httpx.post(f"{fake.url}/generate", json={"input_ids": [1, 2], "sampling_params": sampling}, timeout=10)


def play_forced(gateway: LiveGateway, fake: FakeSGLang, tokenizer: Any, cred: dict[str, Any]) -> None:
    """A free turn, then a forced one that extends it; reward 1 and finish."""
    oa = gateway.openai(cred)
    fake.script([ids_of(tokenizer, "let me look")])
    first = oa.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER])
    fake.script([ids_of(tokenizer, CALL)])
    oa.chat.completions.create(model="m", tools=[WEATHER], tool_choice="required", messages=[
        *MESSAGES, {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "use the tool"}])
    r = gateway.admin.post(f"/v1/sessions/{cred['session_id']}/reward", json={"reward": 1.0, "finish": True})
    assert r.status_code == 200, r.text


def test_constrained_tokens_are_out_of_the_loss_unless_asked(
    gateway: LiveGateway, fake: FakeSGLang, tokenizer: Any
) -> None:
    for body in ({}, {"train_constrained_turns": True}):
        while gateway.admin.post("/v1/batches", json={"max_groups": 64}).json()["groups"]:
            pass  # earlier tests' groups are not the subject
        g = gateway.group(2)
        for cred in g["sessions"]:
            play_forced(gateway, fake, tokenizer, cred)
        batch = gateway.admin.post("/v1/batches", json={"max_groups": 8, **body}).json()
        (group,) = batch["groups"]
        for sample in group["samples"]:
            turns = gateway.session(sample["session_id"])["turns"]
            tokens, mask = decode_array(sample["token_ids"]), decode_array(sample["loss_mask"])
            trained = [t for t, m in zip(tokens, mask, strict=True) if m]
            free, forced = turns[0]["completion_ids"], turns[1]["completion_ids"]
            assert [t["constrained"] for t in turns] == [False, True]  # the session record says which
            assert tokens == turns[1]["prompt_ids"] + forced
            assert trained == (free + forced if body else free)
        gateway.admin.post(f"/v1/batches/{batch['batch_id']}/ack", json={"results": {}})


def test_streamed_required_call(gateway: LiveGateway, fake: FakeSGLang, tokenizer: Any) -> None:
    _, oa = client(gateway)
    fake.script([ids_of(tokenizer, CALL)])
    chunks = list(oa.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                             stream=True))
    assert fake.requests[-1]["stream"] is True and "structural_tag" in sent(fake)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["get_weather"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_responses_named_function(gateway: LiveGateway, fake: FakeSGLang, tokenizer: Any) -> None:
    """The Responses API's {"type": "function", "name"} goes through the same grammar."""
    _, oa = client(gateway)
    fake.script([ids_of(tokenizer, CALL)])
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    r = oa.responses.create(model="m", input="weather?", tools=[tool, {"type": "function", "name": "ping"}],
                            tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    fmt = json.loads(sent(fake)["structural_tag"])["format"]
    assert fmt["stop_after_first"] is True
    assert fmt["tags"] == [hermes_tag("get_weather", WEATHER["function"]["parameters"])]
    assert [o.name for o in r.output if o.type == "function_call"] == ["get_weather"]


def test_responses_text_format_with_a_forced_function(gateway: LiveGateway, fake: FakeSGLang, tokenizer: Any) -> None:
    """Instructor's Mode.RESPONSES_TOOLS: text.format (json_schema, the tool's own schema) and a forced function.
    OpenAI's API accepts the pair: the forced call wins and text.format is for text output, which a forced reply
    has none of. The backend gets the call's grammar only (SGLang takes one constraint)."""
    cred, oa = client(gateway)
    params = WEATHER["function"]["parameters"]
    fake.script([ids_of(tokenizer, CALL)])
    r = oa.responses.create(
        model="m", input="weather?", tools=[{"type": "function", "name": "get_weather", "parameters": params,
                                             "strict": True}],
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "get_weather", "strict": True, "schema": params}})
    assert "json_schema" not in sent(fake)
    assert json.loads(sent(fake)["structural_tag"])["format"]["tags"] == [hermes_tag("get_weather", params)]
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    [turn] = gateway.session(cred["session_id"])["turns"]
    assert turn["request"]["asked"]["text"]["format"] == {"type": "json_schema", "name": "get_weather", "strict": True,
                                                        "schema": params}  # recorded as sent
    # the same on chat completions, with response_format
    fake.script([ids_of(tokenizer, CALL)])
    c = oa.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                   response_format={"type": "json_object"})
    assert "json_schema" not in sent(fake) and c.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "word " * 5000}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}], "tool_choice": "required"},
     "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {
        "type": "object", "properties": {"n": {"type": "string", "format": "email", "pattern": "@"}}}}}},
     "text.format"),
])
def test_responses_errors_name_the_callers_field(gateway: LiveGateway, fake: FakeSGLang, kwargs: dict[str, Any],
                                                 param: str) -> None:
    """A refusal on /v1/responses names the Responses field (input, max_output_tokens, text.format), never the
    Chat Completions one the turn service works with (messages, max_tokens, response_format)."""
    _, oa = client(gateway)
    n = len(fake.requests)
    with pytest.raises(openai.BadRequestError) as err:
        oa.responses.create(model="m", **kwargs)
    body = err.value.body
    assert isinstance(body, dict) and body.get("param") == param, body
    assert len(fake.requests) == n


def test_the_trainers_option_reaches_the_lease(gateway: LiveGateway, fake: FakeSGLang, tokenizer: Any) -> None:
    """`rollway train --train_constrained_turns` (or ROLLWAY_TRAIN_CONSTRAINED_TURNS): the trainer's real client
    sends it with the lease, and the constrained call's tokens come back trained."""
    from tests.harness import ADMIN_KEY
    from trainer.client import GatewayClient
    from trainer.config import load_config

    cfg = load_config(overrides={"gateway": gateway.url}, environ={"ROLLWAY_TRAIN_CONSTRAINED_TURNS": "true"})
    assert cfg.train_constrained_turns is True
    assert load_config(overrides={"gateway": gateway.url}, environ={}).train_constrained_turns is False
    while gateway.admin.post("/v1/batches", json={"max_groups": 64}).json()["groups"]:
        pass
    for cred in gateway.group(2)["sessions"]:
        play_forced(gateway, fake, tokenizer, cred)
    with GatewayClient(gateway.url, ADMIN_KEY) as c:
        lease = c.lease(max_groups=8, lease_seconds=60, wait_seconds=0, groups_per_step=8,
                        max_head_offpolicyness=-1, trainer_version=0,
                        train_constrained_turns=cfg.train_constrained_turns)
    assert lease is not None
    (group,) = lease.groups
    for sample in group.samples:
        turns = gateway.session(sample.session_id)["turns"]
        trained = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
        assert trained == turns[0]["completion_ids"] + turns[1]["completion_ids"]
