"""`template_env.dict_attributes_fast`: a template reads a plain dict's keys as attributes without the sandbox's
AttributeError, and renders exactly what the sandbox renders (values, undefined names, names a dict has as
attributes, unsafe ones, other mappings), on hand-written templates and on the chat templates the tests use."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.template_env import dict_attributes_fast
from tests.gateway.text_tokenizers import chatml, llama31

CASES = [
    "{{ m.role }}:{{ m.content }}",
    "{{ m.missing is defined }} {{ m.missing | default('d') }} [{{ m.missing }}]",
    "{{ m.items is defined }} {{ m._private }} {{ m.__class__ is defined }}",  # a key named like a dict attribute
    "{% for c in m.tool_calls %}{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}",
    "{{ m.nested.deeper.deepest }} {{ m.nested['deeper'].deepest }} {{ m.nested.nothing is defined }}",
    "{{ om.role }} {{ om.items is defined }}",  # not a plain dict: the sandbox's way
    # a loop's counters, read directly; its other names (methods, items, private ones) the sandbox's way
    "{% for x in xs %}{{ loop.index0 }}{{ loop.index }}{{ loop.first }}{{ loop.last }}{{ loop.length }}"
    "{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.depth }}{{ loop.depth0 }}{{ loop.cycle('a', 'b') }}"
    "{{ loop.previtem }}{{ loop.nextitem }}{{ loop._length is defined }}{{ loop.nothing is defined }}{% endfor %}",
    "{% for x in tree recursive %}{{ loop.depth }}{{ loop.first }}[{{ loop(x.c) }}]{% endfor %}",
]
VALUES: dict[str, Any] = {
    "m": {"role": "user", "content": "hi", "items": "an item", "_private": "p", "tool_calls": [
        {"function": {"name": "f", "arguments": {"a": 1}}}], "nested": {"deeper": {"deepest": 3}}},
    "om": OrderedDict(role="tool"),
    "xs": ["a", "b", "c"],
    "tree": [{"c": [{"c": []}, {"c": [{"c": []}]}]}, {"c": []}],
}


def _envs() -> tuple[ImmutableSandboxedEnvironment, ImmutableSandboxedEnvironment]:
    plain, fast = ImmutableSandboxedEnvironment(), ImmutableSandboxedEnvironment()
    dict_attributes_fast(fast)
    dict_attributes_fast(fast)  # once is enough: a second call changes nothing
    return plain, fast


@pytest.mark.parametrize("source", CASES)
def test_renders_as_the_sandbox(source: str) -> None:
    plain, fast = _envs()
    assert fast.from_string(source).render(**VALUES) == plain.from_string(source).render(**VALUES)


def test_unsafe_attributes_stay_refused() -> None:
    for env in _envs():
        with pytest.raises(SecurityError):
            env.from_string("{{ m.update({'role': 'system'}) }}").render(**VALUES)


def test_no_exception_for_a_dicts_keys() -> None:
    """The point of it: the fast read of a key never reaches the sandbox's getattr."""
    calls: list[str] = []
    sandboxed = ImmutableSandboxedEnvironment.getattr

    def counting(self: Any, obj: Any, attribute: str) -> Any:
        calls.append(attribute)
        return sandboxed(self, obj, attribute)

    ImmutableSandboxedEnvironment.getattr = counting  # type: ignore[method-assign]
    try:
        dict_attributes_fast(env := ImmutableSandboxedEnvironment())
        assert env.from_string(CASES[0]).render(**VALUES) == "user:hi"
        assert env.from_string("{{ m.items is defined }}").render(**VALUES) == "True"
    finally:
        ImmutableSandboxedEnvironment.getattr = sandboxed  # type: ignore[method-assign]
    assert calls == ["items"]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Lisbon?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lisbon"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    {"role": "assistant", "content": "Take a jacket."},
    {"role": "user", "content": "Thanks."},
]


@pytest.mark.parametrize("make", [chatml, llama31])
def test_chat_templates_render_as_the_sandbox(make: Any) -> None:
    """The gateway's renders (its compiled templates have the fast reads) equal the same template compiled into a
    sandbox without them."""
    from transformers.utils.chat_template_utils import _cached_compile_jinja_template

    ct = make()
    hf_messages, hf_tools, hf_kwargs, _ = ct._template_input(CONVERSATION, TOOLS, {})
    template = ct.tokenizer.get_chat_template(ct.chat_template, hf_tools)
    compile_template: Any = getattr(_cached_compile_jinja_template, "__wrapped__", _cached_compile_jinja_template)
    plain = compile_template(template)
    assert not getattr(plain.environment, "_dict_attributes_fast", False)
    for gen in (True, False):
        expected = plain.render(messages=hf_messages, tools=hf_tools, documents=None, add_generation_prompt=gen,
                                **ct._variables)
        assert ct._render(hf_messages, hf_tools, gen, hf_kwargs) == expected
