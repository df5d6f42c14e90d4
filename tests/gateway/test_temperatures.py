"""A session whose client changes its temperature between turns (allowed by its group's sampling policy) is
trained at each token's own temperature: the gateway serves per-token temperatures, the trainer divides each
token's logits by the temperature that sampled it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway
from trainer.advantages import score_group
from trainer.batching import collate, rows_of
from trainer.client import parse_group
from trainer.step import forward_logprobs


def test_two_temperatures_in_one_session_reach_the_trainer_per_token(tiny_model_dir: Path, db_url: str) -> None:
    with FakeSGLang(vocab=range(100, 1000)) as fake, \
            LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=db_url) as gw:
        g = gw.group(2, sampling={"allow_client_override": True})
        for cred in g["sessions"]:
            client = gw.openai(cred)
            msgs: list[dict[str, Any]] = [{"role": "user", "content": "37+48="}]
            r = client.chat.completions.create(model="m", messages=msgs, max_tokens=3, temperature=0.5)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "again"}]
            client.chat.completions.create(model="m", messages=msgs, max_tokens=3, temperature=1.5)
            assert gw.admin.post(f"/v1/sessions/{cred['session_id']}/reward",
                                 json={"reward": 1.0, "finish": True}).status_code == 200
        # The backend was asked for each turn's temperature.
        assert [r["sampling_params"]["temperature"] for r in fake.requests[-4:]] == [0.5, 1.5, 0.5, 1.5]
        lease = gw.admin.post("/v1/batches", json={"max_groups": 8}).json()
        (group,) = [parse_group(x) for x in lease["groups"] if x["group_id"] == g["group_id"]]
        sid = g["sessions"][0]["session_id"]
        (sample,) = [s for s in group.samples if s.session_id == sid]
        turns = gw.session(sid)["turns"]
        assert [t["temperature"] for t in turns] == [0.5, 1.5] and turns[1]["continuity"] == "extends"

    assert isinstance(sample.temperature, list) and len(sample.temperature) == len(sample.token_ids)
    first_turn = len(turns[0]["prompt_ids"]) + len(turns[0]["completion_ids"])
    assert set(sample.temperature[:first_turn]) == {0.5} and set(sample.temperature[first_turn:]) == {1.5}
    # The trainer's own path: scored group -> rows -> micro-batch -> the model's logprobs, each token scored
    # (from position t, for token t+1) at the temperature of the turn that sampled it.
    scored = score_group(group, std_norm=False)
    (row,) = [r for s, r in zip(scored.samples, rows_of(scored), strict=True) if s.session_id == sid]
    mb = collate([row])
    assert mb.temperature[0].tolist() == sample.temperature[1:]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        got, _ = forward_logprobs(model, mb)
        logits = model(input_ids=mb.input_ids).logits[0]
    trained = [t for t in range(mb.targets.shape[1]) if mb.loss_mask[0, t]]
    assert any(t + 1 < first_turn for t in trained) and any(t + 1 >= first_turn for t in trained)
    for t in trained:
        temp = 0.5 if t + 1 < first_turn else 1.5
        expected = torch.log_softmax(logits[t] / temp, -1)[mb.targets[0, t]]
        assert torch.isclose(got[0, t], expected, atol=1e-5), (t, temp)
