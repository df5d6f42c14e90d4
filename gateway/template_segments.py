"""Rendering a chat template a message at a time, where the template's own code proves that is exact.

A long session's turn extends its parent by a few messages, but a render of the whole conversation costs
Python work for every message of it (two renders a turn: docs/architecture.md "Continuity and chains"). Most
templates are a head (system prompt, tools), one `{% for message in messages %}` loop whose iteration i writes
message i's segment, and a tail (the generation prompt). When the loop's body reads nothing but its own message,
its index (`loop.index0`, `loop.index`, `loop.first`, `loop.last`) and a bounded window of neighbours
(`messages[loop.index0 + 1]`), and the head reads only leading messages by constant index, then

    render(messages) = head + segment(0) + ... + segment(n - 1) + tail

and segment i is the same in every conversation that agrees on messages 0 .. i + lookahead (and on whether i is
the last one, when the body reads `loop.last`). So the renders of an extension only need the segments from a
little before the parent's end onwards; the text before them is the parent's own prompt (`RenderCut`).

`plan` decides that from the template's syntax tree (jinja2's parser), conservatively: anything it cannot prove
(a loop over `messages[::-1]` in the head, as Qwen3's, which finds the last user query and rewrites the
reasoning of earlier turns; `set messages = ...`; a namespace written inside the loop; `loop.length`; macros;
calls other than pure string methods and `raise_exception`/`namespace`/`range`/`dict`; the date) gives no plan,
and every render is whole, as before. A template with a plan is still judged by the same prefix-stability test
on the same texts (`ChatTemplate.extension`): only how the texts are computed changes, never what they are
(tests/gateway/test_template_segments.py renders the real templates of llama.cpp's corpus both ways).
"""

from __future__ import annotations

from collections import ChainMap, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from jinja2 import nodes

PURE_METHODS = frozenset({
    "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith", "endswith", "lower", "upper",
    "title", "capitalize", "replace", "find", "rfind", "count", "join", "format", "items", "keys", "values", "get",
    "removeprefix", "removesuffix", "isdigit", "isspace",
})
"""Methods a template may call inside the plan's parts: they read, never write."""
PURE_CALLS = frozenset({"raise_exception", "namespace", "range", "dict"})
"""Global functions that depend only on their arguments (not `strftime_now`: the date changes between turns)."""
IMPURE_FILTERS = frozenset({"random", "shuffle"})
LOOP_ATTRS = frozenset({"index0", "index", "first", "last"})
REFUSED_NODES = (nodes.Macro, nodes.CallBlock, nodes.Import, nodes.FromImport, nodes.Include, nodes.Extends,
                 nodes.Block, nodes.FilterBlock, nodes.Scope, nodes.OverlayScope, nodes.EvalContextModifier,
                 nodes.ScopedEvalContextModifier, nodes.ContextReference, nodes.DerivedContextReference,
                 nodes.InternalName, nodes.ImportedName)

HEAD_CACHE = 256
"""Head texts a renderer keeps (`Renderer.head`): distinct system prompts and tool sets in use at once."""


class NotLocal(Exception):
    """The template is not provably message-local (why, for the tests)."""


@dataclass(frozen=True, slots=True)
class RenderCut:
    """Where a rendered prompt can be cut for the next turn: `text[:offset]` is the head and the segments of
    messages 0 .. index - 1 of the `n` messages it rendered."""

    n: int
    index: int
    offset: int
    inputs: bytes
    """The tools and chat_template_kwargs it was rendered with, as JSON: a later render cut here must have the same."""


def _offset(arg: nodes.Node) -> int | None:
    """d when `arg` is `loop.index0 + d` in one of the usual spellings (`loop.index` is index0 + 1)."""
    def base(node: nodes.Node) -> int | None:
        if isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name) and node.node.name == "loop":
            return {"index0": 0, "index": 1}.get(node.attr)
        return None

    b = base(arg)
    if b is not None:
        return b
    if isinstance(arg, (nodes.Add, nodes.Sub)) and isinstance(arg.right, nodes.Const) \
            and type(arg.right.value) is int:
        b = base(arg.left)
        if b is not None:
            return b + arg.right.value if isinstance(arg, nodes.Add) else b - arg.right.value
    return None


