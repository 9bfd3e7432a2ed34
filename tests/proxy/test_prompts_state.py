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
from bucketrl.proxy.state import prompts, queue, runs
from bucketrl.storage import open_store
from bucketrl.wire import RunSpec
from tests.support.services import RedisServer

RUN = "p-run"


def make_spec(**kw: Any) -> RunSpec:
    base: dict[str, Any] = {
        "base_model": "tiny",
        "reward": {"name": "toy"},
        "dataset": {"uri": "toy:add", "size": 5},
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
        a = await prompts.lease(r, store, RUN, spec, "g1", 3, 60)
        assert ids(a) == ["0-0", "0-1", "0-2"]
        assert [(p.pass_, p.index) for p in a.prompts] == [(0, 0), (0, 1), (0, 2)]
        # A short lease expires; its prompt is issued again BEFORE any new position.
        b = await prompts.lease(r, store, RUN, spec, "g2", 2, 0.05)
        assert ids(b) == ["0-3", "0-4"]
        await asyncio.sleep(0.1)
        c = await prompts.lease(r, store, RUN, spec, "g3", 3, 60)
        assert ids(c) == ["0-3", "0-4", "1-0"]  # reissues first, then the cursor wraps into pass 1
        assert await prompts.cursor(r, RUN) == 6
        assert await prompts.prompts_inflight(r, RUN) == 6
        # Release hands work back at the front of the line; only the holder may release.
        assert await prompts.release(r, RUN, "someone-else", ["0-0"]) == 0
        assert await prompts.release(r, RUN, "g1", ["0-1", "0-0"]) == 2
        d = await prompts.lease(r, store, RUN, spec, "g4", 2, 60)
        assert sorted(ids(d)) == ["0-0", "0-1"]
        # The snapshot was written before positions past the reserved mark left the proxy.
        snap = json.loads(store.get_bytes(prompts.snapshot_key(RUN)))
        assert snap["reserved"] >= 6 and snap["dataset_size"] == 5

    run(redis_server, body)


def test_renew_extends_only_own_live_leases(redis_server: RedisServer, tmp_path: Any) -> None:
    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec()

    async def body(r: Any) -> None:
        await runs.put_spec(r, RUN, spec)
        a = await prompts.lease(r, store, RUN, spec, "g1", 2, 1.0)
        renewed = await prompts.renew(r, RUN, "g1", [*ids(a), "9-9"], 60)
        assert ids(renewed) == ids(a) and renewed.expires_at > time.time() + 50
        await asyncio.sleep(max(0.0, a.expires_at - time.time()) + 0.05)  # the original ttl passed
        b = await prompts.lease(r, store, RUN, spec, "g2", 1, 60)
        assert ids(b) == ["0-2"]
        with pytest.raises(errors.Gone):
            await prompts.renew(r, RUN, "g2", ids(a), 60)  # not g2's

    run(redis_server, body)


def test_admission_control_paces_and_partially_grants(redis_server: RedisServer, tmp_path: Any) -> None:
    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec(groups_per_step=2, max_staleness=2, dataset={"uri": "toy:add", "size": 50})  # limit 4

    async def body(r: Any) -> None:
        await runs.put_spec(r, RUN, spec)
        assert prompts.admission_limit(spec) == 4
        a = await prompts.lease(r, store, RUN, spec, "g1", 3, 60)
        b = await prompts.lease(r, store, RUN, spec, "g1", 3, 60)
        assert len(a.prompts) == 3 and len(b.prompts) == 1  # partial grant up to the limit
        with pytest.raises(errors.Backpressure) as exc:
            await prompts.lease(r, store, RUN, spec, "g1", 1, 60)
        assert exc.value.retry_after and exc.value.retry_after > 0
        assert "admission limit 4" in exc.value.message
        # Queued groups count too: completing two prompts into the queue frees no room...
        await r.hset(f"brl:{RUN}:state", mapping={"latest_version": 1})
        from tests.proxy.test_queue_state import make_batch

        batch = make_batch(spec, [a.prompts[0], a.prompts[1]], version=1)
        await queue.submit(r, store, RUN, spec, batch, "k1")
        with pytest.raises(errors.Backpressure):
            await prompts.lease(r, store, RUN, spec, "g1", 1, 60)
        # ...until the trainer claims them (claimed-unacked groups do not count).
        epoch = await runs.register_trainer(r, RUN)
        got = await queue.claim(
            r, store, RUN, spec, epoch=epoch, consumer="t", max_groups=8, wait_s=0, redelivery_timeout_s=60
        )
        assert len(got.deliveries) == 2
        c = await prompts.lease(r, store, RUN, spec, "g1", 5, 60)
        assert len(c.prompts) == 2
        counts = await queue.counters(r, RUN)
        assert counts["prompts_backpressure_total"] == 2 and counts["backpressure_total"] == 2

    run(redis_server, body)


def test_restore_after_wipe_skips_nothing_and_repeats_no_completed(redis_server: RedisServer, bucket_url: str) -> None:
    store = open_store(bucket_url)
    spec = make_spec(dataset={"uri": "toy:add", "size": 1000}, groups_per_step=50, queue_capacity_groups=500)
    from tests.proxy.test_queue_state import make_batch

    async def phase1(r: Any) -> None:
        await runs.put_spec(r, RUN, spec)
        await r.hset(f"brl:{RUN}:state", mapping={"latest_version": 1})
        first = await prompts.lease(r, store, RUN, spec, "g1", 10, 60)  # 0-0..0-9
        await prompts.lease(r, store, RUN, spec, "g1", 5, 0.01)  # 0-10..0-14, expire
        # Complete 0-0..0-3 (batch stays in the bucket: queued, not acked).
        await queue.submit(r, store, RUN, spec, make_batch(spec, first.prompts[:4], version=1), "k1")

    run(redis_server, phase1)
    redis_server.wipe()
    redis_server.start()

    async def phase2(r: Any) -> None:
        await runs.put_spec(r, RUN, spec)
        await r.hset(f"brl:{RUN}:state", mapping={"latest_version": 1})
        # The first lease on the wiped Redis restores the cursor (and the queue) before answering.
        first = await prompts.lease(r, store, RUN, spec, "g2", 1, 60)
        assert ids(first) == ["0-10"]
        assert (await queue.queue_status(r, RUN, spec)).groups == 4
        await prompts.release(r, RUN, "g2", ids(first))
        # 0-4..0-9 are still under g1's live lease (restored with it): g1 can renew them.
        renewed = await prompts.renew(r, RUN, "g1", [f"0-{i}" for i in range(4, 10)], 60)
        assert len(renewed.prompts) == 6
        issued: list[str] = []
        while True:
            try:
                got = await prompts.lease(r, store, RUN, spec, "g2", 40, 60)
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
