"""Prompt leases against a real Redis and both bucket backends (``bucketrl.proxy.state.prompts``).

Invariant 5: a leased prompt not completed before its lease expires is issued again (first), completed
ones never again within a pass, and a Redis wipe + restore from ``prompts.json`` skips nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from bucketrl import errors
from bucketrl.proxy.state import accounting, prompt_lease, prompts, runs, snapshot
from bucketrl.proxy.state import claim as claim_stage
from bucketrl.proxy.state import submit as submit_stage
from bucketrl.storage import open_store
from bucketrl.wire import RunSpec
from tests.support.services import RedisServer

RUN = "p-run"


def make_spec(**kw: Any) -> RunSpec:
    base: dict[str, Any] = {
        "base_model": "tiny",
        "reward": {"name": "toy"},
        "dataset": {"uri": "toy:digits", "size": 5},
        "vocab_size": 64,
        "group_size": 2,
        "max_staleness": 2,
        "groups_per_step": 4,
        "queue_capacity_groups": 64,
    }
    base.update(kw)
    return RunSpec.model_validate(base)


def run(redis_server: RedisServer, body: Callable[[Any], Awaitable[None]]) -> None:
    async def main() -> None:
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=False)
        try:
            await body(r)
        finally:
            await r.aclose()

    asyncio.run(main())


def ids(lease: Any) -> list[str]:
    return [p.prompt_id for p in lease.prompts]


def test_lease_order_reissue_first_and_pass_wrap(redis_server: RedisServer, bucket_url: str) -> None:
    store = open_store(bucket_url)
    spec = make_spec()  # limit = min(64, 4 * 2) = 8

    async def body(r: Any) -> None:
        await runs.put_spec(r, RUN, spec)
        a = await prompt_lease.lease(r, store, RUN, spec, "g1", 3, 60)
        assert ids(a) == ["0-0", "0-1", "0-2"]
        assert [(p.pass_, p.index) for p in a.prompts] == [(0, 0), (0, 1), (0, 2)]
        # A short lease expires; its prompt is issued again BEFORE any new position.
        b = await prompt_lease.lease(r, store, RUN, spec, "g2", 2, 0.05)
        assert ids(b) == ["0-3", "0-4"]
        await asyncio.sleep(0.1)
        c = await prompt_lease.lease(r, store, RUN, spec, "g3", 3, 60)
        assert ids(c) == ["0-3", "0-4", "1-0"]  # reissues first, then the cursor wraps into pass 1
        assert await prompts.cursor(r, RUN) == 6
        assert await prompts.prompts_inflight(r, RUN) == 6
        # Release hands work back at the front of the line; only the holder may release.
        assert await prompts.release(r, RUN, "someone-else", ["0-0"]) == 0
        assert await prompts.release(r, RUN, "g1", ["0-1", "0-0"]) == 2
        d = await prompt_lease.lease(r, store, RUN, spec, "g4", 2, 60)
        assert sorted(ids(d)) == ["0-0", "0-1"]
        # The snapshot was written before positions past the reserved mark left the proxy.
        snap = json.loads(snapshot.read_snapshot(store, RUN))
        assert snap["reserved"] >= 6 and snap["dataset_size"] == 5

    run(redis_server, body)


def test_renew_extends_only_own_live_leases(redis_server: RedisServer, tmp_path: Any) -> None:
    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec()

    async def body(r: Any) -> None:
        await runs.put_spec(r, RUN, spec)
        a = await prompt_lease.lease(r, store, RUN, spec, "g1", 2, 1.0)
        renewed = await prompts.renew(r, RUN, "g1", [*ids(a), "9-9"], 60)
        assert ids(renewed) == ids(a) and renewed.expires_at > time.time() + 50
        await asyncio.sleep(max(0.0, a.expires_at - time.time()) + 0.05)  # the original ttl passed
        b = await prompt_lease.lease(r, store, RUN, spec, "g2", 1, 60)
        assert ids(b) == ["0-2"]
        with pytest.raises(errors.Gone):
            await prompts.renew(r, RUN, "g2", ids(a), 60)  # not g2's

    run(redis_server, body)


def test_admission_control_paces_and_partially_grants(redis_server: RedisServer, tmp_path: Any) -> None:
    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec(groups_per_step=2, max_staleness=2, dataset={"uri": "toy:digits", "size": 50})  # limit 4

    async def body(r: Any) -> None:
        await runs.put_spec(r, RUN, spec)
        assert prompts.admission_limit(spec) == 4
        a = await prompt_lease.lease(r, store, RUN, spec, "g1", 3, 60)
        b = await prompt_lease.lease(r, store, RUN, spec, "g1", 3, 60)
        assert len(a.prompts) == 3 and len(b.prompts) == 1  # partial grant up to the limit
        with pytest.raises(errors.Backpressure) as exc:
            await prompt_lease.lease(r, store, RUN, spec, "g1", 1, 60)
        assert exc.value.retry_after and exc.value.retry_after > 0
        assert "admission limit 4" in exc.value.message
        # Queued groups count too: completing two prompts into the queue frees no room...
        await r.hset(f"brl:{RUN}:state", mapping={"latest_version": 1})
        from tests.proxy.test_queue_state import make_batch

        batch = make_batch(spec, [a.prompts[0], a.prompts[1]], version=1)
        await submit_stage.submit(r, store, RUN, spec, batch, "k1")
        with pytest.raises(errors.Backpressure):
            await prompt_lease.lease(r, store, RUN, spec, "g1", 1, 60)
        # ...until the trainer claims them (claimed-unacked groups do not count).
        epoch = await runs.register_trainer(r, RUN)
        got = await claim_stage.claim(
            r, store, RUN, spec, epoch=epoch, consumer="t", max_groups=8, wait_s=0, redelivery_timeout_s=60
        )
        assert len(got.deliveries) == 2
        c = await prompt_lease.lease(r, store, RUN, spec, "g1", 5, 60)
        assert len(c.prompts) == 2
        counts = await accounting.counters(r, RUN)
        assert counts["prompts_backpressure_total"] == 2 and counts["backpressure_total"] == 2

    run(redis_server, body)


def test_restore_after_wipe_skips_nothing_and_repeats_no_completed(redis_server: RedisServer, bucket_url: str) -> None:
    store = open_store(bucket_url)
    spec = make_spec(dataset={"uri": "toy:digits", "size": 1000}, groups_per_step=50, queue_capacity_groups=500)
    from tests.proxy.test_queue_state import make_batch

    async def phase1(r: Any) -> None:
        await runs.put_spec(r, RUN, spec)
        await r.hset(f"brl:{RUN}:state", mapping={"latest_version": 1})
        first = await prompt_lease.lease(r, store, RUN, spec, "g1", 10, 60)  # 0-0..0-9
        await prompt_lease.lease(r, store, RUN, spec, "g1", 5, 0.01)  # 0-10..0-14, expire
        # Complete 0-0..0-3 (batch stays in the bucket: queued, not acked).
        await submit_stage.submit(r, store, RUN, spec, make_batch(spec, first.prompts[:4], version=1), "k1")

    run(redis_server, phase1)
    redis_server.wipe()
    redis_server.start()

    async def phase2(r: Any) -> None:
        await runs.put_spec(r, RUN, spec)
        await r.hset(f"brl:{RUN}:state", mapping={"latest_version": 1})
        # The first lease on the wiped Redis restores the cursor (and the queue) before answering.
        first = await prompt_lease.lease(r, store, RUN, spec, "g2", 1, 60)
        assert ids(first) == ["0-10"]
        assert (await accounting.queue_status(r, RUN, spec)).groups == 4
        await prompts.release(r, RUN, "g2", ids(first))
        # 0-4..0-9 are still under g1's live lease (restored with it): g1 can renew them.
        renewed = await prompts.renew(r, RUN, "g1", [f"0-{i}" for i in range(4, 10)], 60)
        assert len(renewed.prompts) == 6
        issued: list[str] = []
        while True:
            try:
                got = await prompt_lease.lease(r, store, RUN, spec, "g2", 40, 60)
            except errors.Backpressure:
                break
            issued += ids(got)
        assert len(issued) == prompts.admission_limit(spec) - 6 - 4  # 6 leased + 4 queued groups
        positions = [int(p.split("-")[1]) for p in issued]
        # The expired 0-10..0-14 come back first; completed and still-leased ones do not.
        assert positions[:5] == [10, 11, 12, 13, 14]
        assert not {f"0-{i}" for i in range(10)} & set(issued)
        assert len(issued) == len(set(issued))
        assert await prompts.cursor(r, RUN) > 15  # the cursor continued; the dataset did not restart

    run(redis_server, phase2)


def test_pace_grants_only_what_the_trainer_reaches_within_staleness(redis_server: RedisServer, tmp_path: Any) -> None:
    """The pace rule (module docstring): W + granted <= room + (ms - (at - g) - slack) * sync * gps."""
    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec(groups_per_step=2, max_staleness=3, dataset={"uri": "toy:digits", "size": 50})  # limit 6
    assert prompt_lease.PACE_SLACK_VERSIONS == 1

    async def body(r: Any) -> None:
        from tests.proxy.test_queue_state import make_batch

        await runs.put_spec(r, RUN, spec)
        await r.hset(f"brl:{RUN}:state", mapping={"latest_version": 5})
        epoch = await runs.register_trainer(r, RUN)

        async def claim(train_version: int, sync_every: int = 1) -> int:
            got = await claim_stage.claim(
                r, store, RUN, spec, epoch=epoch, consumer="t", max_groups=2, wait_s=0, redelivery_timeout_s=60,
                min_version=train_version - spec.max_staleness, train_version=train_version, sync_every=sync_every,
            )  # fmt: skip
            return len(got.deliveries)

        # Before any claim only the work limit applies.
        first = await prompt_lease.lease(r, store, RUN, spec, "g1", 10, 60, version=1)
        assert len(first.prompts) == 6
        assert await prompts.release(r, RUN, "g1", ids(first)) == 6
        # The trainer waits for the groups of the step it trains with v6 (none queued: room 2 at v6).
        assert await claim(6) == 0
        # g = v5: spare = 3 - (6 - 5) - 1 = 1 step after this one -> 2 + 2 = 4 groups, under the limit of 6.
        a = await prompt_lease.lease(r, store, RUN, spec, "g1", 10, 60, version=5)
        assert len(a.prompts) == 4
        with pytest.raises(prompt_lease.PacedOut) as exc:
            await prompt_lease.lease(r, store, RUN, spec, "g1", 1, 60, version=5)
        assert "max_staleness=3" in exc.value.message and not exc.value.newer_version_exists
        # Without the slack the same caller gets one more step of work: 2 + (3 - 1) * 2 - 4 = 2.
        extra = await prompt_lease.lease(r, store, RUN, spec, "g1", 10, 60, version=5, slack=0)
        assert len(extra.prompts) == 2
        await prompts.release(r, RUN, "g1", ids(extra))
        # An older caller version gets nothing, and learns that a newer version would.
        await prompts.release(r, RUN, "g1", ids(a)[:3])
        with pytest.raises(prompt_lease.PacedOut) as exc:
            await prompt_lease.lease(r, store, RUN, spec, "g2", 1, 60, version=3)
        assert exc.value.newer_version_exists
        # ... except that an empty pipeline always gets a step of work (a run never stalls on the rule), from a
        # caller whose groups can still be trained (v3: 6 - 3 = max_staleness), never from one whose groups could
        # only be dropped (v2).
        await prompts.release(r, RUN, "g1", ids(a)[3:])
        assert await prompts.prompts_inflight(r, RUN) == 0
        with pytest.raises(prompt_lease.PacedOut) as exc:
            await prompt_lease.lease(r, store, RUN, spec, "g2", 10, 60, version=2)
        assert exc.value.newer_version_exists
        live = await prompt_lease.lease(r, store, RUN, spec, "g2", 10, 60, version=3)
        assert len(live.prompts) == spec.groups_per_step
        # No version (or one newer than latest) means the latest: v5, room 4 less the 2 in flight.
        d = await prompt_lease.lease(r, store, RUN, spec, "g3", 10, 60, version=99)
        assert len(d.prompts) == 2
        await prompts.release(r, RUN, "g3", ids(d))
        # The trainer's step fills: the next queued group joins the step after it (v7, room 2).
        await submit_stage.submit(r, store, RUN, spec, make_batch(spec, live.prompts, version=5), "k1")
        assert await claim(6) == 2
        b = await prompt_lease.lease(r, store, RUN, spec, "g1", 10, 60)  # spare = 3 - (7 - 5) - 1 = 0: room 2
        assert len(b.prompts) == 2
        # Publishing a version every 2 steps doubles the steps a version spans.
        await prompts.release(r, RUN, "g1", ids(b))
        assert await claim(7, sync_every=2) == 0  # room 2 at v7, then v8 for two steps
        await r.hset(f"brl:{RUN}:state", mapping={"latest_version": 6})
        c = await prompt_lease.lease(r, store, RUN, spec, "g1", 10, 60, version=6)  # spare 1 -> 2 + 1 * 2 * 2 = 6
        assert len(c.prompts) == 6
        counts = await accounting.counters(r, RUN)
        assert counts["prompts_backpressure_total"] == 3

    run(redis_server, body)


def test_strict_on_policy_grants_only_the_version_the_next_step_trains_with(
    redis_server: RedisServer, tmp_path: Any
) -> None:
    """max_staleness 0: the slack is min(slack, 0) = 0, so every generator holding the version the step being
    filled trains with shares its room; a lease for an older version is refused even into an empty pipeline
    (its groups could only be dropped), until the caller asks with the version the trainer publishes next."""
    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec(groups_per_step=4, max_staleness=0, dataset={"uri": "toy:digits", "size": 50})
    assert (
        prompt_lease.PACE_SLACK_VERSIONS == 1
        and prompt_lease.effective_slack(prompt_lease.PACE_SLACK_VERSIONS, spec) == 0
    )

    async def body(r: Any) -> None:
        from tests.proxy.test_queue_state import make_batch

        await runs.put_spec(r, RUN, spec)
        await r.hset(f"brl:{RUN}:state", mapping={"latest_version": 5})
        epoch = await runs.register_trainer(r, RUN)

        async def claim(train_version: int) -> int:
            got = await claim_stage.claim(
                r, store, RUN, spec, epoch=epoch, consumer="t", max_groups=4, wait_s=0, redelivery_timeout_s=60,
                min_version=train_version, train_version=train_version,
            )  # fmt: skip
            return len(got.deliveries)

        assert await claim(5) == 0  # the trainer waits for the 4 groups of the step it trains with v5
        a = await prompt_lease.lease(r, store, RUN, spec, "g1", 2, 60, version=5)
        b = await prompt_lease.lease(r, store, RUN, spec, "g2", 2, 60, version=5)  # both generators work on the step
        assert (len(a.prompts), len(b.prompts)) == (2, 2)
        with pytest.raises(prompt_lease.PacedOut):  # the step's room is taken
            await prompt_lease.lease(r, store, RUN, spec, "g3", 1, 60, version=5)
        await submit_stage.submit(r, store, RUN, spec, make_batch(spec, a.prompts + b.prompts, version=5), "k1")
        assert await claim(5) == 4
        # The trainer trains that step and claims the next one ahead: it trains with v6, not yet published.
        assert await claim(6) == 0
        assert await prompts.prompts_inflight(r, RUN) == 0
        with pytest.raises(prompt_lease.PacedOut) as exc:  # v5 groups would be dropped: refused, empty pipeline or not
            await prompt_lease.lease(r, store, RUN, spec, "g1", 2, 60, version=5)
        assert not exc.value.newer_version_exists  # the long-poll waits for v6
        await r.hset(f"brl:{RUN}:state", mapping={"latest_version": 6})
        with pytest.raises(prompt_lease.PacedOut) as exc:
            await prompt_lease.lease(r, store, RUN, spec, "g1", 2, 60, version=5)
        assert exc.value.newer_version_exists  # answered at once: ask again with v6
        c = await prompt_lease.lease(r, store, RUN, spec, "g1", 10, 60, version=6)
        assert len(c.prompts) == 4

    run(redis_server, body)


@pytest.mark.alone  # the wait is checked to a tenth of a second
def test_long_polled_lease_is_granted_when_the_trainer_claims(redis_server: RedisServer, tmp_path: Any) -> None:
    """wait_s: a refused lease waits for the run's pipeline announcement (a claim) instead of a 429; a paced-out
    caller with a newer version published is answered at once (Retry-After 0) to ask again with it."""
    from bucketrl.proxy.notify import Notifier

    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec(groups_per_step=2, max_staleness=2, dataset={"uri": "toy:digits", "size": 50})  # limit 4

    async def body(r: Any) -> None:
        from tests.proxy.test_queue_state import make_batch

        notifier = Notifier.from_url(redis_server.url, 5.0)
        notifier.start()
        try:
            await asyncio.wait_for(notifier.subscribed.wait(), 10)
            await runs.put_spec(r, RUN, spec)
            await r.hset(f"brl:{RUN}:state", mapping={"latest_version": 1})
            epoch = await runs.register_trainer(r, RUN)
            full = await prompt_lease.lease(r, store, RUN, spec, "g1", 4, 60)
            await submit_stage.submit(r, store, RUN, spec, make_batch(spec, full.prompts[:2], version=1), "k1")

            t0 = time.monotonic()
            waiting = asyncio.create_task(
                prompt_lease.lease(r, store, RUN, spec, "g2", 4, 60, wait_s=10, notifier=notifier)
            )
            await asyncio.sleep(0.3)
            assert not waiting.done()  # held, not answered 429
            got = await claim_stage.claim(
                r, store, RUN, spec, epoch=epoch, consumer="t", max_groups=2, wait_s=0, redelivery_timeout_s=60
            )
            assert len(got.deliveries) == 2
            lease = await asyncio.wait_for(waiting, 5)
            elapsed = time.monotonic() - t0
            assert len(lease.prompts) == 2 and 0.3 <= lease.waited_s <= elapsed < 3, (lease.waited_s, elapsed)

            # Without an announcement the long-poll ends in a 429 that says: retry now.
            t0 = time.monotonic()
            with pytest.raises(errors.Backpressure) as exc:
                await prompt_lease.lease(r, store, RUN, spec, "g2", 1, 60, wait_s=0.4, notifier=notifier)
            assert exc.value.retry_after == 0 and time.monotonic() - t0 >= 0.4
            # Paced out by the trainer's pace while a newer version than the caller's exists: at once.
            await claim_stage.claim(
                r, store, RUN, spec, epoch=epoch, consumer="t", max_groups=2, wait_s=0, redelivery_timeout_s=60,
                min_version=1, train_version=3,
            )  # fmt: skip
            await r.hset(f"brl:{RUN}:state", mapping={"latest_version": 3})
            await prompts.release(r, RUN, "g1", ids(full)[2:])  # g2's two prompts stay in flight
            t0 = time.monotonic()
            with pytest.raises(prompt_lease.PacedOut) as exc:
                await prompt_lease.lease(r, store, RUN, spec, "g2", 1, 60, version=1, wait_s=10, notifier=notifier)
            assert exc.value.retry_after == 0 and exc.value.newer_version_exists and time.monotonic() - t0 < 2
            # A long-poll's refusals are counted once per request.
            counts = await accounting.counters(r, RUN)
            assert counts["prompts_backpressure_total"] == 2
        finally:
            await notifier.stop()

    run(redis_server, body)
