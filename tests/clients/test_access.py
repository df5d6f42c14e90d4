"""How real clients reach a session: the Anthropic SDK with its `x-api-key`, with a bearer token
(`auth_token`), and on the keyless session URL; `/v1/models` as each SDK reads it. Each call is checked on
the engine's tokens."""

from __future__ import annotations

import anthropic
import pytest
from openai import OpenAI

from tests.clients.conftest import Stack, assert_engine_chain
from tests.clients.model import GREETING

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HELLO = [{"role": "user", "content": "Good morning to you."}]


@pytest.mark.parametrize("how", ["x-api-key", "bearer", "session-url"])
def test_anthropic_auth(stack: Stack, how: str) -> None:
    s, since = stack.new_session(), stack.proxy.mark()
    if how == "x-api-key":
        c = anthropic.Anthropic(base_url=s.anthropic_base_url, api_key=s.api_key, max_retries=0)
    elif how == "bearer":
        c = anthropic.Anthropic(base_url=s.anthropic_base_url, auth_token=s.api_key, max_retries=0)
    else:
        url = s.raw["anthropic_session_base_url"]
        assert url.endswith(f"/sessions/{s.id}")
        c = anthropic.Anthropic(base_url=url, api_key="not-a-key", max_retries=0)
    r = c.messages.create(model="policy", max_tokens=64, messages=HELLO)
    assert [b.text for b in r.content if b.type == "text"] == [GREETING]
    assert_engine_chain(stack, s.id, since, turns=1)


def test_a_wrong_key_is_anthropics_authentication_error(stack: Stack) -> None:
    s, since = stack.new_session(), stack.proxy.mark()
    c = anthropic.Anthropic(base_url=s.anthropic_base_url, api_key="rw-not-issued", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        c.messages.create(model="policy", max_tokens=64, messages=HELLO)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert stack.proxy.generate_records(since) == []


def test_models_in_each_sdks_shape(stack: Stack) -> None:
    s = stack.new_session()
    served = stack.model.name
    a = anthropic.Anthropic(base_url=s.anthropic_base_url, api_key=s.api_key, max_retries=0)
    [am] = list(a.models.list())
    assert am.type == "model" and am.id == served
    assert a.models.retrieve(served).id == served
    o = OpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
    [om] = list(o.models.list())
    assert om.object == "model" and om.id == served
    assert o.models.retrieve(served).id == served
