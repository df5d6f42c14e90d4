"""The gateway client against httpx.MockTransport: wire decoding, error envelopes, unreachable gateway."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from tests.trainer.trainer_fakes import make_group
from trainer.client import GatewayClient, GatewayHTTPError, GatewayUnreachable, LeaseRenewer


def test_lease_decodes_wire_arrays() -> None:
    group = make_group("g1", [1.0, 0.0], random.Random(0))
    seen = {}

    def handler(req: httpx.Request) -> httpx.Response:
        seen["auth"] = req.headers["authorization"]
        seen["body"] = json.loads(req.content)
        return httpx.Response(
            200, json={"batch_id": "b1", "expires_at": 0, "groups": [group], "dropped_stale": 2}
        )

    with GatewayClient("http://gw", "key", transport=httpx.MockTransport(handler)) as c:
        lease = c.lease(
            max_groups=4,
            lease_seconds=60,
            wait_seconds=1,
            groups_per_step=4,
            max_head_offpolicyness=1,
            trainer_version=3,
        )
    assert lease is not None and lease.batch_id == "b1" and lease.dropped_stale == 2
    assert seen["auth"] == "Bearer key" and seen["body"]["trainer_version"] == 3
    s = lease.groups[0].samples[0]
    assert len(s.token_ids) == len(s.loss_mask) == len(s.logprobs) == len(s.versions) == len(s.returns)
    assert all(isinstance(t, int) for t in s.token_ids) and s.temperature == 1.0
    assert [x.reward for x in lease.groups[0].sessions] == [1.0, 0.0]


def test_204_means_nothing_ready() -> None:
    with GatewayClient("http://gw", transport=httpx.MockTransport(lambda r: httpx.Response(204))) as c:
        assert (
            c.lease(
                max_groups=1,
                lease_seconds=1,
                wait_seconds=0,
                groups_per_step=1,
                max_head_offpolicyness=0,
                trainer_version=0,
            )
            is None
        )


def test_error_envelope_is_surfaced() -> None:
    body = {
        "error": {
            "message": "version 3 is not above 5",
            "type": "conflict_error",
            "param": None,
            "code": None,
        }
    }
    with GatewayClient(
        "http://gw", transport=httpx.MockTransport(lambda r: httpx.Response(409, json=body))
    ) as c:
        with pytest.raises(GatewayHTTPError, match="version 3 is not above 5") as e:
            c.publish(3, "/w", "b1", {})
    assert e.value.status == 409 and e.value.type == "conflict_error"


def test_unreachable_gateway_names_the_url() -> None:
    from trainer.fsdp import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with GatewayClient(url, timeout=2.0) as c, pytest.raises(GatewayUnreachable, match=url):
        c.current_weights()


def test_renewer_renews_held_batches_only() -> None:
    renewed: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        renewed.append(req.url.path)
        return httpx.Response(200, json={})

    with GatewayClient("http://gw", transport=httpx.MockTransport(handler)) as c:
        r = LeaseRenewer(c, lease_seconds=3600)
        r.hold("a")
        r.hold("b")
        r.release("a")
        r.renew_now()
        r.close()
    assert renewed == ["/v1/batches/b/renew"]


@pytest.mark.parametrize("reward", [1e308 * 10, float("-inf"), float("nan")])
def test_a_lease_with_non_finite_rewards_or_returns_is_refused(reward: float) -> None:
    """The probe's 1e308 rewards became float32 `inf` returns: the trainer refuses such a lease rather than train
    on it (one inf makes every advantage of its group NaN)."""
    from trainer.client import parse_group

    good = make_group("g1", [1.0, 0.0], random.Random(0))
    assert parse_group(good).samples
    with pytest.raises(ValueError, match="non-finite"):
        parse_group(make_group("g1", [reward, 0.0], random.Random(0)))
    # a float32 overflow: a finite reward whose returns are inf on the wire
    overflow = make_group("g1", [1e308, 0.0], random.Random(0))
    overflow["sessions"][0]["reward"] = overflow["samples"][0]["reward"] = 1.0
    with pytest.raises(ValueError, match="returns"):
        parse_group(overflow)