def _is_first_test(node: nodes.Node) -> bool:
    """`loop.first` or `loop.index0 == 0`: true exactly on the first iteration."""
    if isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name) and node.node.name == "loop":
        return node.attr == "first"
    if isinstance(node, nodes.Compare) and len(node.ops) == 1 and node.ops[0].op == "eq":
        left, right = node.expr, node.ops[0].expr
        for a, b in ((left, right), (right, left)):
            if isinstance(b, nodes.Const) and b.value == 0 and type(b.value) is int and _offset(a) == 0:
                return True
    return False


def _is_not_first_test(node: nodes.Node) -> bool:
    return isinstance(node, nodes.Not) and _is_first_test(node.node)


class _Checker:
    """Walks the parts of the template; raises NotLocal at the first thing it cannot prove."""

    def __init__(self) -> None:
        self.lookahead = 0
        self.uses_last = False
        self.min_messages = 0

    def check(self, node: nodes.Node, part: str, loop_is_outer: bool, guard: bool = False) -> None:
        """`part`: head | body | tail. `loop_is_outer`: `loop` names the message loop here. `guard`: only reached
        when the message loop is past its first iteration (so `messages[loop.index0 - 1]` is message i - 1)."""
        if isinstance(node, REFUSED_NODES):
            raise NotLocal(f"{type(node).__name__} in the template")
        if isinstance(node, nodes.For):
            if node.recursive:
                raise NotLocal("a recursive loop")
            self.check(node.iter, part, loop_is_outer, guard)
            for child in (node.target, *node.body, *node.else_, *([node.test] if node.test else [])):
                self.check(child, part, False, False)
            return
        if part == "tail":  # rendered in full every time: anything but reading the whole conversation
            if isinstance(node, nodes.Getitem) and isinstance(node.node, nodes.Name) \
                    and node.node.name == "messages" and isinstance(node.arg, nodes.Const):
                return
            if isinstance(node, nodes.Filter) and node.name in ("length", "count") and isinstance(
                    node.node, nodes.Name) and node.node.name == "messages" and not node.args:
                return
            if isinstance(node, nodes.Name) and node.name == "messages":
                raise NotLocal("the tail reads the whole conversation")
            return self._generic(node, part, loop_is_outer, guard)
        if isinstance(node, nodes.Name):
            if node.name == "messages":
                if node.ctx != "load":
                    raise NotLocal("the template assigns `messages`")
                raise NotLocal("`messages` read other than by a constant or loop index")
            if node.name == "add_generation_prompt" and part != "tail":
                raise NotLocal("add_generation_prompt read before the tail")
            if node.name == "loop" and part == "body" and loop_is_outer:
                raise NotLocal("`loop` used other than by index0/index/first/last")
            return
        if isinstance(node, nodes.Getitem) and isinstance(node.node, nodes.Name) and node.node.name == "messages":
            arg = node.arg
            if isinstance(arg, nodes.Const) and type(arg.value) is int and arg.value >= 0:
                self.min_messages = max(self.min_messages, arg.value + 1)
                return
            d = _offset(arg) if part == "body" and loop_is_outer else None
            if d is None:
                raise NotLocal("`messages` read other than by a constant or loop index")
            if d < 0 and not (d == -1 and guard):  # at index 0, messages[-1] is the last message
                raise NotLocal("an unguarded read of an earlier message")
            self.lookahead = max(self.lookahead, d)
            return
        if isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name) and node.node.name == "loop" \
                and part == "body" and loop_is_outer:
            if node.attr not in LOOP_ATTRS:
                raise NotLocal(f"loop.{node.attr}")
            self.uses_last |= node.attr == "last"
            return
        if isinstance(node, (nodes.Assign, nodes.AssignBlock)) and part == "body":
            if any(True for _ in node.find_all(nodes.NSRef)):
                raise NotLocal("a namespace written inside the message loop")
        if isinstance(node, (nodes.Break,)) and part == "body" and loop_is_outer:
            raise NotLocal("break in the message loop")
        if isinstance(node, nodes.Call):
            func = node.node
            if isinstance(func, nodes.Name):
                if func.name not in PURE_CALLS:
                    raise NotLocal(f"a call of {func.name}")
            elif isinstance(func, nodes.Getattr):
                if func.attr not in PURE_METHODS:
                    raise NotLocal(f"a call of .{func.attr}")
            else:
                raise NotLocal("a computed call")
        if isinstance(node, nodes.Filter) and node.name in IMPURE_FILTERS:
            raise NotLocal(f"the {node.name} filter")
        if loop_is_outer and part == "body":
            if isinstance(node, nodes.Or) and _is_first_test(node.left):
                self.check(node.left, part, loop_is_outer, guard)
                return self.check(node.right, part, loop_is_outer, True)
            if isinstance(node, nodes.And) and _is_not_first_test(node.left):
                self.check(node.left, part, loop_is_outer, guard)
                return self.check(node.right, part, loop_is_outer, True)
            if isinstance(node, nodes.If) and _is_not_first_test(node.test):
                self.check(node.test, part, loop_is_outer, guard)
                for child in node.body:
                    self.check(child, part, loop_is_outer, True)
                for child in (*node.elif_, *node.else_):
                    self.check(child, part, loop_is_outer, guard)
                return
        self._generic(node, part, loop_is_outer, guard)

    def _generic(self, node: nodes.Node, part: str, loop_is_outer: bool, guard: bool) -> None:
        for child in node.iter_child_nodes():
            self.check(child, part, loop_is_outer, guard)


