"""A backend that dies mid-stream never reaches the agent: the reply continues on a healthy backend from the
tokens already sent, and the turn records which backend produced which tokens."""

from __future__ import annotations

from pathlib import Path

from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway


def test_stream_survives_a_backend_dropping_mid_reply(tiny_model_dir: Path, sqlite_url: str) -> None:
    with FakeSGLang(vocab=range(100, 1000), token_delay=0.01) as a, \
            FakeSGLang(vocab=range(100, 1000), token_delay=0.01, seed=1) as b, \
            LiveGateway(backends=[a.url, b.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        cred = gw.group(1)["sessions"][0]
        client = gw.openai(cred)
        messages = [{"role": "user", "content": "hi"}]
        client.chat.completions.create(model="m", messages=messages, max_tokens=2)
        home = gw.session(cred["session_id"])["turns"][0]["timings"]["backend"]
        fakes = {bk["id"]: (a if bk["url"] == a.url else b) for bk in gw.admin.get("/v1/backends").json()["data"]}
        fakes[home].fail_stream(5, message=None)  # the session's backend drops the connection mid-reply
        stream = client.chat.completions.create(model="m", messages=messages, max_tokens=12, stream=True)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "length"
        turn = gw.session(cred["session_id"])["turns"][-1]
        assert len(turn["completion_ids"]) == 12 and text
        segments = turn["timings"]["backends"]
        assert [s[1] for s in segments] == [home, next(i for i in fakes if i != home)], segments
        kept = segments[1][0]
        assert 0 < kept <= 5
        # The other backend continued the reply: prompt + the tokens already sent, with the budget left.
        other = fakes[segments[1][1]]
        resubmitted = [r for r in other.requests if r.get("stream")][-1]
        assert resubmitted["input_ids"][-kept:] == turn["completion_ids"][:kept]
        assert resubmitted["sampling_params"]["max_new_tokens"] == 12 - kept
        # The dead one is out of rotation until its health check passes again.
        healthy = {bk["id"]: bk["healthy"] for bk in gw.admin.get("/v1/backends").json()["data"]}
        assert healthy[segments[1][1]]
