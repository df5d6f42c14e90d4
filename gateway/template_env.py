"""The Jinja side of a chat template: transformers' own compiled template (its sandbox, filters and globals), made
cheaper where the sandbox's answer is known in advance, and the renderer by segments where the template allows it
(gateway.template_segments)."""

from __future__ import annotations

import functools
from typing import Any

from jinja2.runtime import LoopContext

from gateway.template_segments import NotLocal, Renderer, plan


@functools.lru_cache(maxsize=8)
def compiled_template(template: str) -> Any:
    """transformers' own compiled template (its sandboxed environment, filters and globals), or None."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None
    compiled = _compile_jinja_template(template)
    dict_attributes_fast(compiled.environment)
    return compiled


_DICT_ATTRIBUTES = frozenset(dir(dict))
_LOOP_NUMBERS = frozenset({"index0", "index", "revindex0", "revindex", "first", "last", "length", "depth", "depth0"})
"""A `for` loop's counters (ints and bools): the sandbox's checks of them (not private, not internal, not a mutating
method, not `str.format`) always pass, so the fast read returns what it returns."""


def dict_attributes_fast(env: Any) -> None:
    """`message.role` in a template, on a plain dict, read without the AttributeError that Jinja's sandbox takes
    first: its `getattr` tries the attribute, and a dict has none by a message's keys, so every such read built and
    caught an exception (~50 a chat call of the gateway benchmark, ~7% of the gateway's instructions). The answer
    is the sandbox's own: a name a dict has as an attribute (`items`, `__class__`) still goes its way; any other is
    the dict's item, or undefined when it has none, which is where the sandbox's AttributeError led. A loop's
    counters (`loop.first`, `loop.index0`: four reads a message in Qwen's template) are read directly too."""
    if getattr(env, "_dict_attributes_fast", False):
        return
    sandboxed = env.getattr

    def getattr_(obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return env.undefined(obj=obj, name=attribute)
        if kind is LoopContext and attribute in _LOOP_NUMBERS:
            return getattr(obj, attribute)
        return sandboxed(obj, attribute)

    env.getattr = getattr_
    env._dict_attributes_fast = True


@functools.lru_cache(maxsize=8)
def segment_renderer(template: str) -> Renderer | None:
    """A renderer by segments when the template is provably message-local (gateway.template_segments), else None."""
    compiled = compiled_template(template)
    if compiled is None:
        return None
    try:
        return Renderer(plan(compiled.environment, template))
    except NotLocal:
        return None
