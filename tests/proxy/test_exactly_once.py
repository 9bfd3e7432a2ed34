"""Issue 10 (state half) on real proxies over HTTP: run counters from shared state, the lifetime identity across
a Redis wipe (lost counted from the snapshot), a live trainer keeping its epoch across a wipe, and writes that
race a wipe answered 503 (retry) instead of a non-retryable 409."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bucketrl import errors
from bucketrl.proxy import keys, rebuild
from bucketrl.proxy.state import claim as claim_stage
from bucketrl.proxy.state import prompt_lease, prompts, queue, restore, snapshot
from bucketrl.proxy.state import submit as submit_stage
from bucketrl.proxy.state.locks import WriteLock
from tests.proxy.harness import TOKENS, ProxyHarness, adapter_tar, running
from tests.proxy.test_queue_state import make_batch, run
from tests.proxy.test_rollouts_routes import Setup
from tests.support.services import RedisServer


def _metrics(proxy: ProxyHarness) -> str:
    return httpx.get(f"{proxy.url}/metrics", headers={"Authorization": f"Bearer {TOKENS['viewer']}"}).text


def test_every_replica_reports_the_run_counters_from_shared_state(redis_server: RedisServer, tmp_path: Path) -> None:
    bucket = f"file://{tmp_path / 'bucket'}"
    with running(redis_server.url, bucket) as a, running(redis_server.url, bucket) as b:
        s = Setup(a, groups_per_step=8)
        s.g.submit_rollouts(s.batch(3), "k1")
        got = s.t.claim("trainer-0", max_groups=2)
        s.t.ack([d.delivery_id for d in got.deliveries])
        for replica in (a, b):  # b served none of it: its totals are the run's all the same
            text = _metrics(replica)
            assert 'bucketrl_accepted_groups_total{run="r1"} 3.0' in text
            assert 'bucketrl_acked_groups_total{run="r1"} 2.0' in text
            assert 'bucketrl_lost_groups_total{run="r1"} 0.0' in text
        st = b.client("r1", "viewer").status().queue
        assert (st.accepted_total, st.acked_total, st.lost_total, st.groups) == (3, 2, 0, 1)


def test_lifetime_identity_holds_across_a_wipe_with_a_vanished_batch(
    proxy_file: ProxyHarness, redis_server: RedisServer
) -> None:
    """The snapshot shows batch b live; its object then vanishes (behind the proxy's back) before a wipe: the
    rebuild counts b's groups lost (visible in status and /metrics) and the identity holds exactly."""
    s = Setup(proxy_file, groups_per_step=8)
    a = s.g.submit_rollouts(s.batch(2), "a")
    b = s.g.submit_rollouts(s.batch(3), "b")
    got = s.t.claim("trainer-0", max_groups=2)  # a:0 a:1
    assert s.t.ack([d.delivery_id for d in got.deliveries]) == 2
    assert proxy_file.call(lambda ctx: ctx.cleaner.drain(10.0))
    snap = proxy_file.call(lambda ctx: _snapshot(ctx, "r1"))
    assert snap["queue"]["live"] == {b.batch_id: {"remaining": 3, "settled": []}}
    assert a.batch_id not in snap["queue"]["live"]
    proxy_file.ctx.store.delete([queue.batch_key("r1", b.batch_id)])
    redis_server.wipe()
    redis_server.start()
    assert any(proxy_file.call(rebuild.rebuild_if_wiped) for _ in range(3))
    q = proxy_file.client("r1", "viewer").status().queue
    assert (q.accepted_total, q.acked_total, q.lost_total, q.groups + q.pending) == (5, 2, 3, 0)
    assert q.accepted_total == q.acked_total + q.dropped_stale_total + q.lost_total + q.groups + q.pending
    assert 'bucketrl_lost_groups_total{run="r1"} 3.0' in _metrics(proxy_file)


async def _snapshot(ctx: object, run: str) -> dict:
    raw = snapshot.read_snapshot(ctx.store, run)  # type: ignore[attr-defined]
    assert raw is not None
    return json.loads(raw)


def test_a_live_trainer_keeps_its_epoch_across_a_wipe(proxy_file: ProxyHarness, redis_server: RedisServer) -> None:
    """A trainer that registered (epoch 2) but published nothing yet: after a wipe its writes are neither
    "never issued" nor fenced (the registration is recorded in the bucket); the older trainer stays fenced."""
    s = Setup(proxy_file, groups_per_step=8)
    t2 = proxy_file.client("r1", "trainer")
    assert t2.register_trainer("trainer-1").epoch == 2
    s.g.submit_rollouts(s.batch(2), "a")
    redis_server.wipe()
    redis_server.start()
    assert any(proxy_file.call(rebuild.rebuild_if_wiped) for _ in range(3))
    assert len(t2.claim("trainer-1", max_groups=8).deliveries) == 2
    assert t2.publish_adapter(2, adapter_tar(2)).version == 2
    with pytest.raises(errors.Fenced):
        s.t.claim("trainer-0", max_groups=1)


def test_a_bundle_write_reaching_a_wiped_redis_is_retryable_not_fenced(redis_server: RedisServer) -> None:
    """The write lock's epoch check against a Redis that lost the run (current epoch 0, no state at all) is a
    503 to retry (the retry's run lookup rebuilds), not 409 ``fenced`` (which stops the trainer for good)."""

    async def body(r: Any) -> None:
        lock = WriteLock(r, "r1", "v2", 3, ttl_s=5, expected_next=2)
        with pytest.raises(errors.Unavailable):
            await lock.acquire()
        await r.hset(keys.run_key("r1", keys.STATE), mapping={"trainer_epoch": 4, "latest_version": 1})
        with pytest.raises(errors.Fenced):
            await WriteLock(r, "r1", "v2", 3, ttl_s=5, expected_next=2).acquire()

    run(redis_server, body)


def test_prompt_leases_follow_redis_time_not_a_replicas_clock(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 10: a replica whose clock runs 400 s ahead must not expire another generator's live prompt leases
    (reissuing them), and the holder's renew must still succeed."""
    import time

    from bucketrl.storage import open_store
    from tests.proxy.test_queue_state import RUN, make_spec, setup_run

    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec()
    real_time = time.time

    async def body(r: Any) -> None:
        await setup_run(r, spec)
        held = (await prompt_lease.lease(r, store, RUN, spec, "gen-1", 2, 60)).prompts
        monkeypatch.setattr(time, "time", lambda: real_time() + 400)  # this "replica" is 400 s ahead
        other = (await prompt_lease.lease(r, store, RUN, spec, "gen-2", 2, 60)).prompts
        assert not {p.prompt_id for p in held} & {p.prompt_id for p in other}
        monkeypatch.setattr(time, "time", real_time)
        renewed = await prompts.renew(r, RUN, "gen-1", [p.prompt_id for p in held], 60)
        assert [p.prompt_id for p in renewed.prompts] == [p.prompt_id for p in held]
        assert abs(renewed.expires_at - (real_time() + 60)) < 30  # Redis time, not the skewed clock
        assert await prompts.prompts_inflight(r, RUN) == 4

    run(redis_server, body)


@pytest.mark.timeout(60)  # the old code spun here for ever without yielding
def test_persist_does_not_spin_on_a_finished_write_it_still_sees(redis_server: RedisServer, tmp_path: Path) -> None:
    """Plausible-list item: a finished persist whose done callback has not run yet (awaiting a finished task
    does not yield on Python >= 3.12) must not be waited on forever: the caller writes its own snapshot."""
    import asyncio

    from bucketrl.storage import open_store
    from tests.proxy.test_queue_state import RUN, make_spec, setup_run

    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec()

    async def body(r: Any) -> None:
        await setup_run(r, spec)
        await prompt_lease.lease(r, store, RUN, spec, "g", 2, 60)
        finished: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        finished.set_result((0, 0))  # done, covers nothing, and nobody will ever pop it
        snapshot.persists_running(r)[RUN] = finished
        seq = int(await r.hget(prompts.PromptKeys.of(RUN).meta, "seq"))
        await asyncio.wait_for(snapshot.persist(r, store, RUN, spec, min_seq=seq), 10)
        assert json.loads(snapshot.read_snapshot(store, RUN) or b"{}")["seq"] >= seq

    run(redis_server, body)


def test_a_late_older_snapshot_never_replaces_a_newer_one(redis_server: RedisServer, tmp_path: Path) -> None:
    """Plausible-list item: a slow writer whose lock expired lands an older snapshot after a newer one was
    written; the restore must still read the newer one (each snapshot is its own object, named by its seq)."""
    from bucketrl.storage import open_store
    from tests.proxy.test_queue_state import RUN, make_spec, setup_run

    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec()

    async def body(r: Any) -> None:
        await setup_run(r, spec)
        await prompt_lease.lease(r, store, RUN, spec, "g", 2, 60)
        await snapshot.persist(r, store, RUN, spec, min_seq=1)
        older = snapshot.read_snapshot(store, RUN)
        assert older is not None
        old_seq = json.loads(older)["seq"]
        await prompt_lease.lease(r, store, RUN, spec, "g", 2, 60)
        seq = int(await r.hget(prompts.PromptKeys.of(RUN).meta, "seq"))
        await snapshot.persist(r, store, RUN, spec, min_seq=seq)
        newer = json.loads(snapshot.read_snapshot(store, RUN) or b"{}")
        assert newer["seq"] > old_seq
        # The slow writer's PUT of its (older) snapshot lands now.
        store.put_bytes(snapshot.numbered_snapshot_key(RUN, old_seq), older)
        assert json.loads(snapshot.read_snapshot(store, RUN) or b"{}") == newer

    run(redis_server, body)


def test_a_snapshot_landing_after_a_wipe_never_shadows_the_rebuilt_state(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Plausible-list item, across a wipe: a persist that read the state before a FLUSHALL lands its snapshot after
    the rebuild read an older one. The rebuilt state's later snapshots must still be the newest (they used to be
    numbered from the older snapshot's seq, below the late one's: a restore read the stale pre-wipe state, and the
    late writer's prune deleted the rebuilt ones)."""
    from bucketrl.storage import open_store
    from tests.proxy.test_queue_state import RUN, make_spec, setup_run

    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec(groups_per_step=16, queue_capacity_groups=64)  # admission: room for the leases below
    meta = prompts.PromptKeys.of(RUN).meta

    async def body(r: Any) -> None:
        await setup_run(r, spec)
        await prompt_lease.lease(r, store, RUN, spec, "g", 1, 60)
        await snapshot.persist(r, store, RUN, spec, min_seq=int(await r.hget(meta, "seq")))
        older = {key: store.get_bytes(key) for key in store.list_keys(snapshot.snapshot_prefix(RUN))}
        for _ in range(6):  # changes the older snapshot does not cover
            await prompt_lease.lease(r, store, RUN, spec, "g", 1, 60)
        late_seq = int(await r.hget(meta, "seq"))
        await snapshot.persist(r, store, RUN, spec, min_seq=late_seq)
        late_key = snapshot.numbered_snapshot_key(RUN, late_seq)
        late = store.get_bytes(late_key)
        # When Redis is wiped, that write is still in flight: the bucket holds the older snapshot only.
        store.delete(store.list_keys(snapshot.snapshot_prefix(RUN)))
        for key, raw in older.items():
            store.put_bytes(key, raw)
        await r.flushall()
        await setup_run(r, spec)
        await restore.ensure_ready(r, store, RUN, spec)  # rebuilt from the older snapshot
        store.put_bytes(late_key, late)  # the slow PUT lands now
        await prompt_lease.lease(r, store, RUN, spec, "g", 1, 60)
        seq = int(await r.hget(meta, "seq"))
        await snapshot.persist(r, store, RUN, spec, min_seq=seq)
        newest = json.loads(snapshot.read_snapshot(store, RUN) or b"{}")
        assert newest["seq"] == seq > late_seq, (newest["seq"], seq, late_seq)
        assert store.list_keys(snapshot.snapshot_prefix(RUN)) == [snapshot.numbered_snapshot_key(RUN, seq)]

    run(redis_server, body)


def test_a_claim_whose_bucket_read_failed_hands_the_groups_out_again_to_the_same_epoch(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The claim script handed the groups to the live epoch, then the bucket read failed (503): they must be
    claimable again at once by that same epoch (not held as if it had them)."""
    from bucketrl.storage import open_store
    from tests.proxy.test_queue_state import RUN, lease_and_batch, make_spec, setup_run

    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec()

    class Down:
        def get_bytes(self, key: str) -> bytes:
            raise errors.Unavailable("bucket down")

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

    async def body(r: Any) -> None:
        epoch = await setup_run(r, spec)
        await submit_stage.submit(r, store, RUN, spec, await lease_and_batch(r, store, spec, 2, 1), "a")
        kw: dict[str, Any] = {
            "epoch": epoch,
            "consumer": "t",
            "max_groups": 4,
            "wait_s": 0,
            "redelivery_timeout_s": 600,
        }
        with pytest.raises(errors.Unavailable):
            await claim_stage.claim(r, Down(), RUN, spec, **kw)  # type: ignore[arg-type]
        got = await claim_stage.claim(r, store, RUN, spec, **kw)
        assert len(got.claimed) == 2 and got.lost == 0

    run(redis_server, body)


def _flushall(proxy: ProxyHarness, url: str) -> None:
    """FLUSHALL on the running redis-server (as the chaos test does), then the proxy's rebuild from the bucket."""
    r = redis.Redis.from_url(url)
    try:
        r.flushall()
    finally:
        r.close()
    assert any(proxy.call(rebuild.rebuild_if_wiped) for _ in range(3))


def test_groups_trained_before_a_wipe_are_counted_acked_once_though_dropped_stale_after_it(
    proxy_file: ProxyHarness, redis_server: RedisServer
) -> None:
    """Item 2, exact: the trainer trained a batch's 3 groups; it acked one (in the snapshot), acked one after the
    last snapshot (that ack dies with Redis) and holds one unacked (its checkpoint is not written yet). Redis is
    wiped: the rebuild re-queues the two, the versions move on, and the trainer's next claim drops both as stale.
    The trainer's acks of them (its checkpoint; the one acked before is held and acked again) must count them
    acked, not dropped, exactly once, also across a second wipe between the drop and the ack."""
    s = Setup(proxy_file, groups_per_step=8, max_staleness=1)
    a = s.g.submit_rollouts(s.batch(3), "a")
    got = s.t.claim("trainer-0", max_groups=3)
    ids = [d.delivery_id for d in got.deliveries]
    assert len(ids) == 3
    assert s.t.ack(ids[:1]) == 1
    assert proxy_file.call(lambda ctx: ctx.cleaner.drain(10.0))
    store = proxy_file.ctx.store
    saved = {key: store.get_bytes(key) for key in store.list_keys(snapshot.snapshot_prefix("r1"))}
    assert s.t.ack(ids[1:2]) == 1
    assert proxy_file.call(lambda ctx: ctx.cleaner.drain(10.0))
    # The wipe comes before the snapshot covering the second ack is written: put the older one back.
    store.delete(store.list_keys(snapshot.snapshot_prefix("r1")))
    for key, body in saved.items():
        store.put_bytes(key, body)
    _flushall(proxy_file, redis_server.url)
    q = proxy_file.client("r1", "viewer").status().queue
    assert (q.accepted_total, q.acked_total, q.groups) == (3, 1, 2)  # ids[1] and ids[2] are back in the queue

    s.t.publish_adapter(2, adapter_tar(2))
    s.t.publish_adapter(3, adapter_tar(3))  # v1 < latest 3 - max_staleness 1: both re-queued groups are stale
    claimed = s.t.claim("trainer-0", max_groups=8)
    assert claimed.deliveries == [] and claimed.dropped_stale == 2
    assert sorted(claimed.dropped_rebuilt) == sorted(ids[1:])
    assert proxy_file.call(lambda ctx: ctx.cleaner.drain(10.0))
    _flushall(proxy_file, redis_server.url)  # the drop's record survives a wipe (it is in the snapshot)

    # The trainer trained all three: its checkpoint acks the held one and the unacked one.
    assert s.t.ack(ids[1:]) == 2
    assert s.t.ack(ids) == 0  # idempotent: never counted twice
    q = proxy_file.client("r1", "viewer").status().queue
    assert (q.accepted_total, q.acked_total, q.dropped_stale_total, q.lost_total) == (3, 3, 0, 0), q
    assert q.accepted_total == q.acked_total + q.dropped_stale_total + q.lost_total + q.groups + q.pending
    assert a.accepted_groups == 3


def test_a_rebuilt_group_below_the_floor_is_handed_over_flagged_replayed_and_dropped_once_given_back(
    proxy_file: ProxyHarness, redis_server: RedisServer
) -> None:
    """A claim with ``hold_rebuilt`` (the trainer's) never drops a group a rebuild re-queued: it hands it over
    flagged ``rebuilt_stale`` (only the trainer's ledger knows whether it trained it). A replay of that claim
    answers it flagged again; a new epoch gets it flagged too (its holder died); once given back (``release``:
    never trained) the next claim drops and counts it, and an ack of a held one counts it acked."""
    s = Setup(proxy_file, groups_per_step=8, max_staleness=1)
    s.g.submit_rollouts(s.batch(2), "a")
    _flushall(proxy_file, redis_server.url)  # both groups come back marked re-queued
    s.t.publish_adapter(2, adapter_tar(2))
    s.t.publish_adapter(3, adapter_tar(3))  # v1 < 3 - 1: below the floor
    first = s.t.claim("trainer-0", max_groups=8, request_id="q1", hold_rebuilt=True)
    assert [d.rebuilt_stale for d in first.deliveries] == [True, True] and first.dropped_stale == 0
    again = s.t.claim("trainer-0", max_groups=8, request_id="q1", hold_rebuilt=True)  # the answer was lost
    assert [(d.delivery_id, d.rebuilt_stale) for d in again.deliveries] == [
        (d.delivery_id, True) for d in first.deliveries
    ]
    keep, give = (d.delivery_id for d in first.deliveries)
    t2 = proxy_file.client("r1", "trainer")
    t2.register_trainer("trainer-1")  # the holder died: its successor gets both, still flagged
    passed = t2.claim("trainer-1", max_groups=8, hold_rebuilt=True)
    assert {(d.delivery_id, d.rebuilt_stale) for d in passed.deliveries} == {(keep, True), (give, True)}
    gone = t2.claim("trainer-1", max_groups=8, hold_rebuilt=True, release=[give])  # never trained: given back
    assert (gone.deliveries, gone.dropped_stale, gone.dropped_rebuilt) == ([], 1, [])
    assert t2.ack([keep]) == 1  # trained before the wipe: acked with the next checkpoint
    q = proxy_file.client("r1", "viewer").status().queue
    assert (q.accepted_total, q.acked_total, q.dropped_stale_total, q.groups, q.pending) == (2, 1, 1, 0, 0), q


def test_a_claim_or_ack_reaching_a_wiped_redis_is_retryable_not_fenced(
    proxy_file: ProxyHarness, redis_server: RedisServer
) -> None:
    """The claim and ack scripts check the epoch themselves. After a wipe the queue can be back (restored lazily
    by the claim path) before a rebuild has put the run's epoch back, so the script reads epoch 0. That must be a
    503 to retry, not 409 ``fenced``, which stopped the live trainer for good in the chaos run."""
    import redis

    s = Setup(proxy_file, groups_per_step=8)
    s.g.submit_rollouts(s.batch(2), "a")
    ids = [d.delivery_id for d in s.t.claim("trainer-0", max_groups=1).deliveries]
    raw = redis.Redis.from_url(redis_server.url)
    state = keys.run_key("r1", keys.STATE)
    epoch = raw.hget(state, "trainer_epoch")
    raw.hdel(state, "trainer_epoch")  # the queue is there, the run's epoch not yet
    with pytest.raises(errors.Unavailable):
        s.t.claim("trainer-0", max_groups=1)
    with pytest.raises(errors.Unavailable):
        s.t.ack(ids)
    raw.hset(state, "trainer_epoch", epoch)  # the rebuild put it back: the retries go through
    assert s.t.ack(ids) == 1
    raw.hset(state, "trainer_epoch", 7)  # a real epoch mismatch is still fenced
    with pytest.raises(errors.Fenced):
        s.t.claim("trainer-0", max_groups=1)


def test_prompts_leased_after_the_snapshot_are_accepted_once_across_a_wipe(
    proxy_file: ProxyHarness, redis_server: RedisServer
) -> None:
    """docs/faults.md, FLUSHALL with long calls: prompts leased after the last snapshot come back unleased on the
    reissue list, so gen-a (still generating them) and gen-b (handed them again) both submit. Each prompt is
    accepted once, whichever submits first; the other batch is refused 409 ``repeated`` (never queued, its object
    gone), and the prompts neither submitted (gen-a's older leases, and the one gen-b leaves) are issued again."""
    s = Setup(proxy_file, groups_per_step=8)
    ttl = 1.0
    before = s.g.lease_prompts("gen-a", 2, ttl_s=ttl).prompts  # the first lease writes the snapshot
    after = s.g.lease_prompts("gen-a", 5, ttl_s=ttl).prompts  # inside the reserved range: no snapshot
    _flushall(proxy_file, redis_server.url)
    again = s.g.lease_prompts("gen-b", 5, ttl_s=ttl).prompts
    assert [p.prompt_id for p in again] == [p.prompt_id for p in after]  # reissued, unleased

    def submit(worker: str, items: list[Any], key: str) -> Any:
        b = make_batch(s.spec, items, 1, worker=worker).model_copy(update={"lease_id": s.lease_id})
        return s.g.submit_rollouts(b, key)

    assert submit("gen-a", after[:2], "a1").accepted_groups == 2  # the first holder first
    with pytest.raises(errors.Repeated, match="already completed"):
        submit("gen-b", again[:2], "b1")
    assert submit("gen-b", again[2:4], "b2").accepted_groups == 2  # the second holder first
    with pytest.raises(errors.Repeated, match=after[2].prompt_id):
        submit("gen-a", after[2:4], "a2")
    with pytest.raises(errors.Repeated):  # partly repeated: refused whole (after[4] stays to be issued again)
        submit("gen-a", [after[1], after[4]], "a3")

    q = proxy_file.client("r1", "viewer").status().queue
    assert (q.accepted_total, q.groups) == (4, 4)
    got = s.t.claim("trainer-0", max_groups=16)
    assert sorted(d.groups[0].prompt_id for d in got.deliveries) == sorted(p.prompt_id for p in after[:4])
    r = redis.Redis.from_url(redis_server.url)
    try:
        counters = {k.decode(): int(v) for k, v in r.hgetall("brl:r1:counters").items()}
    finally:
        r.close()
    assert counters.get("prompts_repeated_total", 0) == 0
    assert (counters["rejected_repeated_total"], counters["prompts_refused_repeated_total"]) == (6, 5)
    batches = proxy_file.ctx.store.list_keys(queue.batch_key("r1", ""))
    assert len(batches) == 2  # the refused batches' objects were deleted

    # Nothing lost: gen-a's restored leases and gen-b's last prompt, never submitted, expire and come back.
    time.sleep(ttl + 0.2)
    s.g.lease_prompts("gen-c", 1, ttl_s=ttl)  # a lease returns the expired ones to the reissue list
    r = redis.Redis.from_url(redis_server.url)
    try:
        waiting = {p.decode() for p in r.lrange("brl:r1:prompts:reissue", 0, -1)}
        still_open = {p.decode() for p in r.smembers("brl:r1:prompts:open")}
    finally:
        r.close()
    lost_leases = {before[0].prompt_id, before[1].prompt_id, after[4].prompt_id}
    assert lost_leases <= waiting and lost_leases <= still_open
    assert not {p.prompt_id for p in after[:4]} & (waiting | still_open)  # completed: never issued again
