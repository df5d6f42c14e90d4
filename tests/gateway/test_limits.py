"""Hostile sizes: the key is checked before a body is read, big prompts never hold the event loop, a prompt too
long for the context by its length alone is refused before it is tokenized, and per-request and per-session
limits answer a 400 that names the setting raising them."""

from __future__ import annotations

import socket
import threading
import time
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.openapi import OPERATIONS
from gateway.prompt_limits import NFC_MAX_EXPANSION, max_chars_per_token
from gateway.templating import ChatTemplate
from gateway.turns import BIG_BODY_BYTES
from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway

OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
HUGE = ("hello world " * 600_000)[:7_000_000]  # ~2.3M tokens: far over any context here
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def post(gw: LiveGateway, path: str, body: Any, key: str | None, timeout: float = 60) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(f"{gw.url}{path}", content=raw, headers=headers, timeout=timeout)


def error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text[:500]
    return r.json()["error"]  # type: ignore[no-any-return]


@contextmanager
def health_poller(gw: LiveGateway) -> Iterator[dict[str, float]]:
    """Polls GET /health while the block runs; yields {"worst": slowest answer in s, "polls": answers}. A poll
    that fails or times out counts as infinitely slow."""
    seen = {"worst": 0.0, "polls": 0.0}
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    ok = client.get(f"{gw.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                took = time.perf_counter() - t0 if ok else float("inf")
                seen["worst"] = max(seen["worst"], took)
                seen["polls"] += 1
                time.sleep(0.005)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    time.sleep(0.2)
    try:
        yield seen
    finally:
        time.sleep(0.1)
        stop.set()
        thread.join(60)


# --- the key before the body -----------------------------------------------------------------------


BODY_ROUTES = sorted((method, path) for (method, path), op in OPERATIONS.items() if op.body is not None)


@pytest.mark.parametrize("method, path", BODY_ROUTES)
def test_no_key_and_a_bad_body_is_401(gateway: LiveGateway, method: str, path: str) -> None:
    """Every route that takes a body checks who calls first; a route with the session id in its path
    answers an unknown id (404) before the body, as the key routes answer a missing key."""
    url = gateway.url + path.format(session_id="sess_unknown", batch_id="batch_unknown", group_id="grp_unknown")
    r = httpx.request(method, url, content=b"{not json", timeout=30)
    if path.startswith("/sessions/{session_id}/"):
        assert error(r, 404)["type"] == "not_found_error"
    else:
        assert error(r, 401)["type"] == "authentication_error"


def test_a_5mb_body_without_a_key_is_401_at_once(gateway: LiveGateway, fake: FakeSGLang) -> None:
    # 1.7M empty messages: the costliest 5 MB to parse and validate (9 s of the event loop here).
    body = orjson.dumps({"messages": [{}] * 1_700_000})
    assert len(body) > 5_000_000
    before = len(fake.requests)
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/completions"):
        t0 = time.perf_counter()
        r = post(gateway, path, body, None)
        took = time.perf_counter() - t0
        assert error(r, 401)["type"] == "authentication_error"
        assert took < 0.5, f"{path}: 401 after {took:.2f} s"
    # With a key, the messages are counted before any of them is validated.
    t0 = time.perf_counter()
    err = error(post(gateway, "/v1/chat/completions", body, gateway.group(1)["sessions"][0]["api_key"]), 400)
    assert err["code"] == "array_above_max_length" and time.perf_counter() - t0 < 2, err
    assert len(fake.requests) == before


def test_a_body_that_never_comes_without_a_key_is_401_at_once(gateway: LiveGateway) -> None:
    """Announcing a body and sending none: without a key the answer does not wait for it (with one, it is a
    408 after body_timeout_s: tests/gateway/test_hostile_input.py)."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 401"), answer


# --- big prompts and the event loop -----------------------------------------------------------------


@pytest.fixture(scope="module")
def big_context(tiny_model_dir: Path, sqlite_url: str) -> Iterator[tuple[LiveGateway, FakeSGLang]]:
    """A model whose context (1M tokens) a few MB of text fit under by length, so they must be tokenized."""
    with FakeSGLang(vocab=range(100, 1000), context_length=1_000_000) as f, \
            LiveGateway(backends=[f.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        yield gw, f


def test_health_answers_while_a_7mb_prompt_is_refused(gateway: LiveGateway, fake: FakeSGLang) -> None:
    cred = gateway.group(1)["sessions"][0]
    before = len(fake.requests)
    with health_poller(gateway) as seen:
        t0 = time.perf_counter()
        r = post(gateway, "/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}]}, cred["api_key"])
        took = time.perf_counter() - t0
    err = error(r, 400)
    assert err["code"] == "context_length_exceeded" and "at least" in err["message"], err
    assert seen["polls"] >= 3 and seen["worst"] < 0.5, (seen, took)
    assert len(fake.requests) == before and not gateway.session(cred["session_id"])["turns"]


def test_health_answers_while_a_huge_extension_is_refused(gateway: LiveGateway, fake: FakeSGLang) -> None:
    """A session's later turn bringing a 7 MB tool result: its new text alone cannot fit."""
    cred = gateway.group(1)["sessions"][0]
    first = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    reply = post(gateway, "/v1/chat/completions", first, cred["api_key"]).json()["choices"][0]["message"]
    follow = {"messages": [*first["messages"], reply, {"role": "user", "content": HUGE}]}
    before = len(fake.requests)
    with health_poller(gateway) as seen:
        r = post(gateway, "/v1/chat/completions", follow, cred["api_key"])
    err = error(r, 400)
    assert err["code"] == "context_length_exceeded" and "of the turn it extends" in err["message"], err
    assert seen["polls"] >= 3 and seen["worst"] < 0.5, seen
    assert len(fake.requests) == before


def test_health_answers_while_a_big_prompt_is_tokenized(big_context: tuple[LiveGateway, FakeSGLang]) -> None:
    """4 MB that could fit by length (the context is 1M tokens) is tokenized, off the event loop: 1.3M tokens."""
    gw, fake = big_context
    cred = gw.group(1)["sessions"][0]
    before = len(fake.requests)
    with health_poller(gw) as seen:
        r = post(gw, "/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE[:4_000_000]}]},
                 cred["api_key"])
    err = error(r, 400)
    assert err["code"] == "context_length_exceeded" and "at least" not in err["message"], err
    assert seen["polls"] >= 3 and seen["worst"] < 0.5, seen
    assert len(fake.requests) == before


def test_big_prompts_get_the_same_ids_off_the_event_loop(big_context: tuple[LiveGateway, FakeSGLang],
                                                          tiny_model_dir: Path) -> None:
    """The worker thread's prompts are exactly the ones the event loop's path builds: a first turn, a turn
    that extends it, and a raw completion, each with a body over BIG_BODY_BYTES."""
    from transformers import AutoTokenizer

    gw, fake = big_context
    template = ChatTemplate(AutoTokenizer.from_pretrained(tiny_model_dir))
    cred = gw.group(1)["sessions"][0]
    doc = "".join(f"line {i}: ünïcödé, 数字 {i * 7}, <tool_call> x</tool_call>\n" for i in range(3000))
    assert len(doc.encode()) > BIG_BODY_BYTES
    messages: list[dict[str, Any]] = [{"role": "system", "content": doc}, {"role": "user", "content": "sum?"}]
    r = post(gw, "/v1/chat/completions", {"messages": messages, "max_tokens": 3, "tools": [TOOL]}, cred["api_key"])
    assert r.status_code == 200, r.text
    first_prompt = fake.requests[-1]["input_ids"]
    assert first_prompt == template.render_prompt(messages, [TOOL])[0]
    assert any(t.name.startswith("rollway-prompt") for t in threading.enumerate())

    reply = r.json()["choices"][0]["message"]
    later = [*messages, reply, {"role": "user", "content": "and now?"}]
    r = post(gw, "/v1/chat/completions", {"messages": later, "max_tokens": 3, "tools": [TOOL]}, cred["api_key"])
    assert r.status_code == 200, r.text
    turns = gw.session(cred["session_id"])["turns"]
    assert turns[-1]["continuity"] == "extends", turns[-1]["chain_reason"]
    chain = [*turns[0]["prompt_ids"], *turns[0]["completion_ids"]]
    ext = template.extension([*messages, turns[0]["reply"]], turns[0]["completion_ids"], later[len(messages) + 1:],
                             [TOOL])
    assert ext is not None
    assert fake.requests[-1]["input_ids"] == [*chain, *ext[0]]

    r = post(gw, "/v1/completions", {"prompt": doc, "max_tokens": 2}, cred["api_key"])
    assert r.status_code == 200, r.text
    assert fake.requests[-1]["input_ids"] == template.encode(doc)


# --- the length bound: never refuses a prompt that fits -----------------------------------------------


def test_no_canonical_decomposition_is_longer_than_the_nfc_factor() -> None:
    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000))
    assert longest == NFC_MAX_EXPANSION


