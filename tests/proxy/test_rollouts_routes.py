"""The rollout routes over real HTTP (uvicorn + real Redis + bucket), through the worker client and raw httpx.

Submit (JSON and msgpack, idempotent), every HTTP error of the route, claim long-poll, redelivery when a
new trainer registers, Redis killed mid-submit (503, retryable, nothing lost), rebuild after a wipe.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import httpx
import msgpack
import pytest

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.proxy import rebuild
from bucketrl.proxy.state import submit as submit_state
from bucketrl.wire import RolloutBatch, RunSpec
from tests.proxy.harness import TOKENS, ProxyHarness, adapter_tar, make_spec
from tests.proxy.test_queue_state import make_batch
from tests.support.services import RedisServer


class Setup:
    """A run with v1 published, a registered trainer and a generator holding a version lease."""

    def __init__(self, proxy: ProxyHarness, run: str = "r1", **spec_kw: Any) -> None:
        self.proxy, self.run = proxy, run
        self.spec: RunSpec = make_spec(**spec_kw)
        self.t = proxy.client(run, "trainer")
        self.g = proxy.client(run, "generator")
        self.t.put_run(self.spec)
        self.t.register_trainer("trainer-0")
        self.t.publish_adapter(1, adapter_tar(1))
        self.lease_id = self.g.lease_version("gen-0").lease_id

    def batch(self, n: int, version: int = 1, worker: str = "gen-0") -> RolloutBatch:
        items = self.g.lease_prompts(worker, n).prompts
        b = make_batch(self.spec, items, version, worker=worker)
        return b.model_copy(update={"lease_id": self.lease_id})

    def path(self, suffix: str) -> str:
        return f"/v1/runs/{self.run}{suffix}"


def test_submit_json_and_msgpack_claim_ack_status_metrics(proxy: ProxyHarness) -> None:
    s = Setup(proxy, queue_capacity_groups=32, groups_per_step=8)
    a, b = s.batch(2), s.batch(1)
    ra = s.g.submit_rollouts(a, "ka", use_msgpack=True)
    rb = s.g.submit_rollouts(b, "kb", use_msgpack=False)
    assert (ra.accepted_groups, rb.accepted_groups, ra.duplicate) == (2, 1, False)
    again = s.g.submit_rollouts(a, "ka", use_msgpack=False)
    assert again.duplicate and again.batch_id == ra.batch_id

    got = s.t.claim("trainer-0", max_groups=8)
    assert [d.groups[0].prompt_id for d in got.deliveries] == ["0-0", "0-1", "0-2"]
    assert got.deliveries[0].groups[0] == a.groups[0]  # bit-exact round trip through msgpack and the bucket
    assert got.dropped_stale == 0
    st = proxy.client(s.run, "viewer").status()
    assert (st.queue.groups, st.queue.pending, st.queue.accepted_total, st.prompts_inflight) == (0, 3, 3, 0)
    assert st.prompt_cursor == 3
    ids = [d.delivery_id for d in got.deliveries]
    assert s.t.ack(ids) == 3 and s.t.ack(ids) == 0
    st = proxy.client(s.run, "viewer").status()
    assert (st.queue.pending, st.queue.acked_total, st.queue.capacity) == (0, 3, 32)
    metrics = httpx.get(f"{proxy.url}/metrics", headers={"Authorization": f"Bearer {TOKENS['viewer']}"}).text
    assert 'bucketrl_accepted_groups_total{run="r1"} 3.0' in metrics
    assert 'bucketrl_queue_depth_groups{run="r1"} 0.0' in metrics


def test_a_submit_answers_the_runs_trained_groups_and_the_workers_share(proxy: ProxyHarness) -> None:
    """What a generator's admission control reads its share of the training from (issue 36): counted at ack, by
    the worker whose batch held the group; a claim's ack counts like POST ack, a second ack not again."""
    s = Setup(proxy, queue_capacity_groups=32, groups_per_step=8)
    first = s.g.submit_rollouts(s.batch(2, worker="gen-0"), "k0")
    assert (first.trained_total, first.worker_trained_total) == (0, 0)
    s.g.submit_rollouts(s.batch(1, worker="gen-1"), "k1")
    got = s.t.claim("trainer-0", max_groups=8)
    ids = [d.delivery_id for d in got.deliveries]
    assert s.t.ack(ids[:2]) == 2 and s.t.ack(ids[:2]) == 0  # gen-0's two
    s.t.claim("trainer-0", max_groups=8, ack=ids[2:])  # gen-1's, acked with the next claim
    mine = s.g.submit_rollouts(s.batch(1, worker="gen-0"), "k2")
    theirs = s.g.submit_rollouts(s.batch(1, worker="gen-1"), "k3")
    assert (mine.trained_total, mine.worker_trained_total) == (3, 2)
    assert (theirs.trained_total, theirs.worker_trained_total) == (3, 1)
    replay = s.g.submit_rollouts(s.batch(1, worker="gen-0"), "k2")  # a duplicate's answer is the first's
    assert replay.duplicate and replay.trained_total is None


