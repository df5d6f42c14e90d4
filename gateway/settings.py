"""Gateway settings: one pydantic-settings object, validated once at start (env prefix `ROLLWAY_`)."""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# Letters, digits, hyphens, and underscores (container and compose service names use them).
_HOST_LABELS = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?")


def _valid_host(host: str) -> bool:
    """An IP address, or a name whose IDNA form is letters, digits, hyphens (and underscores) in dot-separated
    labels. What passes here, aiohttp and the HTTP/1.1 client both accept."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    try:
        ascii_host = host.encode("idna").decode("ascii")
    except UnicodeError:
        return False
    return len(ascii_host) <= 253 and _HOST_LABELS.fullmatch(ascii_host) is not None


def backend_url(url: str) -> str:
    """A backend's base URL, checked: `http://` or `https://`, a host (IDNA-encodable), a port in range, no
    user, query or fragment. Returns it without a trailing slash; ValueError says what is wrong."""
    url = url.strip().rstrip("/")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises for a port out of range or not a number
    except ValueError as e:
        raise ValueError(f"not a valid backend URL {url!r}: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"backend URL {url!r}: the scheme must be http or https")
    if not parts.hostname:
        raise ValueError(f"backend URL {url!r} has no host")
    if not _valid_host(parts.hostname):
        raise ValueError(f"backend URL {url!r}: the host is not a valid domain name or IP address")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError(f"backend URL {url!r}: no user, query or fragment (give scheme://host:port[/path])")
    if port == 0:
        raise ValueError(f"backend URL {url!r}: port 0")
    return url

RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "self"})
"""Variables the gateway sets itself (and `self`, Jinja's own: `Template.render(self, ...)` took `{"self": 1}`
as a second value of its first argument, a TypeError): chat_template_kwargs may not replace them."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ROLLWAY_", extra="forbid")

    # NoDecode: ROLLWAY_BACKENDS=url1,url2 is split by the validator below, not read as JSON.
    backends: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """SGLang (or `rollway engine`) base URLs, e.g. http://127.0.0.1:30000 (env: comma-separated)."""
    tokenizer: str = ""
    """HF model/tokenizer folder whose chat template and tokenizer the gateway uses."""
    model: str = ""
    """`rollway serve` with no backends: the HF model folder its embedded CPU engine serves (empty: the tiny
    model in data_dir, created on first use)."""
    db: str = ""
    """SQLAlchemy URL: sqlite:///path or postgresql://...; empty = SQLite file in data_dir."""
    data_dir: Path = Path("rollway-data")
    """Where the embedded SQLite file, the generated admin key and the tiny model live."""
    host: str = "127.0.0.1"
    port: int = 8000
    public_url: str = ""
    """Base URL agents should use (`{public}/v1`); empty = derived from each request."""
    admin_key: str = ""
    """Admin bearer key. Empty: generated, stored in data_dir and printed once."""
    served_model_name: str = ""
    """Name in replies and /v1/models; empty = the tokenizer folder's name."""
    tool_parser: str = "auto"
    """Tool-call format of the model: auto (told from the chat template; gateway.model_formats), a format's name
    (gateway.tool_formats; `rollway serve --help` lists them) or none."""
    reasoning_parser: str = "auto"
    """Reasoning format: auto (from the chat template), a format's name (gateway.tool_formats) or none."""
    reasoning: bool = True
    """Split the reasoning (`<think>...</think>`, or the format's own markers) into `reasoning_content`."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Variables every render of the chat template gets (env: a JSON object, e.g. '{"enable_thinking": false}');
    a request's own `chat_template_kwargs` override them key by key."""
    allow_special_tokens_in_content: bool = False
    """Text in messages and tools that spells a special or markup token (`<|im_end|>`, `<tool_call>`) becomes
    that token, as a plain render + tokenize does. Off (the default), such text is tokenized as plain text, as
    hosted APIs do: a message cannot forge turns in the prompt or in the recorded training data. Turn it on
    only when every caller is trusted to put markup into content on purpose."""
    context_length: int = 0
    """Fallback context length when neither the backend nor config.json says (0 = unknown)."""
    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout_s: float = 30.0
    """Seconds a client may take to send its whole request body (one that announces a length and sends
    nothing would otherwise hold a connection and a task forever)."""
    max_messages: int = Field(default=2048, ge=1)
    """Messages (chat) or input items (Responses) one request may carry; more is a 400 before the body is
    validated. Each message costs per-request work (validation, rendering, the continuity comparison with
    every earlier turn) and is stored with the turn, and each renders to at least a few template tokens,
    so thousands cannot fit a context anyway; 2048 leaves an agent about a thousand tool-call rounds."""
    max_tools: int = Field(default=256, ge=1)
    """Tools one request may offer; more is a 400 before the body is validated. OpenAI's own API takes at
    most 128, so every agent that runs against it fits, with room for agents written for servers without
    a limit; each tool is rendered into the prompt and stored with every turn."""
    max_session_tokens: int = Field(default=4_000_000, ge=1)
    """Tokens a session may record: the sum over its turns of prompt + completion tokens, which is what its
    record (GET /v1/sessions/{id}) lists and what the gateway holds for its continuity. A turn whose prompt
    would take the session past it is a 400 (start a new session, or raise this). 4M is a 100-turn episode
    whose prompts average 40k tokens (a long-horizon agent on a 64k context); at the limit a record is about
    30 MB of JSON, where a runaway agent loop had no bound at all."""
    backend_api_key: str = ""
    """The backends' `--api-key` (SGLang's, or `rollway engine`'s): sent as `Authorization: Bearer` on /generate
    and the info routes, and on the admin routes too when `backend_admin_api_key` is empty. Empty: no header."""
    backend_admin_api_key: str = ""
    """The backends' `--admin-api-key`: sent on their admin routes (pause, continue, abort, weight updates,
    adapters, flush_cache), which SGLang then opens to that key only."""
    backend_timeout_s: float = 600.0
    """Read timeout for one /generate call."""
    max_resubmits: int = 8
    """How often one reply may be resubmitted after a backend abort (pause, weight update)."""
    session_idle_timeout_s: float = 3600.0
    health_interval_s: float = 5.0
    gamma: float = 1.0
    """Deprecated: the trainer's `gamma` (`rollway train --gamma`) discounts per-turn rewards now. Still the
    discount of the per-token returns in a lease of format 1 (a trainer that asks for no `lease_format`), and,
    when set, sent with format 2's leases for a trainer without a gamma of its own (docs/http-api.md)."""
    default_groups_per_step: int = 8
    """B for staleness admission until a trainer tells its own value with a lease request."""
    max_head_offpolicyness: int = -1
    """η for admission of new groups; -1 = no admission control until a trainer sets it."""
    trusted_proxies: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Addresses or networks (env: comma-separated, e.g. 10.0.0.5,10.1.0.0/16) of the reverse proxies in front
    of the gateway: only from these are `X-Forwarded-For`, `-Proto` and `-Host` believed (gateway.proxies).
    Empty (the default): from nobody, loopback included."""

    @field_validator("tool_parser")
    @classmethod
    def _known_tool_parser(cls, v: str) -> str:
        # The registry is light (no templating, no tokenizer): configuration stays a leaf.
        from gateway.tool_formats import get_tool_format, tool_format_names

        if v in ("auto", "none"):
            return v
        try:
            return get_tool_format(v).name  # an alias (SGLang's name for it) is the format's own name from here on
        except ValueError:
            raise ValueError(f"unknown tool parser {v!r}; known: auto, none, {', '.join(tool_format_names())}") from None

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, v: str) -> str:
        from gateway.tool_formats import reasoning_format_names

        if v not in ("auto", "none", *reasoning_format_names()):
            raise ValueError(
                f"unknown reasoning parser {v!r}; known: auto, none, {', '.join(reasoning_format_names())}")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        if taken := sorted(RESERVED_TEMPLATE_KWARGS & v.keys()):
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: the gateway sets them")
        return v

    @field_validator("backends", mode="before")
    @classmethod
    def _split_backends(cls, v: object) -> object:
        if isinstance(v, str):
            v = [u.strip() for u in v.split(",") if u.strip()]
        if isinstance(v, list):
            return [backend_url(u) if isinstance(u, str) else u for u in v]
        return v

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _split_proxies(cls, v: object) -> object:
        from gateway.proxies import parse_proxies

        if isinstance(v, str):
            v = [p.strip() for p in v.split(",") if p.strip()]
        if isinstance(v, list) and all(isinstance(p, str) for p in v):
            parse_proxies(v)  # ValueError names the entry that is not an address or network
        return v

    @property
    def db_url(self) -> str:
        return self.db or f"sqlite:///{(self.data_dir / 'rollway.db').resolve()}"

    @property
    def is_loopback(self) -> bool:
        if self.host in ("localhost", ""):
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
