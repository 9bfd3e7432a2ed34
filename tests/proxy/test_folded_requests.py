"""Issue 21: fewer requests per trained group. A claim carries the previous claim's ack, a submit leases the next
call's prompts; and a worker that sends neither (an older one) is answered as before, request by request."""

from __future__ import annotations

import httpx
import msgpack

from bucketrl.wire import ClaimResponse, PromptLease, PromptLeaseRequest, SubmitResponse, packed
from tests.proxy.harness import ProxyHarness
from tests.proxy.test_queue_state import make_batch
from tests.proxy.test_rollouts_routes import Setup


def _trainer_http(proxy: ProxyHarness) -> httpx.Client:
    h = proxy.http("trainer")
    h.headers["X-Trainer-Epoch"] = "1"
    return h


def test_a_claim_acks_the_previous_claims_deliveries_first(proxy: ProxyHarness) -> None:
    s = Setup(proxy, queue_capacity_groups=32, groups_per_step=8)
    s.g.submit_rollouts(s.batch(3), "k1")
    first = s.t.claim("trainer-0", max_groups=3)
    assert first.acked is None  # no ack asked for
    s.g.submit_rollouts(s.batch(2), "k2")
    ids = [d.delivery_id for d in first.deliveries]
    second = s.t.claim("trainer-0", max_groups=8, ack=ids)
    assert second.acked == 3 and [d.groups[0].prompt_id for d in second.deliveries] == ["0-3", "0-4"]
    q = s.t.status().queue
    assert (q.acked_total, q.pending, q.groups) == (3, 2, 0)
    # Acked ids again (and an empty claim): counted 0, as a second POST rollouts/ack counts them.
    again = s.t.claim("trainer-0", max_groups=8, ack=ids)
    assert (again.acked, again.deliveries) == (0, [])
    # JSON, as an older trainer's claim asks: the same fields.
    with _trainer_http(proxy) as h:
        body = {"consumer": "trainer-0", "ack": [d.delivery_id for d in second.deliveries]}
        resp = h.post("/v1/runs/r1/rollouts/claim", json=body)
    assert resp.status_code == 200 and resp.json()["acked"] == 2 and resp.json()["deliveries"] == []
    assert s.t.status().queue.acked_total == 5


def test_a_fenced_claim_acks_nothing(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, queue_capacity_groups=32, groups_per_step=8)
    s.g.submit_rollouts(s.batch(2), "k1")
    ids = [d.delivery_id for d in s.t.claim("trainer-0", max_groups=8).deliveries]
    newer = proxy_file.client("r1", "trainer")
    newer.register_trainer("trainer-1")
    with _trainer_http(proxy_file) as h:
        resp = h.post("/v1/runs/r1/rollouts/claim", json={"consumer": "trainer-0", "ack": ids})
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "fenced"
    assert s.t.status().queue.acked_total == 0


def test_a_submit_leases_the_next_prompts(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, queue_capacity_groups=32, groups_per_step=8, max_staleness=2)
    nxt = PromptLeaseRequest(worker_id="gen-0", n=2, ttl_s=60, request_id="next-1")
    batch = s.batch(3).model_copy(update={"next_prompts": nxt})
    got = s.g.submit_rollouts(batch, "k1")
    assert got.accepted_groups == 3 and got.prompts is not None
    assert [p.prompt_id for p in got.prompts.prompts] == ["0-3", "0-4"] and got.prompts_retry_after is None
    st = s.t.status()
    assert (st.queue.groups, st.prompts_inflight) == (3, 2)
    # The leased prompts are the worker's: it submits them as any leased prompt.
    follow = make_batch(s.spec, got.prompts.prompts, 1, worker="gen-0").model_copy(update={"lease_id": s.lease_id})
    assert s.g.submit_rollouts(follow, "k2").accepted_groups == 2
    # JSON too, and a submit that asks for nothing answers prompts null.
    plain = s.g.submit_rollouts(s.batch(1), "k3", use_msgpack=False)
    assert plain.prompts is None
    with_next = s.batch(1).model_copy(update={"next_prompts": nxt.model_copy(update={"request_id": "next-2"})})
    assert [p.prompt_id for p in s.g.submit_rollouts(with_next, "k4", use_msgpack=False).prompts.prompts] == [
        "0-7",
        "0-8",
    ]


