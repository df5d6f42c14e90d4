"""Group lifecycle, rewards, leases (samples on the wire), expiry, ack, publish, and staleness admission."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from rollway_common.wire import decode_array
from tests.harness import LiveGateway


def play(gw: LiveGateway, cred: dict[str, Any], reward: float | None = None, turns: int = 1) -> list[str]:
    client = gw.openai(cred)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "37+48="}]
    ids = []
    for i in range(turns):
        r = client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
        ids.append(r.id)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": f"again {i}"}]
    if reward is not None:
        assert gw.admin.post(f"/v1/sessions/{cred['session_id']}/reward", json={"reward": reward}).status_code == 200
        assert gw.admin.post(f"/v1/sessions/{cred['session_id']}/finish").status_code == 200
    return ids


def state(gw: LiveGateway, gid: str) -> str:
    return gw.admin.get(f"/v1/groups/{gid}").json()["state"]  # type: ignore[no-any-return]


def lease(gw: LiveGateway, **body: Any) -> dict[str, Any]:
    r = gw.admin.post("/v1/batches", json={"max_groups": 64, "lease_seconds": 30, **body})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def drain(gw: LiveGateway) -> None:
    """Ack whatever is complete so each test starts from an empty queue."""
    b = lease(gw)
    if b["batch_id"]:
        gw.admin.post(f"/v1/batches/{b['batch_id']}/ack", json={"results": {}})


def test_group_completes_when_all_finished_and_rewarded(gateway: LiveGateway) -> None:
    g = gateway.group(3)
    a, b, c = g["sessions"]
    play(gateway, a, 1.0)
    play(gateway, b, 0.0)
    assert state(gateway, g["group_id"]) == "open"
    r = gateway.admin.post(f"/v1/sessions/{c['session_id']}/abandon", json={"reason": "crashed"})
    assert r.json()["state"] == "abandoned"
    assert state(gateway, g["group_id"]) == "complete"


def test_reward_with_finish_ends_the_session_in_one_call(gateway: LiveGateway) -> None:
    g = gateway.group(2)
    a, b = g["sessions"]
    play(gateway, a)
    play(gateway, b)
    hdr = {"Authorization": f"Bearer {a['api_key']}"}  # a session may reward and finish itself
    r = gateway.admin.post(f"/v1/sessions/{a['session_id']}/reward", json={"reward": 1.0, "finish": True}, headers=hdr)
    assert r.status_code == 200 and r.json()["state"] == "finished", r.text
    assert state(gateway, g["group_id"]) == "open"
    # idempotent: the same call again answers the same
    r = gateway.admin.post(f"/v1/sessions/{a['session_id']}/reward", json={"reward": 1.0, "finish": True})
    assert r.status_code == 200 and r.json()["state"] == "finished"
    r = gateway.admin.post(f"/v1/sessions/{b['session_id']}/reward", json={"reward": 0.0, "finish": True})
    assert r.json()["state"] == "finished" and state(gateway, g["group_id"]) == "complete"
    session = gateway.admin.get(f"/v1/sessions/{a['session_id']}").json()
    assert session["state"] == "finished" and session["reward"] == 1.0
    # an abandoned session cannot be finished by a reward, and the reward is not kept either
    g2 = gateway.group(2)
    c = g2["sessions"][0]
    gateway.admin.post(f"/v1/sessions/{c['session_id']}/abandon", json={})
    r = gateway.admin.post(f"/v1/sessions/{c['session_id']}/reward", json={"reward": 1.0, "finish": True})
    assert r.status_code == 409 and "abandoned" in r.json()["error"]["message"]
    assert gateway.admin.get(f"/v1/sessions/{c['session_id']}").json()["reward"] is None


def test_reward_is_idempotent_and_final_after_lease(gateway: LiveGateway) -> None:
    drain(gateway)
    g = gateway.group(2)
    a, b = g["sessions"]
    play(gateway, a, 1.0)
    play(gateway, b, 0.5)
    hdr = {"Authorization": f"Bearer {a['api_key']}"}  # a session may reward itself
    assert gateway.admin.post(f"/v1/sessions/{a['session_id']}/reward", json={"reward": 1.0}, headers=hdr).status_code == 200
    assert gateway.admin.post(f"/v1/sessions/{a['session_id']}/reward", json={"reward": 0.25}).status_code == 200
    batch = lease(gateway)
    assert [x["group_id"] for x in batch["groups"]] == [g["group_id"]]
    assert gateway.admin.post(f"/v1/sessions/{a['session_id']}/reward", json={"reward": 0.25}).status_code == 200
    r = gateway.admin.post(f"/v1/sessions/{a['session_id']}/reward", json={"reward": 0.9})
    assert r.status_code == 409 and r.json()["error"]["type"] == "conflict_error"
    gateway.admin.post(f"/v1/batches/{batch['batch_id']}/ack", json={"results": {}})


def test_too_few_live_sessions_drops_the_group(gateway: LiveGateway) -> None:
    g = gateway.group(2)
    a, b = g["sessions"]
    play(gateway, a, 1.0)
    gateway.admin.post(f"/v1/sessions/{b['session_id']}/abandon", json={})
    got = gateway.admin.get(f"/v1/groups/{g['group_id']}").json()
    assert got["state"] == "dropped" and got["drop_reason"] == "too_few_sessions"


def test_lease_samples_match_the_record(gateway: LiveGateway, fake: Any, tokenizer: Any) -> None:
    drain(gateway)
    g = gateway.group(2, task={"prompt": "37+48="})
    a, b = g["sessions"]
    play(gateway, a, 1.0, turns=2)
    play(gateway, b, 0.0)
    batch = lease(gateway)
    (group,) = batch["groups"]
    assert group["task"] == {"prompt": "37+48="}
    by_session = {s["session_id"]: s for s in group["samples"]}
    assert set(by_session) == {a["session_id"], b["session_id"]}  # 2 turns that extend -> one sequence
    s = by_session[a["session_id"]]
    tokens = decode_array(s["token_ids"])
    mask, lps = decode_array(s["loss_mask"]), decode_array(s["logprobs"])
    versions, returns = decode_array(s["versions"]), decode_array(s["returns"])
    assert len({len(tokens), len(mask), len(lps), len(versions), len(returns)}) == 1
    rec = gateway.session(a["session_id"])["turns"]
    last = rec[-1]
    assert tokens == last["prompt_ids"] + last["completion_ids"]
    model_spans = [t for t, m in zip(tokens, mask, strict=True) if m]
    assert model_spans == rec[0]["completion_ids"] + rec[1]["completion_ids"]
    assert [lp for lp, m in zip(lps, mask, strict=True) if m] == pytest.approx(rec[0]["logprobs"] + rec[1]["logprobs"])
    assert all(v == -1 for v, m in zip(versions, mask, strict=True) if not m)
    assert all(r == 1.0 for r, m in zip(returns, mask, strict=True) if m)
    assert s["reward"] == 1.0 and s["temperature"] == 1.0
    # The batch is leased: not handed out again; ack closes it for good.
    assert lease(gateway)["groups"] == []
    assert gateway.admin.post(f"/v1/batches/{batch['batch_id']}/ack",
                              json={"results": {group["group_id"]: "filtered"}}).status_code == 200
    got = gateway.admin.get(f"/v1/groups/{group['group_id']}").json()
    assert got["state"] == "dropped" and got["drop_reason"] == "filtered"


def test_expired_lease_returns_groups(gateway: LiveGateway) -> None:
    drain(gateway)
    g = gateway.group(2)
    for cred in g["sessions"]:
        play(gateway, cred, 1.0)
    first = lease(gateway, lease_seconds=0.3)
    assert len(first["groups"]) == 1
    time.sleep(0.5)
    again = lease(gateway)
    assert [x["group_id"] for x in again["groups"]] == [g["group_id"]]
    r = gateway.admin.post(f"/v1/batches/{first['batch_id']}/ack", json={})
    assert r.status_code == 409  # the expired lease can't ack: no group trained twice
    assert gateway.admin.post(f"/v1/batches/{again['batch_id']}/renew", json={"lease_seconds": 60}).status_code == 200
    gateway.admin.post(f"/v1/batches/{again['batch_id']}/ack", json={})


def test_long_poll_waits_for_a_complete_group(gateway: LiveGateway) -> None:
    drain(gateway)
    t0 = time.monotonic()
    assert lease(gateway, wait_seconds=0.6)["groups"] == []
    assert time.monotonic() - t0 >= 0.5


def test_min_groups_waits_for_that_many_then_leases_them_together(gateway: LiveGateway) -> None:
    drain(gateway)
    first, second = gateway.group(1), gateway.group(1)
    play(gateway, first["sessions"][0], 1.0)
    got: dict[str, Any] = {}

    def trainer() -> None:
        got["lease"] = lease(gateway, max_groups=2, min_groups=2, wait_seconds=20)
        got["at"] = time.monotonic()

    t = threading.Thread(target=trainer)
    t.start()
    time.sleep(0.8)
    assert t.is_alive()  # one group complete is not enough: still waiting
    done_at = time.monotonic()
    play(gateway, second["sessions"][0], 0.0)
    t.join(20)
    assert sorted(g["group_id"] for g in got["lease"]["groups"]) == sorted([first["group_id"], second["group_id"]])
    assert got["at"] - done_at < 10  # woken by the completion, not by the end of the wait
    gateway.admin.post(f"/v1/batches/{got['lease']['batch_id']}/ack", json={})


def test_min_groups_wakes_once_the_missing_groups_completed(gateway: LiveGateway) -> None:
    """With one of three groups complete the wait needs two more completions before it counts again: it must still
    lease all three once the last one completes (and not before)."""
    drain(gateway)
    groups = [gateway.group(1) for _ in range(3)]
    play(gateway, groups[0]["sessions"][0], 1.0)
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.update(lease(gateway, max_groups=3, min_groups=3, wait_seconds=20)))
    t.start()
    time.sleep(0.5)
    play(gateway, groups[1]["sessions"][0], 0.0)
    time.sleep(0.8)
    assert t.is_alive()  # two of three
    done_at = time.monotonic()
    play(gateway, groups[2]["sessions"][0], 1.0)
    t.join(20)
    assert time.monotonic() - done_at < 10
    assert sorted(g["group_id"] for g in got["groups"]) == sorted(g["group_id"] for g in groups)
    gateway.admin.post(f"/v1/batches/{got['batch_id']}/ack", json={})


def test_min_groups_counts_the_groups_of_a_lapsed_lease(gateway: LiveGateway) -> None:
    drain(gateway)
    first, second = gateway.group(1), gateway.group(1)
    play(gateway, first["sessions"][0], 1.0)
    held = lease(gateway, lease_seconds=0.3)  # a trainer that dies holding `first`
    assert [g["group_id"] for g in held["groups"]] == [first["group_id"]]
    play(gateway, second["sessions"][0], 0.0)
    t0 = time.monotonic()
    got = lease(gateway, max_groups=2, min_groups=2, wait_seconds=8)
    # `first` is back in the queue once its lease lapses (0.3 s), not only when the 8 s wait ends
    assert time.monotonic() - t0 < 4
    assert sorted(g["group_id"] for g in got["groups"]) == sorted([first["group_id"], second["group_id"]])
    gateway.admin.post(f"/v1/batches/{got['batch_id']}/ack", json={})


def test_a_waiting_lease_has_stored_the_trainers_parameters(gateway: LiveGateway, db_url: str) -> None:
    """Admission (every gateway's) uses B and η from the store as soon as the trainer asks, not once its wait for
    `min_groups` ends."""
    import asyncio

    from sqlalchemy import select

    from gateway.store.db import create_engine
    from gateway.store.models import Setting

    drain(gateway)
    body = {"min_groups": 4, "wait_seconds": 3, "groups_per_step": 4, "max_head_offpolicyness": 7}
    t = threading.Thread(target=lambda: lease(gateway, max_groups=4, **body))
    t.start()
    time.sleep(0.8)
    assert t.is_alive()

    async def stored() -> dict[str, object]:
        engine = create_engine(db_url)
        try:
            async with engine.connect() as conn:
                return {r.key: r.value for r in (await conn.execute(select(Setting.key, Setting.value))).all()}
        finally:
            await engine.dispose()

    settings = asyncio.run(stored())
    t.join(10)
    assert int(settings["groups_per_step"]) == 4 and int(settings["max_head_offpolicyness"]) == 7  # type: ignore[call-overload]


def test_min_groups_takes_what_there_is_when_the_wait_ends(gateway: LiveGateway) -> None:
    drain(gateway)
    g = gateway.group(1)
    play(gateway, g["sessions"][0], 1.0)
    t0 = time.monotonic()
    got = lease(gateway, max_groups=4, min_groups=4, wait_seconds=0.6)
    assert time.monotonic() - t0 >= 0.5
    assert [x["group_id"] for x in got["groups"]] == [g["group_id"]]
    gateway.admin.post(f"/v1/batches/{got['batch_id']}/ack", json={})
    r = gateway.admin.post("/v1/batches", json={"max_groups": 2, "min_groups": 3})
    assert r.status_code == 400 and "min_groups" in r.json()["error"]["message"]


def test_publish_loads_backends_bumps_version_and_acks(gateway: LiveGateway, fake: Any, tmp_path: Any) -> None:
    drain(gateway)
    g = gateway.group(2)
    for cred in g["sessions"]:
        play(gateway, cred, 1.0)
    batch = lease(gateway)
    v0 = gateway.admin.get("/v1/weights").json()["version"]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    r = gateway.admin.post("/v1/weights", json={"version": v0 + 1, "model_path": str(ckpt),
                                                "batch_id": batch["batch_id"], "results": {}})
    assert r.status_code == 200, r.text
    assert gateway.admin.get("/v1/weights").json() == {"version": v0 + 1, "model_path": str(ckpt)}
    assert fake.weight_version == str(v0 + 1)
    paths = [p for p, _ in fake.calls]
    i = paths.index("/pause_generation")
    assert paths[i:i + 3] == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    got = gateway.admin.get(f"/v1/groups/{g['group_id']}").json()
    assert got["state"] == "trained" and got["trained_version"] == v0 + 1
    # versions only move forward; a consumed batch can't be acked again
    assert gateway.admin.post("/v1/weights", json={"version": v0 + 1, "model_path": str(ckpt)}).status_code == 409
    # new tokens carry the new version
    cred = gateway.group(2)["sessions"][0]
    play(gateway, cred)
    assert set(gateway.session(cred["session_id"])["turns"][0]["versions"]) == {v0 + 1}


def test_partial_ack_then_publish_several_batches(gateway: LiveGateway, tmp_path: Any) -> None:
    drain(gateway)
    groups = [gateway.group(2) for _ in range(3)]
    for g in groups:
        for cred in g["sessions"]:
            play(gateway, cred, 1.0)
    first = lease(gateway, max_groups=2)
    second = lease(gateway, max_groups=2)
    g1, g2 = (x["group_id"] for x in first["groups"])
    (g3,) = (x["group_id"] for x in second["groups"])
    # Dynamic filtering acks one group of a live batch early; the batch stays leased for the rest.
    assert gateway.admin.post(f"/v1/batches/{first['batch_id']}/ack", json={"results": {g1: "filtered"}}).status_code == 200
    assert state(gateway, g1) == "dropped" and state(gateway, g2) == "leased"
    v = gateway.admin.get("/v1/weights").json()["version"] + 1
    r = gateway.admin.post("/v1/weights", json={"version": v, "model_path": str(tmp_path),
                                                "batch_ids": [first["batch_id"], second["batch_id"]]})
    assert r.status_code == 200, r.text
    assert state(gateway, g2) == "trained" and state(gateway, g3) == "trained"
    assert gateway.admin.post(f"/v1/batches/{second['batch_id']}/renew", json={}).status_code == 409


def test_lease_drops_groups_older_than_eta(gateway: LiveGateway) -> None:
    """eta = 0: a trainer at version v never gets a group with a token older than v; such groups are
    dropped as `stale` and counted. eta = 1 accepts one version of lag."""
    drain(gateway)
    v = gateway.admin.get("/v1/weights").json()["version"]
    old, fresh = gateway.group(2), gateway.group(2)
    for g in (old, fresh):
        for cred in g["sessions"]:
            play(gateway, cred, 1.0)
    got = lease(gateway, trainer_version=v + 1, max_head_offpolicyness=0)
    assert got["groups"] == [] and got["dropped_stale"] == 2
    info = gateway.admin.get(f"/v1/groups/{old['group_id']}").json()
    assert info["state"] == "dropped" and info["drop_reason"] == "stale"
    again = gateway.group(2)
    for cred in again["sessions"]:
        play(gateway, cred, 1.0)
    ok = lease(gateway, trainer_version=v + 1, max_head_offpolicyness=1)
    assert [g["group_id"] for g in ok["groups"]] == [again["group_id"]]
    gateway.admin.post(f"/v1/batches/{ok['batch_id']}/ack", json={})
    # reset the remembered eta so later tests see no admission control
    gateway.admin.post("/v1/batches", json={"max_head_offpolicyness": -1})


def test_concurrent_writes_never_fail(gateway: LiveGateway) -> None:
    """Many agents rewarding and finishing at once: every write waits its turn, none is refused."""
    from concurrent.futures import ThreadPoolExecutor

    creds = [c for _ in range(8) for c in gateway.group(8)["sessions"]]

    def end(cred: dict[str, Any]) -> tuple[int, int]:
        sid = cred["session_id"]
        r1 = gateway.admin.post(f"/v1/sessions/{sid}/reward", json={"reward": 1.0})
        r2 = gateway.admin.post(f"/v1/sessions/{sid}/finish")
        return r1.status_code, r2.status_code

    with ThreadPoolExecutor(32) as pool:
        codes = list(pool.map(end, creds))
    assert codes == [(200, 200)] * len(creds)
    drain(gateway)


def test_metrics_report_eval_reward_and_pass_at_k_per_version(gateway: LiveGateway) -> None:
    def eval_group(version: int, rewards: list[float]) -> None:
        r = gateway.admin.post("/v1/groups", json={"task": "held-out", "n_samples": len(rewards), "eval": True,
                                                   "metadata": {"eval_version": version}})
        assert r.status_code == 201, r.text
        for cred, reward in zip(r.json()["sessions"], rewards, strict=True):
            play(gateway, cred, reward)

    eval_group(7001, [1.0, 0.0])
    eval_group(7001, [0.0, 0.0])
    eval_group(7002, [1.0, 1.0])
    text = gateway.admin.get("/metrics").text
    # version 7001: rewards 1, 0, 0, 0 -> mean 0.25; one group of two has a success -> pass@2 = 0.5
    assert 'rollway_eval_mean_reward{version="7001"} 0.25' in text
    assert 'rollway_eval_pass_at_k{k="2",version="7001"} 0.5' in text
    assert 'rollway_eval_groups{version="7001"} 2.0' in text
    assert 'rollway_eval_mean_reward{version="7002"} 1.0' in text
    assert 'rollway_turns_total{continuity="new-chain"}' in text  # the per-process counters are there too
    assert 'rollway_requests_total{route="/v1/sessions/{session_id}/reward",status="200"}' in text
    assert 'rollway_request_seconds_count{route="/v1/chat/completions"}' in text


def test_a_group_with_no_turns_is_dropped_not_left_leased(gateway: LiveGateway) -> None:
    """Sessions finished and rewarded without a single turn give nothing to train: the lease closes the group
    (`no_samples`), where it used to hand it out and leave it `leased` until some trainer acked it."""
    drain(gateway)
    empty = gateway.group(2)
    for s in empty["sessions"]:
        play(gateway, s, 1.0, turns=0)
    full = gateway.group(2)
    for s, r in zip(full["sessions"], (1.0, 0.0), strict=True):
        play(gateway, s, r)
    assert state(gateway, empty["group_id"]) == "complete"
    for lease_format in (1, 2):
        batch = lease(gateway, lease_format=lease_format)
        assert [g["group_id"] for g in batch["groups"]] == [full["group_id"]]
        got = gateway.admin.get(f"/v1/groups/{empty['group_id']}").json()
        assert got["state"] == "dropped" and got["drop_reason"] == "no_samples"
        assert gateway.admin.post(f"/v1/batches/{batch['batch_id']}/ack", json={}).status_code == 200
        empty, full = gateway.group(2), gateway.group(2)
        for s in empty["sessions"]:
            play(gateway, s, 0.5, turns=0)
        for s, r in zip(full["sessions"], (1.0, 0.0), strict=True):
            play(gateway, s, r)
    drain(gateway)
    # A lease of nothing but such groups closes its batch too: nothing stays leased.
    only = gateway.group(2)
    for s in only["sessions"]:
        play(gateway, s, 1.0, turns=0)
    batch = lease(gateway)
    assert batch["batch_id"] is None and batch["groups"] == []
    assert state(gateway, only["group_id"]) == "dropped"


def test_lease_formats_give_the_same_returns(gateway: LiveGateway) -> None:
    """Format 2 (turns, per-turn rewards) and format 1 (the gateway's per-token returns) of the same recorded
    sessions: the trainer's returns from format 2 equal format 1's, and so do a GRPO step's advantages, for
    session rewards and for per-turn rewards with gamma 1."""
    from trainer.advantages import chain_returns, score_group
    from trainer.client import parse_group

    drain(gateway)
    g = gateway.group(3)
    a, b, c = g["sessions"]
    play(gateway, a, 0.7, turns=2)
    play(gateway, b, 0.1, turns=1)
    ids = play(gateway, c, None, turns=3)
    body = {"reward": 0.3, "turn_rewards": [{"turn_id": ids[0], "reward": 0.25}, {"turn_id": ids[2], "reward": 1.5}],
            "finish": True}
    assert gateway.admin.post(f"/v1/sessions/{c['session_id']}/reward", json=body).status_code == 200
    one = lease(gateway, lease_seconds=0.5)
    assert "lease_format" not in one and all("returns" in s for s in one["groups"][0]["samples"])
    time.sleep(0.6)  # the lease lapses: the same group again, in format 2
    two = lease(gateway, lease_format=2)
    assert two["lease_format"] == 2 and "gamma" not in two  # this gateway's gamma is not set
    (g1,), (g2,) = one["groups"], two["groups"]
    assert g1["group_id"] == g2["group_id"] == g["group_id"]
    for s in g2["samples"]:
        assert "returns" not in s and len(s["turn_rewards"]) == len(decode_array(s["turn_ends"]))
    p1, p2 = parse_group(g1), parse_group(g2)
    assert [s.session_id for s in p1.samples] == [s.session_id for s in p2.samples]
    turn_rewarded = [s for s in p2.samples if s.session_id == c["session_id"]]
    assert turn_rewarded and turn_rewarded[0].turn_rewards == [0.25, None, 1.5]
    for s1, s2 in zip(p1.samples, p2.samples, strict=True):
        assert s1.returns == chain_returns(s2, 1.0)
    for std_norm in (False, True):
        assert score_group(p1, std_norm).advantages == score_group(p2, std_norm, 1.0).advantages
    # The trainer's own gamma: per-turn rewards discounted backwards (1.5; 0 + 0.5 * 1.5; 0.25 + 0.5 * 0.75).
    rets = chain_returns(turn_rewarded[0], 0.5)
    mask = turn_rewarded[0].loss_mask
    assert sorted({r for r, m in zip(rets, mask, strict=True) if m}) == [0.375 + 0.25, 0.75, 1.5]
    assert gateway.admin.post(f"/v1/batches/{two['batch_id']}/ack", json={}).status_code == 200


def test_an_unknown_lease_format_is_a_clear_400(gateway: LiveGateway) -> None:
    r = gateway.admin.post("/v1/batches", json={"lease_format": 3})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "lease_format" in err["message"] and "1, 2" in err["message"]


def test_the_deprecated_gateway_gamma_keeps_its_meaning(fake: Any, tiny_model_dir: Any, db_url: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """ROLLWAY_GAMMA set on the gateway: a warning at start; format 1's returns are discounted with it as before,
    and format 2's lease carries it, so a trainer without its own gamma computes the same returns."""
    from trainer.advantages import chain_returns
    from trainer.client import Lease, parse_group
    from trainer.config import TrainConfig
    from trainer.train import lease_gamma

    with caplog.at_level("WARNING", logger="rollway.gateway"), \
            LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=db_url, gamma=0.5) as gw:
        assert any("gamma" in r.getMessage() and "deprecated" in r.getMessage() for r in caplog.records)
        drain(gw)
        g = gw.group(2)
        a, b = g["sessions"]
        ids = play(gw, a, None, turns=2)
        body = {"reward": 1.0, "turn_rewards": [{"turn_id": ids[1], "reward": 1.0}], "finish": True}
        assert gw.admin.post(f"/v1/sessions/{a['session_id']}/reward", json=body).status_code == 200
        play(gw, b, 0.0)
        one = lease(gw, lease_seconds=0.5)
        time.sleep(0.6)
        two = lease(gw, lease_format=2)
        assert two["gamma"] == 0.5
        p1, p2 = parse_group(one["groups"][0]), parse_group(two["groups"][0])
        gamma = lease_gamma(TrainConfig(), Lease(two["batch_id"], 0, [p2], 0, 2, two["gamma"]))
        assert gamma == 0.5
        (s1,) = [s for s in p1.samples if s.session_id == a["session_id"]]
        (s2,) = [s for s in p2.samples if s.session_id == a["session_id"]]
        assert sorted({r for r, m in zip(s1.returns or [], s1.loss_mask, strict=True) if m}) == [0.5, 1.0]
        assert chain_returns(s2, gamma) == s1.returns
        assert gw.admin.post(f"/v1/batches/{two['batch_id']}/ack", json={}).status_code == 200


def test_a_publish_gives_each_group_the_version_it_was_trained_at(gateway: LiveGateway, tmp_path: Any) -> None:
    """A trainer acks only with a durable checkpoint: the groups of every step since the last one ride on its
    publish, each with the version its update first went into (else all had the checkpoint's version)."""
    drain(gateway)
    groups = [gateway.group(2) for _ in range(3)]
    for g in groups:
        for cred in g["sessions"]:
            play(gateway, cred, 1.0)
    batch = lease(gateway, max_groups=3)
    ids = [x["group_id"] for x in batch["groups"]]
    v0 = gateway.admin.get("/v1/weights").json()["version"]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    body = {"version": v0 + 3, "model_path": str(ckpt), "batch_ids": [batch["batch_id"]]}
    for bad in (v0 + 4, 0, True, "1"):  # past this publish, not a version, a bool, a number as text
        r = gateway.admin.post("/v1/weights", json={**body, "results": {ids[0]: bad}})
        assert r.status_code == 400 and (bad is True or "trained at" in r.text), (bad, r.text)
    assert gateway.admin.get("/v1/weights").json()["version"] == v0  # refused before anything was published
    r = gateway.admin.post("/v1/weights", json={**body, "results": {ids[0]: v0 + 1, ids[1]: v0 + 2}})
    assert r.status_code == 200, r.text
    got = [gateway.admin.get(f"/v1/groups/{gid}").json() for gid in ids]
    assert [(g["state"], g["trained_version"]) for g in got] == [
        ("trained", v0 + 1), ("trained", v0 + 2), ("trained", v0 + 3)]


def test_sessions_ended_at_once_move_their_group(gateway: LiveGateway) -> None:
    """Every session of a group finished (or abandoned) at the same moment: on PostgreSQL each transaction read the
    others as still active (READ COMMITTED) and none moved the group, which stayed open for good. 5 groups of 8."""
    from concurrent.futures import ThreadPoolExecutor

    def end(cred: dict[str, Any], how: str) -> int:
        path = f"/v1/sessions/{cred['session_id']}/{how}"
        return gateway.admin.post(path, json={"reason": "x"} if how == "abandon" else None).status_code

    for how, want in (("finish", "complete"), ("abandon", "dropped")):
        groups = [gateway.group(8) for _ in range(5)]
        for g in groups:
            for cred in g["sessions"]:
                if how == "finish":
                    assert gateway.admin.post(f"/v1/sessions/{cred['session_id']}/reward",
                                              json={"reward": 1.0}).status_code == 200
        with ThreadPoolExecutor(8) as pool:
            for g in groups:
                assert list(pool.map(end, g["sessions"], [how] * 8)) == [200] * 8
        assert [state(gateway, g["group_id"]) for g in groups] == [want] * 5
