"""`POST /v1/groups` with an Idempotency-Key: a retry answers as the first creation did (same ids, same keys, no
second group), a reused key with another body is a 409, and the runner retries a creation whose connection dropped
after the gateway created the group."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from rollway.rollout import Runner
from tests.harness import ADMIN_KEY, LiveGateway


def create(gw: LiveGateway, key: str | None, task: Any = None, n: int = 2, **extra: Any) -> Any:
    headers = {} if key is None else {"Idempotency-Key": key}
    return gw.admin.post("/v1/groups", json={"task": task or {"q": "idem"}, "n_samples": n, **extra}, headers=headers)


def test_a_keyed_creation_sent_again_gets_the_same_group_ids_and_keys(gateway: LiveGateway) -> None:
    first = create(gateway, "run-1/task-7")
    again = create(gateway, "run-1/task-7")
    assert first.status_code == again.status_code == 201, (first.text, again.text)
    assert "idempotent-replayed" not in first.headers and again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    group = gateway.admin.get(f"/v1/groups/{first.json()['group_id']}").json()
    assert len(group["sessions"]) == 2
    # the keys handed out twice open their sessions (the store keeps only their hashes)
    for cred in again.json()["sessions"]:
        reply = gateway.openai(cred).chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1="}],
                                                             max_tokens=2)
        assert reply.choices[0].message is not None
    other = create(gateway, "run-1/task-8")
    assert other.status_code == 201 and other.json()["group_id"] != first.json()["group_id"]
    assert {s["api_key"] for s in other.json()["sessions"]}.isdisjoint(s["api_key"] for s in first.json()["sessions"])


def test_without_a_key_every_creation_is_a_new_group(gateway: LiveGateway) -> None:
    a, b = create(gateway, None), create(gateway, None)
    assert a.status_code == b.status_code == 201
    assert a.json()["group_id"] != b.json()["group_id"]


def test_a_key_reused_for_another_group_is_a_conflict(gateway: LiveGateway) -> None:
    assert create(gateway, "reused", task={"q": "one"}).status_code == 201
    for change in ({"task": {"q": "two"}}, {"n": 3}, {"eval": True}):
        task = change.pop("task", {"q": "one"})
        r = create(gateway, "reused", task=task, **change)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["param"] == "Idempotency-Key"


def test_a_bad_key_is_a_400_naming_the_header(gateway: LiveGateway) -> None:
    for key in (b"x" * 256, "caf\u00e9".encode(), b"a\tb"):
        r = gateway.admin.post("/v1/groups", json={"task": "t"}, headers={"Idempotency-Key": key})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "Idempotency-Key"


@contextlib.asynccontextmanager
async def dropping_proxy(upstream_port: int, seen: list[bytes]) -> AsyncIterator[int]:
    """A TCP proxy in front of the gateway that forwards each request and relays its answer, except the first
    `POST /v1/groups`: that one reaches the gateway (which creates the group) but its answer is dropped and the
    client's connection closed, as a connection lost at that moment would be."""
    dropped = False

    async def read_message(reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return head + (await reader.readexactly(length) if length else b"")

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        nonlocal dropped
        up_r, up_w = await asyncio.open_connection("127.0.0.1", upstream_port)
        try:
            while True:
                try:
                    request = await read_message(client_r)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                up_w.write(request)
                await up_w.drain()
                answer = await read_message(up_r)
                seen.append(request.split(b"\r\n", 1)[0] + b" -> " + answer)
                if request.startswith(b"POST /v1/groups ") and not dropped:
                    dropped = True
                    return  # the gateway answered; the client never hears it
                client_w.write(answer)
                await client_w.drain()
        finally:
            up_w.close()
            client_w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


def test_the_runner_retries_a_creation_whose_answer_was_lost_and_gets_the_group_it_created(
        gateway: LiveGateway) -> None:
    seen: list[bytes] = []

    async def agent(task: dict[str, Any], client: Any) -> float:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2="}], max_tokens=2)
        return 1.0

    async def main() -> list[float | None]:
        async with dropping_proxy(gateway.port, seen) as port:
            runner = Runner(f"http://127.0.0.1:{port}", ADMIN_KEY, agent, concurrency=2)
            try:
                return await runner.run_group({"q": "lost answer"}, 2)
            finally:
                await runner.close()

    rewards = asyncio.run(main())
    assert rewards == [1.0, 1.0]
    creations = [s for s in seen if s.startswith(b"POST /v1/groups ")]
    assert len(creations) == 2, seen  # the lost one, and the retry
    assert b"201 Created" in creations[0] and b"idempotent-replayed: true" in creations[1].lower()
    gid = creations[0].split(b'"group_id":"', 1)[1].split(b'"', 1)[0].decode()
    assert gid.encode() in creations[1]  # the retry answered with the group the lost attempt created
    group = gateway.admin.get(f"/v1/groups/{gid}").json()
    assert [s["state"] for s in group["sessions"]] == ["finished", "finished"] and group["state"] == "complete"