def _fast(tok: Any) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _adversarial_texts(tokenizer: Any) -> list[str]:
    """Texts that pack the most characters into each token: the longest tokens' own text repeated, sequences
    NFC composes into one character (4 code points -> 1, Hangul jamo 3 -> 1), added tokens, mixed."""
    vocab = tokenizer.get_vocab()
    longest = sorted(vocab, key=len, reverse=True)[:50]
    pieces = [tokenizer.decode([vocab[t]]) for t in longest]
    composed = ["\u0391\u0314\u0342\u0345", "\u1100\u1161\u11a8", "e\u0301", "\u212b"]
    return [
        *(p * 200 for p in pieces),
        "".join(pieces) * 20,
        *(c * 500 for c in composed),
        "".join(composed) * 300,
        "".join(tokenizer.all_special_tokens) * 100,
        " " * 5000,
        "\n" * 5000,
        "".join(chr(c) for c in range(0x20, 0x3000, 3)),
    ]


def test_the_bound_holds_for_the_served_tokenizer(tokenizer: Any) -> None:
    per_token = max_chars_per_token(tokenizer)
    longest = max(map(len, tokenizer.get_vocab()))
    assert per_token == NFC_MAX_EXPANSION * longest  # byte-level BPE with NFC (Qwen2's pipeline)
    for text in _adversarial_texts(tokenizer):
        n = len(tokenizer.encode(text, add_special_tokens=False))
        assert n >= -(-len(text) // per_token), (text[:40], n, len(text))


def test_the_bound_without_a_normalizer_is_the_longest_token(tokenizer: Any) -> None:
    """Llama 3's pipeline: no normalizer, so nothing composes: the bound is the longest token itself."""
    tok = _fast(type(tokenizer.backend_tokenizer).from_str(tokenizer.backend_tokenizer.to_str()))
    tok.backend_tokenizer.normalizer = None
    per_token = max_chars_per_token(tok)
    assert per_token == max(map(len, tok.get_vocab()))
    for text in _adversarial_texts(tok):
        n = len(tok.encode(text, add_special_tokens=False))
        assert n >= -(-len(text) // per_token), (text[:40], n, len(text))


def test_no_bound_where_it_is_not_provable(tokenizer: Any) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    def byte_bpe(**changes: Any) -> Any:
        tok = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        for name, value in changes.items():
            setattr(tok, name, value)
        return _fast(tok)

    word_piece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]", max_input_chars_per_word=100))
    word_piece.pre_tokenizer = pre_tokenizers.Whitespace()
    # Trained on a few letters without the byte alphabet: most bytes are unknown, and an unknown is dropped.
    partial = Tokenizer(models.BPE())
    partial.pre_tokenizer = pre_tokenizers.ByteLevel()
    partial.train_from_iterator(["abc abc"], trainers.BpeTrainer(vocab_size=50, show_progress=False))
    cases = {
        "WordPiece: one [UNK] stands for a whole word": _fast(word_piece),
        "a byte-level BPE missing byte symbols": _fast(partial),
        "a normalizer that can drop text": byte_bpe(normalizer=normalizers.Sequence([normalizers.StripAccents()])),
        "a pre-tokenizer that drops whitespace": byte_bpe(pre_tokenizer=pre_tokenizers.Sequence(
            [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(use_regex=False)])),
        "no byte-level pre-tokenizer": byte_bpe(pre_tokenizer=pre_tokenizers.Metaspace()),
        "a slow tokenizer": object(),
    }
    for why, tok in cases.items():
        assert max_chars_per_token(tok) is None, why


# --- limits per request and per session --------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(fake: FakeSGLang, tiny_model_dir: Path, db_url: str) -> Iterator[LiveGateway]:
    with LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=db_url, max_messages=4, max_tools=2,
                     max_session_tokens=400) as gw:
        yield gw