def _rewrite_loop(node: nodes.Node) -> nodes.Node:
    """The body's `loop.*` (of the message loop, not of inner loops) as seen from a loop over
    messages[__start:__end]: index0 + __start, first: that == 0, last: that == __n - 1."""
    if isinstance(node, nodes.For):
        node.iter = _rewrite_loop(node.iter)  # inner loops: their body's `loop` is theirs
        return node
    if isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name) and node.node.name == "loop":
        start = nodes.Name("__start", "load")
        index0 = nodes.Add(nodes.Getattr(nodes.Name("loop", "load"), "index0", "load"), start)
        if node.attr == "index0":
            return index0
        if node.attr == "index":
            return nodes.Add(nodes.Getattr(nodes.Name("loop", "load"), "index", "load"), start)
        if node.attr == "first":
            return nodes.Compare(index0, [nodes.Operand("eq", nodes.Const(0))])
        if node.attr == "last":
            last = nodes.Sub(nodes.Name("__n", "load"), nodes.Const(1))
            return nodes.Compare(index0, [nodes.Operand("eq", last)])
        raise NotLocal(f"loop.{node.attr}")
    for field in node.fields:
        value = getattr(node, field, None)
        if isinstance(value, nodes.Node):
            setattr(node, field, _rewrite_loop(value))
        elif isinstance(value, list):
            setattr(node, field, [_rewrite_loop(v) if isinstance(v, nodes.Node) else v for v in value])
    return node


@dataclass(frozen=True, slots=True)
class Plan:
    """A message-local template in three compiled parts (module docstring)."""

    head: Any
    body: Any
    tail: Any
    keep: int
    """How many of the last segments a render must redo when messages are appended: the lookahead, or 1 when
    the body reads `loop.last`."""
    min_messages: int
    """Messages read by constant index: a parent with fewer saw them missing."""

    def cut_index(self, n: int) -> int:
        return max(0, n - self.keep)


def plan(environment: Any, source: str) -> Plan:
    """The template's plan, or NotLocal saying why it has none."""
    tree = environment.parse(source)
    loops = [i for i, n in enumerate(tree.body) if isinstance(n, nodes.For) and isinstance(n.iter, nodes.Name)
             and n.iter.name == "messages"]
    if len(loops) != 1:
        raise NotLocal("no top-level `for ... in messages` loop" if not loops else "more than one message loop")
    at = loops[0]
    loop: nodes.For = tree.body[at]
    if not isinstance(loop.target, nodes.Name) or loop.else_ or loop.test is not None or loop.recursive:
        raise NotLocal("the message loop has a tuple target, an else, a filter or recursion")
    checker = _Checker()
    for node in tree.body[:at]:
        checker.check(node, "head", False)
    for child in loop.body:
        checker.check(child, "body", True)
    for node in tree.body[at + 1:]:
        checker.check(node, "tail", False)
    body_loop = nodes.For(
        loop.target, nodes.Getitem(nodes.Name("messages", "load"), nodes.Slice(
            nodes.Name("__start", "load"), nodes.Name("__end", "load"), None), "load"),
        [_rewrite_loop(child) for child in loop.body], [], None, False)

    def compiled(body: list[nodes.Node]) -> Any:
        template = nodes.Template(body, lineno=1)
        template.set_environment(environment)
        for node in template.find_all(nodes.Node):
            if node.lineno is None:
                node.lineno = 1
        return environment.from_string(template)

    keep = max(checker.lookahead, 1 if checker.uses_last else 0)
    return Plan(compiled(tree.body[:at]), compiled([body_loop]), compiled(tree.body[at + 1:]), keep,
                checker.min_messages)


