"""Fill a store through a live gateway and the scripted fake SGLang, the way agents and a trainer would:
two-turn tool sessions (a tool call, its result, an answer), one with a third turn that edits its history
(a new chain: `edited_message`), a reply with a weight publish in its middle (tokens of two versions),
rewards with and without spread, an eval group, a dropped group, a lease and publish that train groups, and
a trainer report with advantages.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway

TOOLS = [{"type": "function", "function": {"name": "calculate", "description": "evaluate arithmetic",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"]}}}]
SYSTEM = "Use the calculate tool, then answer with the number only."


@dataclass
class Filled:
    tool_sessions: list[str] = field(default_factory=list)
    creds: dict[str, dict[str, Any]] = field(default_factory=dict)
    """session id -> its credentials from POST /v1/groups (api_key, base_url)."""
    break_session: str = ""
    publish_session: str = ""
    zero_var_group: str = ""
    spread_group: str = ""
    eval_group: str = ""
    dropped_group: str = ""
    small_groups: list[str] = field(default_factory=list)
    version: int = 0


def _ids(tok: Any, text: str) -> list[int]:
    return [*tok(text, add_special_tokens=False)["input_ids"], tok.convert_tokens_to_ids("<|im_end|>")]


def _tool_session(gw: LiveGateway, fake: FakeSGLang, tok: Any, cred: dict[str, Any], a: int, b: int,
                  *, edit: bool = False) -> None:
    client = gw.openai(cred)
    call = json.dumps({"name": "calculate", "arguments": {"expression": f"{a}+{b}"}})
    fake.script([_ids(tok, f"<tool_call>\n{call}\n</tool_call>")])
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a}+{b}?"}]
    r1 = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=60)
    m1 = r1.choices[0].message
    assert m1.tool_calls, "the scripted tool call was not parsed"
    msgs += [m1.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m1.tool_calls[0].id,
                                                 "content": str(a + b)}]
    fake.script([_ids(tok, str(a + b))])
    r2 = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=20)
    msgs.append(r2.choices[0].message.model_dump(exclude_none=True))
    if edit:  # the agent rewrites its question: a new chain, recorded as edited_message
        msgs[1] = {"role": "user", "content": f"What is {a}+{b}? Answer in words."}
        msgs.append({"role": "user", "content": "And again?"})
        fake.script([_ids(tok, "forty-two")])
        client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=20)


def _publish_mid_reply(gw: LiveGateway, fake: FakeSGLang, cred: dict[str, Any], model_path: Path) -> int:
    """One reply that a publish interrupts: its tokens carry the old version, then the new one."""
    done: dict[str, Any] = {}

    def agent() -> None:
        done["r"] = gw.openai(cred).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "count slowly"}], max_tokens=40)

    before = len(fake.requests)
    fake.token_delay = 0.03
    t = threading.Thread(target=agent)
    t.start()
    deadline = time.monotonic() + 20
    while (len(fake.requests) == before or not fake.running) and time.monotonic() < deadline:
        time.sleep(0.01)
    while time.monotonic() < deadline and not any(len(g.output) >= 3 for g in list(fake._gens.values())):
        time.sleep(0.01)  # at least one token out before the publish
    version = gw.admin.get("/v1/weights").json()["version"] + 1
    r = gw.admin.post("/v1/weights", json={"version": version, "model_path": str(model_path)})
    assert r.status_code == 200, r.text
    t.join(60)
    fake.token_delay = 0.0
    assert "r" in done
    return version


def fill(gw: LiveGateway, fake: FakeSGLang, tok: Any, tmp: Path) -> Filled:
    out = Filled()
    # A training group of 4 two-turn tool sessions with rewards 1, 0, 1, 0.5 (spread: GRPO signal).
    g = gw.group(4, task={"prompt": "What is 17+25?", "answer": 42})
    out.spread_group = g["group_id"]
    for i, cred in enumerate(g["sessions"]):
        _tool_session(gw, fake, tok, cred, 17, 25, edit=(i == 1))
        out.tool_sessions.append(cred["session_id"])
        out.creds[cred["session_id"]] = cred
    out.break_session = g["sessions"][1]["session_id"]
    for cred, reward in zip(g["sessions"], [1.0, 0.0, 1.0, 0.5], strict=True):
        gw.admin.post(f"/v1/sessions/{cred['session_id']}/reward", json={"reward": reward, "finish": True}) \
            .raise_for_status()
    # A group whose sessions all get 1.0: zero variance.
    z = gw.group(2, task={"prompt": "What is 2+2?", "answer": 4})
    out.zero_var_group = z["group_id"]
    for cred in z["sessions"]:
        _tool_session(gw, fake, tok, cred, 2, 2)
        out.creds[cred["session_id"]] = cred
        gw.admin.post(f"/v1/sessions/{cred['session_id']}/reward", json={"reward": 1.0, "finish": True}) \
            .raise_for_status()
    # Lease both complete groups, publish version 1 with them: they become trained at v1.
    lease = gw.admin.post("/v1/batches", json={"max_groups": 10, "trainer_version": 0}).json()
    version = gw.admin.get("/v1/weights").json()["version"] + 1
    gw.admin.post("/v1/weights", json={"version": version, "model_path": str(tmp),
                                       "batch_ids": [lease["batch_id"]]}).raise_for_status()
    gw.admin.post("/v1/training/steps", json={
        "step": 0, "version": version, "metrics": {"loss": 0.12, "kl": 0.01, "entropy": 2.3, "staleness_max": 0},
        "samples": [{"session_id": s, "group_id": out.spread_group, "advantage": adv, "reward": rw}
                    for s, adv, rw in zip(out.tool_sessions, [0.375, -0.625, 0.375, -0.125],
                                          [1.0, 0.0, 1.0, 0.5], strict=True)]}).raise_for_status()
    # A reply interrupted by the publish of the next version.
    p = gw.group(2, task={"prompt": "count slowly"})
    out.publish_session = p["sessions"][0]["session_id"]
    out.creds[out.publish_session] = p["sessions"][0]
    out.version = _publish_mid_reply(gw, fake, p["sessions"][0], tmp)
    # An eval group (version 1) and a group dropped for too few sessions.
    e = gw.group(2, task={"prompt": "eval: 5+5"}, eval=True, metadata={"eval_version": 1})
    out.eval_group = e["group_id"]
    for cred, reward in zip(e["sessions"], [1.0, 0.0], strict=True):
        gw.admin.post(f"/v1/sessions/{cred['session_id']}/reward", json={"reward": reward, "finish": True})
    d = gw.group(2, task={"prompt": "abandoned task"})
    out.dropped_group = d["group_id"]
    for cred in d["sessions"]:
        gw.admin.post(f"/v1/sessions/{cred['session_id']}/abandon", json={"reason": "agent crashed"})
    # Enough small groups for pagination: 23 of them with rewards 0..1.
    for i in range(23):
        s = gw.group(2, task={"prompt": f"filler task {i:02d}"})
        out.small_groups.append(s["group_id"])
        for j, cred in enumerate(s["sessions"]):
            gw.admin.post(f"/v1/sessions/{cred['session_id']}/reward",
                          json={"reward": (i % 5) / 4 if j == 0 else 0.0, "finish": True})
    return out
