"""Issue 10's replay rule for the folded requests of issue 21: a claim carrying an ack, a submit leasing the next
prompts, a heartbeat renewing leases. Each is sent by the real client whose first answer is lost after the proxy
acted on it (its transport retry replays the request), and again after it completed: the result is that of one
timely request."""

from __future__ import annotations

from bucketrl.proxy.state import workers
from bucketrl.wire import MetricsPush, PromptLeaseRequest
from bucketrl.wire.metrics import Renewals
from tests.proxy.harness import ProxyHarness
from tests.proxy.test_replays_leases import LoseAnswers
from tests.proxy.test_rollouts_routes import Setup


def test_claim_carrying_an_ack_replayed_acks_once_and_gets_the_same_deliveries(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, groups_per_step=8)
    s.g.submit_rollouts(s.batch(2), "k1")
    ids = [d.delivery_id for d in s.t.claim("trainer-0", max_groups=2).deliveries]
    s.g.submit_rollouts(s.batch(3), "k2")
    lose = LoseAnswers("/rollouts/claim")
    c = proxy_file.client("r1", "trainer", retries=3, backoff_s=0.01, transport=lose)
    c.epoch = 1
    got = c.claim("trainer-0", max_groups=8, request_id="claim-2", ack=ids)
    assert lose.sent == 1 and len(got.deliveries) == 3
    assert got.acked == 0  # the lost first attempt acked them: the replay counts 0, as a second ack does
    again = s.t.claim("trainer-0", max_groups=8, request_id="claim-2", ack=ids)  # after completion
    assert [d.delivery_id for d in again.deliveries] == [d.delivery_id for d in got.deliveries] and again.acked == 0
    q = s.t.status().queue
    assert (q.accepted_total, q.acked_total, q.pending, q.groups) == (5, 2, 3, 0)


def test_submit_leasing_the_next_prompts_replayed_leases_them_once(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, groups_per_step=8, max_staleness=2, queue_capacity_groups=32)
    nxt = PromptLeaseRequest(worker_id="gen-0", n=2, request_id="next-1")
    batch = s.batch(3).model_copy(update={"next_prompts": nxt})
    lose = LoseAnswers("/rollouts")
    g = proxy_file.client("r1", "generator", retries=3, backoff_s=0.01, transport=lose)
    first = g.submit_rollouts(batch, "k1")
    assert lose.sent == 1 and first.duplicate and first.accepted_groups == 3
    assert first.prompts is not None and [p.prompt_id for p in first.prompts.prompts] == ["0-3", "0-4"]
    again = s.g.submit_rollouts(batch, "k1")  # after completion
    assert again.duplicate and again.prompts == first.prompts
    st = s.t.status()
    assert (st.queue.accepted_total, st.prompts_inflight) == (3, 2)  # not 2 per attempt
    assert [p.prompt_id for p in s.g.lease_prompts("gen-0", 1).prompts] == ["0-5"]


def test_heartbeat_carrying_renewals_replayed_renews_and_records_once(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, groups_per_step=8)
    held = [p.prompt_id for p in s.g.lease_prompts("gen-0", 2).prompts]
    gone = s.g.lease_version("gen-0").lease_id
    s.g.release_lease(gone)
    renew = Renewals(version_leases=[s.lease_id, gone], version_ttl_s=120, prompt_ids=[*held, "0-9"], prompt_ttl_s=90)
    push = MetricsPush(worker_id="gen-0", metrics={"m": 1.0}, loaded_versions=[1], renew=renew)
    lose = LoseAnswers("/metrics")
    g = proxy_file.client("r1", "generator", retries=3, backoff_s=0.01, transport=lose)
    got = g.push_metrics(push)
    assert lose.sent == 1 and got is not None
    assert got.versions[gone] is None and got.versions[s.lease_id] is not None
    assert got.versions[s.lease_id].version == 1  # type: ignore[union-attr]
    assert got.prompts is not None and [p.prompt_id for p in got.prompts.prompts] == held  # "0-9" is not gen-0's
    numbered = push.model_copy(update={"session": "s1", "seq": 1})
    again = s.g.push_metrics(numbered)  # after completion: renewed again (idempotent), recorded once
    assert again is not None and [p.prompt_id for p in again.prompts.prompts] == held  # type: ignore[union-attr]
    assert s.g.push_metrics(numbered) is not None
    st = s.t.status()
    assert st.prompts_inflight == 2 and {v.version: v.leases for v in st.versions}[1] == 1
    pushes = proxy_file.call(lambda ctx: workers.recent_pushes(ctx.redis, "r1", 50))
    assert len([p for p in pushes if p["worker_id"] == "gen-0"]) == 2  # the lost one and the numbered one
    # Without renewals: 204, as before (None to the caller).
    assert s.g.push_metrics(MetricsPush(worker_id="gen-0")) is None