def new_context(template: Any, variables: Mapping[str, Any]) -> Any:
    """`template.new_context(dict(variables))`, the context `Template.render` makes, without its cost: Jinja merges
    the template's globals, a ChainMap of an empty dict and the environment's, key by key through ChainMap's Python
    `__getitem__`, each read of the environment's raising and catching a KeyError in the empty map first (~70k
    instructions a render, more than a short template's own work). The same dict, made by dict updates, in the
    same order (the variables win over the globals); the context's `globals_keys`, which only `Template.module`
    reads, is left empty."""
    found = template.globals
    parent: dict[str, Any] = {}
    if isinstance(found, ChainMap):
        for mapping in reversed(found.maps):
            parent.update(mapping)
    else:
        parent.update(found)
    parent.update(variables)
    env = template.environment
    return env.context_class(env, parent, template.name, template.blocks)


def render(template: Any, variables: Mapping[str, Any]) -> str:
    """`template.render(variables)` with `new_context`."""
    context = new_context(template, variables)
    try:
        return str(template.environment.concat(template.root_render_func(context)))
    except Exception:
        template.environment.handle_exception()  # re-raises, with the template's lines in the traceback
        raise


def _run(template: Any, variables: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The template's output and the variables it set at top level (its exports)."""
    context = new_context(template, variables)
    out = template.environment.concat(template.root_render_func(context))
    return out, context.get_exported()


class LazyMessages(Sequence[Any]):
    """The conversation as the template takes it, each message converted (`convert`) when first read: the parts
    of a plan read a few messages of a long conversation."""

    __slots__ = ("_convert", "_done", "_raw")

    def __init__(self, raw: Sequence[Any], convert: Callable[[Any], Any], done: dict[int, Any] | None = None) -> None:
        self._raw = raw
        self._convert = convert
        self._done: dict[int, Any] = {} if done is None else done

    def prefix(self, n: int) -> LazyMessages:
        """The first `n` messages, sharing the conversions made so far."""
        return LazyMessages(self._raw[:n], self._convert, self._done)

    def __len__(self) -> int:
        return len(self._raw)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self._raw)))]
        n = len(self._raw)
        if not -n <= i < n:
            raise IndexError(i)
        i %= n
        hit = self._done.get(i)
        if hit is None:
            hit = self._done[i] = self._convert(self._raw[i])
        return hit