def _err(resp: httpx.Response) -> dict[str, Any]:
    return resp.json()["error"]


def test_http_errors_of_submit_claim_ack(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, queue_capacity_groups=4, groups_per_step=2, max_staleness=1)
    good = s.batch(2)
    raw = good.model_dump(mode="json")
    with proxy_file.http("generator") as http:

        def post(body: Any, key: str | None = "k", ctype: str = "application/json") -> httpx.Response:
            headers = {"Content-Type": ctype}
            if key is not None:
                headers["Idempotency-Key"] = key
            content = (
                msgpack.packb(body) if ctype == "application/msgpack" else httpx.Request("POST", "/", json=body).content
            )
            return http.post(s.path("/rollouts"), content=content, headers=headers)

        r = post(raw, key=None)
        assert r.status_code == 422 and "Idempotency-Key" in _err(r)["message"]
        bad = msgpack.unpackb(msgpack.packb(raw))
        bad["groups"][0]["completions"][1]["logprobs"][0] = 0.5
        r = post(bad, ctype="application/msgpack")
        assert r.status_code == 422 and "body.groups.0.completions.1" in _err(r)["message"]
        bad = msgpack.unpackb(msgpack.packb(raw))
        bad["groups"][1]["completions"][0]["token_ids"][1] = 64
        r = post(bad)
        assert r.status_code == 422 and "groups[1].completions[0].token_ids[1]" in _err(r)["message"]
        r = http.post(
            s.path("/rollouts"),
            content=b"\xc1\xc1",
            headers={"Content-Type": "application/msgpack", "Idempotency-Key": "x"},
        )
        assert r.status_code == 422
        with proxy_file.http("viewer") as viewer:
            assert viewer.post(s.path("/rollouts"), json=raw, headers={"Idempotency-Key": "v"}).status_code == 403
        assert http.post("/v1/runs/nope/rollouts", json=raw, headers={"Idempotency-Key": "n"}).status_code == 404

        s.t.publish_adapter(2, adapter_tar(2))
        s.t.publish_adapter(3, adapter_tar(3))
        r = post(raw, key="stale")
        assert r.status_code == 409 and _err(r)["code"] == "stale"
        s.g.release_prompts("gen-0", [g_.prompt_id for g_ in good.groups])
        # The lease on record is for version 1: a batch claiming version 3 under it is refused.
        mismatched = s.batch(1, version=3)
        r = post(mismatched.model_dump(mode="json"), key="f0")
        assert r.status_code == 422 and "lease_id" in _err(r)["message"]
        s.g.release_prompts("gen-0", [mismatched.groups[0].prompt_id])
        for key in ("f1", "f2"):  # a lease no longer on record (released, long expired) is accepted
            fresh = s.batch(1, version=3).model_copy(update={"lease_id": "gone-lease"})
            assert post(fresh.model_dump(mode="json"), key=key).status_code == 202
        with pytest.raises(errors.Backpressure) as exc:
            s.g.lease_prompts("gen-0", 1)  # admission: 2 queued + 0 in flight >= limit 2
        assert exc.value.retry_after is not None and exc.value.retry_after >= 1

    with proxy_file.http("trainer") as http:
        claim = {"consumer": "t", "max_groups": 1}
        assert http.post(s.path("/rollouts/claim"), json=claim).status_code == 422  # no X-Trainer-Epoch
        r = http.post(s.path("/rollouts/claim"), json=claim, headers={"X-Trainer-Epoch": "0"})
        assert r.status_code == 422
        s.t.register_trainer("trainer-1")
        r = http.post(s.path("/rollouts/claim"), json=claim, headers={"X-Trainer-Epoch": "1"})
        assert r.status_code == 409 and _err(r)["code"] == "fenced"
        r = http.post(s.path("/rollouts/ack"), json={"delivery_ids": ["x:1"]}, headers={"X-Trainer-Epoch": "2"})
        assert r.status_code == 422 and "delivery_ids[0]" in _err(r)["message"]
        with proxy_file.http("generator") as gen:
            assert gen.post(s.path("/rollouts/claim"), json=claim, headers={"X-Trainer-Epoch": "2"}).status_code == 403
    st = proxy_file.client(s.run, "viewer").status()
    assert (st.queue.groups, st.queue.rejected_stale_total, st.queue.accepted_total) == (2, 2, 2)