def names_setting(err: dict[str, Any], setting: str) -> None:
    assert setting in err["message"] and f"ROLLWAY_{setting.upper()}" in err["message"], err


def test_messages_per_request(limited: LiveGateway, fake: FakeSGLang) -> None:
    cred = limited.group(1)["sessions"][0]
    four = [{"role": "user", "content": f"m{i}"} for i in range(4)]
    assert post(limited, "/v1/chat/completions", {"messages": four, "max_tokens": 2}, cred["api_key"]).status_code == 200
    before = len(fake.requests)
    # Counted before validation: five messages of an unknown role are refused for their number.
    for messages in ([*four, {"role": "user", "content": "m4"}], [{"role": "wizard"}] * 5):
        err = error(post(limited, "/v1/chat/completions", {"messages": messages}, cred["api_key"]), 400)
        assert err["param"] == "messages" and err["code"] == "array_above_max_length", err
        assert "5 items" in err["message"] and "at most 4" in err["message"]
        names_setting(err, "max_messages")
    items = [{"role": "user", "content": f"m{i}"} for i in range(5)]
    err = error(post(limited, "/v1/responses", {"input": items}, cred["api_key"]), 400)
    assert err["param"] == "input" and err["code"] == "array_above_max_length", err
    names_setting(err, "max_messages")
    assert len(fake.requests) == before and len(limited.session(cred["session_id"])["turns"]) == 1