class Renderer:
    """Renders with a plan: parts of a conversation's rendering, with the template's variables."""

    def __init__(self, the_plan: Plan) -> None:
        self.plan = the_plan
        self._heads: OrderedDict[bytes, str] = OrderedDict()
        """Head texts by what they are rendered from (`_head_key`), for heads that set no variable."""

    def head(self, messages: Sequence[Any], variables: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """The head's text, and the variables the body and the tail see: the render's, then what the head set.
        The kept texts are shared by the event loop's thread and the prompt workers': each use of them is one
        call of OrderedDict's C code, whole under the GIL."""
        key = self._head_key(messages, variables)
        if key is not None:
            hit = self._heads.get(key)
            if hit is not None:
                return hit, {**variables, "messages": messages}
        out, exported = _run(self.plan.head, {**variables, "messages": messages})
        if key is not None and not exported:
            self._heads[key] = out
            if len(self._heads) > HEAD_CACHE:
                try:
                    self._heads.popitem(last=False)
                except KeyError:  # another thread emptied it
                    pass
        return out, {**variables, **exported, "messages": messages}

    def _head_key(self, messages: Sequence[Any], variables: Mapping[str, Any]) -> bytes | None:
        """What the head's text is a function of, exactly: the template's variables (tools, chat_template_kwargs,
        special tokens; dict keys in their order, which `tojson` keeps) and the messages it reads by constant index
        (`Plan.min_messages`, the system prompt in most templates); the head calls nothing impure (`plan`). The
        sessions of a run share their system prompt and tools: one render of the head serves them all. None (no
        caching) when the conversation is shorter than that or a value is not JSON."""
        n = self.plan.min_messages
        if len(messages) < n:
            return None
        try:
            return orjson.dumps([variables, [messages[i] for i in range(n)]])
        except (TypeError, orjson.JSONEncodeError):
            return None

    def segments(self, scope: Mapping[str, Any], start: int, end: int) -> str:
        """Segments start .. end - 1 of the conversation `scope["messages"]`."""
        if start >= end:
            return ""
        messages = scope["messages"]
        out, _ = _run(self.plan.body, {**scope, "__start": start, "__end": end, "__n": len(messages)})
        return out

    def tail(self, scope: Mapping[str, Any], add_generation_prompt: bool) -> str:
        out, _ = _run(self.plan.tail, {**scope, "add_generation_prompt": add_generation_prompt})
        return out

    def whole(self, variables: Mapping[str, Any], messages: Sequence[Any], inputs: bytes) -> tuple[str, RenderCut]:
        """The whole render of `messages` with a generation prompt, as head + segments + tail (the plan's identity:
        the head's text kept by what it reads, each segment rendered once), and its cut (`cut`'s, found without a
        second render of the last segments and the tail)."""
        n = len(messages)
        at = self.plan.cut_index(n)
        head, scope = self.head(messages, variables)
        before = head + self.segments(scope, 0, at)
        return before + self.segments(scope, at, n) + self.tail(scope, True), RenderCut(n, at, len(before), inputs)

    def cut(self, variables: Mapping[str, Any], messages: Sequence[Any], inputs: bytes, text: str) -> RenderCut | None:
        """Where `text`, the whole render of `messages` with a generation prompt, ends its head and the segments that
        later messages cannot change. The segments after them and the tail are rendered again and must end `text`."""
        n = len(messages)
        at = self.plan.cut_index(n)
        try:
            _, scope = self.head(messages, variables)
            rest = self.segments(scope, at, n) + self.tail(scope, True)
        except Exception:  # the whole render succeeded: this one is only an optimisation
            return None
        if not text.endswith(rest):
            return None
        return RenderCut(n, at, len(text) - len(rest), inputs)

    def usable(self, cut: RenderCut, n: int, parent_prompt: str, inputs: bytes) -> bool:
        """Whether a parent prompt cut at `cut` is what the renders of its `n` messages (its request and its reply)
        share up to there: it rendered the n - 1 before the reply, at least the messages the template reads by
        constant index, with the same tools and chat_template_kwargs (the template writes them as given)."""
        return (cut.n == n - 1 and cut.n >= self.plan.min_messages and cut.index == self.plan.cut_index(cut.n)
                and cut.offset <= len(parent_prompt) and cut.inputs == inputs)

    def extend(self, variables: Mapping[str, Any], messages: LazyMessages, n: int, parent_prompt: str,
               cut: RenderCut) -> tuple[str, str, RenderCut] | None:
        """The renders of `messages` (with a generation prompt) and of its first `n` (without), each from `cut` on,
        and the cut of the first; `parent_prompt` up to `cut` is what both start with (`usable`)."""
        head, scope = self.head(messages, variables)
        if not parent_prompt.startswith(head):
            return None
        scope_prev = {**scope, "messages": messages.prefix(n)}
        at, total = cut.index, len(messages)
        prefix_rest = self.segments(scope_prev, at, n) + self.tail(scope_prev, False)
        next_at = self.plan.cut_index(total)
        mid = self.segments(scope, at, next_at)
        full_rest = mid + self.segments(scope, next_at, total) + self.tail(scope, True)
        return full_rest, prefix_rest, RenderCut(total, next_at, cut.offset + len(mid), cut.inputs)


def inputs_json(hf_tools: list[Any] | None, kwargs: Mapping[str, Any]) -> bytes:
    """The tools and chat_template_kwargs of a render, exactly (key order too: the template writes them as given),
    which a render by segments must share with the parent prompt's."""
    try:
        return orjson.dumps([hf_tools, dict(kwargs)])
    except (TypeError, orjson.JSONEncodeError):
        return b""  # never equal to a dump: no render by segments