def test_queue_full_is_429_with_retry_after(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, queue_capacity_groups=2, groups_per_step=2, max_staleness=4)
    a = s.batch(2)
    s.g.submit_rollouts(a, "a")
    # Admission control keeps generators from reaching a full queue; a prompt leased earlier can still
    # arrive late, and then the queue's own capacity answers 429.
    b = a.model_copy(update={"groups": a.groups[:1]})
    with proxy_file.http("generator") as http:
        r = http.post(
            s.path("/rollouts"),
            content=b.model_dump_json(),
            headers={"Idempotency-Key": "b", "Content-Type": "application/json"},
        )
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1 and _err(r)["retryable"] is True
    assert proxy_file.client(s.run, "viewer").status().queue.backpressure_total == 1


def test_claim_long_poll_wakes_and_new_trainer_gets_pending_at_once(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, groups_per_step=8)
    batch = s.batch(2)
    result: dict[str, Any] = {}

    def waiter() -> None:
        t0 = time.monotonic()
        result["got"] = s.t.claim("trainer-0", max_groups=8, wait_s=10)
        result["at"] = time.monotonic()
        result["waited"] = result["at"] - t0

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.4)
    submitted = time.monotonic()
    s.g.submit_rollouts(batch, "late")
    th.join(10)
    assert len(result["got"].deliveries) == 2
    assert result["at"] - submitted < 1.0 and result["waited"] < 3.0  # (the wake-up latency: test_queue_state)

    # The trainer dies without acking; a new one registers and gets both at once (timeout is 600 s).
    t2 = proxy_file.client(s.run, "trainer")
    t2.register_trainer("trainer-1")
    again = t2.claim("trainer-1", max_groups=8)
    assert sorted(d.delivery_id for d in again.deliveries) == sorted(d.delivery_id for d in result["got"].deliveries)
    assert all(d.attempt == 2 for d in again.deliveries)
    with pytest.raises(errors.Fenced):
        s.t.ack([d.delivery_id for d in again.deliveries])  # the old trainer is fenced
    assert t2.ack([d.delivery_id for d in again.deliveries]) == 2


def test_claim_min_version_drops_older_groups_and_counts_them(proxy_file: ProxyHarness) -> None:
    """The trainer's floor (``min_version``) drops groups the run's own rule (latest - max_staleness) still
    allows, new and redelivered alike, and counts them exactly like other stale drops: in the answer, the
    run's counters and the Prometheus counter; the accounting keeps holding."""
    s = Setup(proxy_file, queue_capacity_groups=32, groups_per_step=8, max_staleness=4)
    for v in (2, 3):
        s.t.publish_adapter(v, adapter_tar(v))
    sent: dict[int, RolloutBatch] = {}
    for v in (1, 2, 3):  # all within latest 3 - max_staleness 4: none is stale by the run's rule
        lease = s.g.lease_version("gen-0", version=v).lease_id
        sent[v] = s.batch(1, version=v).model_copy(update={"lease_id": lease})
        s.g.submit_rollouts(sent[v], f"k{v}")
    with proxy_file.http("trainer") as http:  # a negative floor is refused and changes nothing
        r = http.post(
            s.path("/rollouts/claim"),
            json={"consumer": "trainer-0", "min_version": -1},
            headers={"X-Trainer-Epoch": str(s.t.epoch)},
        )
        assert r.status_code == 422 and "min_version" in _err(r)["message"]
    assert proxy_file.client(s.run, "viewer").status().queue.groups == 3

    got = s.t.claim("trainer-0", max_groups=1, min_version=2)  # v1 dropped, v2 delivered (oldest first)
    assert got.dropped_stale == 1 and [d.version for d in got.deliveries] == [2]
    # The v2 delivery is not acked; a new trainer epoch makes it re-claimable at once: a higher floor drops it too.
    t2 = proxy_file.client(s.run, "trainer")
    t2.register_trainer("trainer-1")
    again = t2.claim("trainer-1", max_groups=8, min_version=3)
    assert again.dropped_stale == 1 and [d.version for d in again.deliveries] == [3]
    assert t2.ack([d.delivery_id for d in again.deliveries]) == 1

    q = proxy_file.client(s.run, "viewer").status().queue
    assert (q.accepted_total, q.acked_total, q.dropped_stale_total, q.groups, q.pending) == (3, 1, 2, 0, 0)
    metrics = httpx.get(f"{proxy_file.url}/metrics", headers={"Authorization": f"Bearer {TOKENS['viewer']}"}).text
    assert 'bucketrl_stale_dropped_groups_total{run="r1"} 2.0' in metrics