def test_tools_per_request(limited: LiveGateway, fake: FakeSGLang) -> None:
    cred = limited.group(1)["sessions"][0]
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(3)]
    r = post(limited, "/v1/chat/completions", {**OK, "tools": tools[:2]}, cred["api_key"])
    assert r.status_code == 200, r.text
    before = len(fake.requests)
    err = error(post(limited, "/v1/chat/completions", {**OK, "tools": tools}, cred["api_key"]), 400)
    assert err["param"] == "tools" and err["code"] == "array_above_max_length" and "at most 2" in err["message"]
    names_setting(err, "max_tools")
    flat = [{"type": "function", "name": f"f{i}", "parameters": {"type": "object"}} for i in range(3)]
    err = error(post(limited, "/v1/responses", {"input": "hi", "tools": flat}, cred["api_key"]), 400)
    assert err["param"] == "tools" and err["code"] == "array_above_max_length", err
    names_setting(err, "max_tools")
    assert len(fake.requests) == before


def recorded(gw: LiveGateway, session_id: str) -> int:
    return sum(len(t["prompt_ids"]) + len(t["completion_ids"]) for t in gw.session(session_id)["turns"])


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}, "messages"),
    ("/v1/completions", {"prompt": "hello there, how are you", "max_tokens": 5}, "prompt"),
    ("/v1/responses", {"input": "hello there", "max_output_tokens": 5}, "input"),
])
def test_tokens_per_session(limited: LiveGateway, fake: FakeSGLang, path: str, body: dict[str, Any],
                            param: str) -> None:
    """Turns are taken until the tokens recorded (prompt + completion of every turn) plus the next prompt
    would pass max_session_tokens (400); that turn is refused, and so is any later one."""
    cred = limited.group(1)["sessions"][0]
    limit = limited.settings.max_session_tokens
    for _ in range(limit):
        before = recorded(limited, cred["session_id"])
        r = post(limited, path, body, cred["api_key"])
        if r.status_code != 200:
            break
        prompt = r.json()["usage"].get("prompt_tokens", r.json()["usage"].get("input_tokens"))
        assert before + prompt <= limit
    err = error(r, 400)
    assert err["param"] == param and err["code"] == "session_token_limit", err
    names_setting(err, "max_session_tokens")
    total = recorded(limited, cred["session_id"])
    assert f"has recorded {total} tokens" in err["message"], err
    n_prompt = int(err["message"].split("this turn's prompt is ")[1].split()[0])
    assert total + n_prompt > limit
    calls = len(fake.requests)
    err = error(post(limited, path, body, cred["api_key"]), 400)
    assert err["code"] == "session_token_limit" and len(fake.requests) == calls
    assert recorded(limited, cred["session_id"]) == total


def test_a_full_session_is_refused_before_its_prompt_is_built(limited: LiveGateway, fake: FakeSGLang) -> None:
    """The tokens already recorded reach the limit (a completion may take the session past it: its length is
    unknown until it is generated); any later call is refused whatever it brings."""
    cred = limited.group(1)["sessions"][0]
    limit = limited.settings.max_session_tokens
    r = post(limited, "/v1/completions", {"prompt": "hi", "max_tokens": limit - 1}, cred["api_key"])
    assert r.status_code == 200, r.text
    assert recorded(limited, cred["session_id"]) >= limit
    calls = len(fake.requests)
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "y"}]}),
                       ("/v1/completions", {"prompt": [5]}), ("/v1/responses", {"input": "y"})):
        err = error(post(limited, path, body, cred["api_key"]), 400)
        assert err["code"] == "session_token_limit" and "this turn's prompt" not in err["message"], err
    assert len(fake.requests) == calls


def test_limits_are_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.settings import Settings

    for name in ("MAX_MESSAGES", "MAX_TOOLS", "MAX_SESSION_TOKENS"):
        monkeypatch.delenv(f"ROLLWAY_{name}", raising=False)
    s = Settings()
    assert (s.max_messages, s.max_tools, s.max_session_tokens) == (2048, 256, 4_000_000)
    monkeypatch.setenv("ROLLWAY_MAX_MESSAGES", "9")
    monkeypatch.setenv("ROLLWAY_MAX_TOOLS", "3")
    monkeypatch.setenv("ROLLWAY_MAX_SESSION_TOKENS", "77")
    s = Settings()
    assert (s.max_messages, s.max_tools, s.max_session_tokens) == (9, 3, 77)
