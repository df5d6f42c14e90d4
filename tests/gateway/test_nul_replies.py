"""A model can generate the NUL byte, but the gateway refuses a request that holds one (PostgreSQL can't store
it). So a reply never carries a NUL: it is written U+FFFD, the recorded ids stay the model's, and an agent that
sends the reply back extends the same token chain (found with the random tiny model: its reply came back as a
400 on the next turn)."""

from __future__ import annotations

from typing import Any

from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway


def test_a_generated_nul_comes_back_as_a_replacement_character_and_the_chain_extends(
    gateway: LiveGateway, fake: FakeSGLang, tokenizer: Any
) -> None:
    nul = tokenizer.convert_tokens_to_ids("\u0100")  # byte-level BPE's token for the byte 0x00
    assert tokenizer.decode([nul]) == "\x00"
    words = tokenizer.encode("ab", add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cred = gateway.group(2)["sessions"][0]
    oa = gateway.openai(cred)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    fake.script([[*words, nul, *words, end]])
    first = oa.chat.completions.create(model="m", messages=messages, max_tokens=16)
    content = first.choices[0].message.content
    assert content == "ab\ufffdab"
    fake.script([[*words, end]])
    oa.chat.completions.create(model="m", max_tokens=16, messages=[
        *messages, {"role": "assistant", "content": content}, {"role": "user", "content": "again"}])
    turns = gateway.session(cred["session_id"])["turns"]
    assert [t["continuity"] for t in turns] == ["new-chain", "extends"]
    assert turns[0]["completion_ids"] == [*words, nul, *words, end]
    chain = turns[0]["prompt_ids"] + turns[0]["completion_ids"]
    assert turns[1]["prompt_ids"][: len(chain)] == chain