def test_redis_killed_mid_submit_is_503_and_nothing_is_lost(
    proxy_file: ProxyHarness, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A batch whose write Redis lost mid-way keeps its write lock (persisted) until the lock's TTL: 120 s, longer than
    # any object PUT to a real bucket. Its retries wait that out; on a loaded machine the kill often lands mid-write,
    # and the test then took 120 s of waiting. Here the bucket is a local directory (PUTs take milliseconds): 3 s.
    monkeypatch.setattr(submit_state, "SUBMIT_LOCK_TTL_MS", 3000)
    s = Setup(proxy_file, dataset={"uri": "toy:digits", "size": 200}, groups_per_step=64, queue_capacity_groups=256)
    batches = [s.batch(2) for _ in range(24)]
    keys = [uuid.uuid4().hex for _ in batches]
    outcomes: list[str] = ["" for _ in batches]

    def submit(i: int) -> None:
        c = ProxyClient(proxy_file.url, s.run, TOKENS["generator"], retries=0, timeout_s=10)
        try:
            c.submit_rollouts(batches[i], keys[i])
            outcomes[i] = "ok"
        except errors.Unavailable as exc:
            outcomes[i] = "503" if exc.retryable else "bad"
        finally:
            c.close()

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(batches))]
    for i, th in enumerate(threads):
        th.start()
        if i == len(threads) // 3:
            redis_server.kill()  # AOF with fsync always: what Redis acknowledged survives
    for th in threads:
        th.join(30)
    assert "503" in outcomes and "bad" not in outcomes and "" not in outcomes
    redis_server.start()
    # Retries with the same keys (what a generator does): every batch exactly once, none lost.
    g = proxy_file.client(s.run, "generator", retries=5)
    deadline = time.monotonic() + 20  # past the lock's TTL, and past the wait for an earlier attempt (20 s)
    for i, b in enumerate(batches):
        while True:
            try:
                g.submit_rollouts(b, keys[i])
                break
            except errors.Unavailable:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    st = proxy_file.client(s.run, "viewer").status()
    assert st.queue.accepted_total == st.queue.groups == 48
    got = s.t.claim("trainer-0", max_groups=100)
    pids = sorted(d.groups[0].prompt_id for d in got.deliveries)
    assert pids == sorted(g_.prompt_id for b in batches for g_ in b.groups) and len(set(pids)) == 48


def test_rebuild_after_redis_wipe_requeues_unacked(proxy: ProxyHarness, redis_server: RedisServer) -> None:
    s = Setup(proxy, groups_per_step=8)
    s.g.submit_rollouts(s.batch(2), "a")
    s.g.submit_rollouts(s.batch(2), "b")
    got = s.t.claim("trainer-0", max_groups=3)
    s.t.ack([d.delivery_id for d in got.deliveries[:2]])  # batch a acked; b:0 pending, b:1 queued
    # The ack answered after Redis settled batch a; its object leaves the bucket right after (the cleaner).
    assert proxy.call(lambda ctx: ctx.cleaner.drain(10.0))
    redis_server.wipe()
    redis_server.start()
    # (the first call may hit a pooled connection to the dead Redis; the maintenance loop retries the same way)
    assert any(proxy.call(rebuild.rebuild_if_wiped) for _ in range(3))
    t = proxy.client(s.run, "trainer")
    t.register_trainer("trainer-1")
    again = t.claim("trainer-1", max_groups=8)
    assert sorted(d.groups[0].prompt_id for d in again.deliveries) == ["0-2", "0-3"]
    st = proxy.client(s.run, "viewer").status()
    # The lifetime counters survive the wipe (issue 10 item 2): 4 accepted, 2 acked, 2 queued again.
    q = st.queue
    assert st.prompt_cursor >= 4 and (q.accepted_total, q.acked_total, q.groups + q.pending) == (4, 2, 2)
    assert q.accepted_total == q.acked_total + q.dropped_stale_total + q.lost_total + q.groups + q.pending
    nxt = s.g.lease_prompts("gen-0", 1).prompts[0].prompt_id
    assert nxt not in {"0-0", "0-1", "0-2", "0-3"}