def test_a_submit_under_admission_control_is_accepted_and_leases_nothing(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, groups_per_step=4, max_staleness=1)  # at most 4 groups queued or in flight
    nxt = PromptLeaseRequest(worker_id="gen-0", n=2, wait_s=30, request_id="next-1")
    batch = s.batch(4).model_copy(update={"next_prompts": nxt})
    got = s.g.submit_rollouts(batch, "k1")  # wait_s is not honoured: the 202 comes at once
    assert got.accepted_groups == 4 and got.prompts == PromptLease(prompts=[], expires_at=0.0)
    assert got.prompts_retry_after is not None and got.prompts_retry_after > 0
    assert s.t.status().prompts_inflight == 0


def test_an_older_workers_request_sequence_is_answered_as_before(proxy: ProxyHarness) -> None:
    """The bodies a worker at 17e621b sends (none of the folded fields), route by route: version lease, prompt
    lease, submit (packed msgpack), version renew, prompt renew, release, claim (msgpack), ack."""
    s = Setup(proxy, queue_capacity_groups=32, groups_per_step=8)
    run = "/v1/runs/r1"
    with proxy.http("generator") as g, _trainer_http(proxy) as t:
        lease = g.post(f"{run}/leases", json={"worker_id": "gen-9", "ttl_s": 60, "request_id": "v-1"})
        assert lease.status_code == 200 and set(lease.json()) == {"lease_id", "version", "expires_at"}
        leased = g.post(f"{run}/prompts/lease", json={"worker_id": "gen-9", "n": 2, "request_id": "p-1"})
        assert leased.status_code == 200 and [p["prompt_id"] for p in leased.json()["prompts"]] == ["0-0", "0-1"]
        items = PromptLease.model_validate(leased.json()).prompts
        batch = make_batch(s.spec, items, 1, worker="gen-9").model_copy(update={"lease_id": lease.json()["lease_id"]})
        headers = {"Content-Type": "application/msgpack", "Idempotency-Key": "old-1"}
        submitted = g.post(f"{run}/rollouts", content=packed.packb(batch), headers=headers)
        assert submitted.status_code == 202
        answer = SubmitResponse.model_validate(submitted.json())
        assert (answer.accepted_groups, answer.duplicate, answer.prompts) == (2, False, None)
        lease_id = lease.json()["lease_id"]
        assert g.post(f"{run}/leases/{lease_id}/renew", json={"ttl_s": 60}).status_code == 200
        renew = g.post(f"{run}/prompts/renew", json={"worker_id": "gen-9", "prompt_ids": ["0-0"]})
        assert renew.status_code == 410  # submitted: no longer held
        assert g.delete(f"{run}/leases/{lease_id}").status_code == 204
        accept = {"Accept": "application/msgpack, application/json;q=0.5"}
        claimed = t.post(f"{run}/rollouts/claim", json={"consumer": "trainer-0", "max_groups": 8}, headers=accept)
        assert claimed.status_code == 200
        got = ClaimResponse.model_validate(msgpack.unpackb(claimed.content, raw=False))
        assert [d.groups[0] for d in got.deliveries] == batch.groups and got.acked is None
        acked = t.post(f"{run}/rollouts/ack", json={"delivery_ids": [d.delivery_id for d in got.deliveries]})
        assert acked.status_code == 200 and acked.json() == {"acked": 2}
    q = s.t.status().queue
    assert (q.accepted_total, q.acked_total, q.groups, q.pending) == (2, 2, 0, 0)
