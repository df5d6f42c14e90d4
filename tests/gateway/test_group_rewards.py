"""`POST /v1/groups/{id}/rewards`: several sessions of a group rewarded and finished in one request and one
transaction, with the per-session route's checks; on any error nothing of the request is kept. SQLite and
PostgreSQL (the `db_url` fixture)."""

from __future__ import annotations

from typing import Any

from tests.gateway.test_groups_and_leases import drain, lease, play, state
from tests.harness import LiveGateway


def rewards(gw: LiveGateway, gid: str, items: list[tuple[str, float]], finish: bool = True,
            headers: dict[str, str] | None = None) -> Any:
    return gw.admin.post(f"/v1/groups/{gid}/rewards", headers=headers,
                         json={"rewards": [{"session_id": s, "reward": r} for s, r in items], "finish": finish})


def session(gw: LiveGateway, sid: str) -> dict[str, Any]:
    return gw.admin.get(f"/v1/sessions/{sid}").json()  # type: ignore[no-any-return]


def test_one_request_rewards_and_finishes_the_group_into_a_lease(gateway: LiveGateway) -> None:
    drain(gateway)
    g = gateway.group(3)
    sids = [s["session_id"] for s in g["sessions"]]
    for cred in g["sessions"]:
        play(gateway, cred)
    r = rewards(gateway, g["group_id"], [(sids[0], 1.0), (sids[1], 0.0)])
    assert r.status_code == 200, r.text
    assert r.json() == {"group_id": g["group_id"], "ok": True, "state": "open",
                        "sessions": [{"session_id": sids[0], "state": "finished"},
                                     {"session_id": sids[1], "state": "finished"}]}
    assert state(gateway, g["group_id"]) == "open"  # the third is still active
    r = rewards(gateway, g["group_id"], [(sids[2], 0.5), (sids[0], 1.0)])  # the same value again is no change
    assert r.status_code == 200 and r.json()["state"] == "complete", r.text
    assert [session(gateway, s)["reward"] for s in sids] == [1.0, 0.0, 0.5]
    batch = lease(gateway)
    assert [x["group_id"] for x in batch["groups"]] == [g["group_id"]]
    assert sorted(s["reward"] for s in batch["groups"][0]["sessions"]) == [0.0, 0.5, 1.0]
    # leased: the same rewards are still accepted, a different one is a 409 and changes nothing
    assert rewards(gateway, g["group_id"], [(sids[0], 1.0)]).status_code == 200
    r = rewards(gateway, g["group_id"], [(sids[1], 0.0), (sids[0], 0.75)])
    assert r.status_code == 409 and r.json()["error"]["type"] == "conflict_error", r.text
    assert session(gateway, sids[0])["reward"] == 1.0
    gateway.admin.post(f"/v1/batches/{batch['batch_id']}/ack", json={"results": {}})


def test_any_error_keeps_nothing_of_the_request(gateway: LiveGateway) -> None:
    drain(gateway)
    g, other = gateway.group(3), gateway.group(2)
    sids = [s["session_id"] for s in g["sessions"]]
    for cred in g["sessions"]:
        play(gateway, cred)
    gateway.admin.post(f"/v1/sessions/{sids[2]}/abandon", json={})
    stranger = other["sessions"][0]["session_id"]
    # a session of another group, after one that would have been stored: 404, and the first is not rewarded
    r = rewards(gateway, g["group_id"], [(sids[0], 1.0), (stranger, 1.0)])
    assert r.status_code == 404 and r.json()["error"]["param"] == "rewards", r.text
    # an abandoned session takes no reward: 409, the one before it untouched too
    r = rewards(gateway, g["group_id"], [(sids[1], 1.0), (sids[2], 1.0)])
    assert r.status_code == 409 and "abandoned" in r.json()["error"]["message"], r.text
    for sid in sids[:2]:
        s = session(gateway, sid)
        assert s["reward"] is None and s["state"] == "active", s
    assert session(gateway, stranger)["reward"] is None
    assert rewards(gateway, "grp_nope", [(sids[0], 1.0)]).status_code == 404
    # the two live sessions rewarded: the group completes without its abandoned one
    r = rewards(gateway, g["group_id"], [(sids[0], 1.0), (sids[1], 0.0)])
    assert r.status_code == 200 and r.json()["state"] == "complete", r.text
    drain(gateway)


def test_without_finish_the_sessions_stay_active(gateway: LiveGateway) -> None:
    g = gateway.group(2)
    sids = [s["session_id"] for s in g["sessions"]]
    r = rewards(gateway, g["group_id"], [(sids[0], 1.0), (sids[1], 1.0)], finish=False)
    assert r.status_code == 200 and [s["state"] for s in r.json()["sessions"]] == ["active", "active"]
    assert r.json()["state"] == "open"
    for sid in sids:
        gateway.admin.post(f"/v1/sessions/{sid}/finish")
    assert state(gateway, g["group_id"]) == "complete"
    drain(gateway)


def test_bad_bodies_and_keys_are_refused_clearly(gateway: LiveGateway) -> None:
    g = gateway.group(2)
    a, b = g["sessions"]
    url = f"/v1/groups/{g['group_id']}/rewards"
    for body in ({}, {"rewards": []}, {"rewards": [{"session_id": a["session_id"]}]},
                 {"rewards": [{"session_id": a["session_id"], "reward": "1"}]},
                 {"rewards": [{"session_id": a["session_id"], "reward": 1.0}], "extra": 1},
                 {"rewards": [{"session_id": a["session_id"], "reward": 1.0},
                              {"session_id": a["session_id"], "reward": 0.0}]}):
        r = gateway.admin.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (body, r.text)
    r = gateway.admin.post(url, content=b'{"rewards": [{"session_id": "x", "reward": NaN}]}',
                           headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    # a session's own key rewards its session (the per-session route), not its group
    r = rewards(gateway, g["group_id"], [(a["session_id"], 1.0)], headers={"Authorization": f"Bearer {a['api_key']}"})
    assert r.status_code in (401, 403), r.text
    assert session(gateway, a["session_id"])["reward"] is None
    for cred in (a, b):
        gateway.admin.post(f"/v1/sessions/{cred['session_id']}/abandon", json={})
