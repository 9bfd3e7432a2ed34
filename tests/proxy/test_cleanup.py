"""Settled rollout objects leave the bucket off the request path (``state/cleanup.py``), and never get lost."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterable
from typing import Any

import pytest

from bucketrl import errors
from bucketrl.proxy.state import ack as ack_stage
from bucketrl.proxy.state import cleanup, queue, snapshot
from bucketrl.proxy.state import submit as submit_stage
from bucketrl.storage import open_store
from bucketrl.storage.base import BucketStore
from tests.proxy.test_queue_state import RUN, assert_accounting, claim, lease_and_batch, make_spec, run, setup_run
from tests.support.services import RedisServer


class GatedStore:
    """The real store, whose deletes wait for ``gate`` (or fail while ``broken``)."""

    def __init__(self, inner: BucketStore) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.broken = False
        self.url = inner.url

    def delete(self, keys: Iterable[str]) -> None:
        if self.broken:
            raise errors.Unavailable("bucket down (test)")
        assert self.gate.wait(30)
        self.inner.delete(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def submitted_and_claimed(
    r: Any, store: BucketStore, spec: Any, batches: int, n: int
) -> tuple[int, cleanup.BatchCleaner, list[Any], list[str]]:
    """A run with ``batches`` batches of 2 groups submitted and ``n`` groups claimed: (epoch, a cleaner,
    the submit answers, the claimed delivery ids)."""
    epoch = await setup_run(r, spec)
    cleaner = cleanup.BatchCleaner(r, store)
    subs = [
        await submit_stage.submit(r, store, RUN, spec, await lease_and_batch(r, store, spec, 2, 1), key)
        for key in "ab"[:batches]
    ]
    got = await claim(r, store, spec, epoch, n=n)
    return epoch, cleaner, subs, [d.delivery_id for d in got.deliveries]


def test_ack_answers_before_the_bucket_work_which_then_completes(redis_server: RedisServer, bucket_url: str) -> None:
    store = GatedStore(open_store(bucket_url))
    spec = make_spec(group_size=2)

    async def body(r: Any) -> None:
        epoch, cleaner, (a, b), ids = await submitted_and_claimed(r, store, spec, 2, 3)  # a:0 a:1 b:0
        store.gate.clear()  # the bucket hangs: the ack must still answer
        assert (
            await asyncio.wait_for(
                ack_stage.ack(r, store, RUN, spec, epoch=epoch, delivery_ids=ids, cleaner=cleaner), 5
            )
            == 3
        )
        # Redis settled both (a finished, b in part) at once; the bucket has not been touched yet.
        assert await r.hexists(cleanup.doomed_key(RUN), a.batch_id)
        assert store.exists(queue.batch_key(RUN, a.batch_id))
        assert not await cleaner.drain(0.2)
        store.gate.set()
        assert await cleaner.drain(10)
        assert not store.exists(queue.batch_key(RUN, a.batch_id))
        assert not await r.hexists(cleanup.doomed_key(RUN), a.batch_id)
        # The snapshot written first shows a's prompts completed (the object was their other record), a
        # settled (not live), b's settled group and the counters with all three acks.
        snap = json.loads(snapshot.read_snapshot(store, RUN))
        assert not {"0-0", "0-1"} & set(snap["open"])  # a's prompts, the first two leased
        assert snap["queue"]["live"] == {b.batch_id: {"remaining": 1, "settled": [int(ids[2].rsplit(":", 1)[1])]}}
        assert snap["queue"]["counters"]["acked_total"] == 3
        await assert_accounting(r, spec)

    run(redis_server, body)


def test_the_sweep_finishes_what_a_failed_cleaner_left(redis_server: RedisServer, bucket_url: str) -> None:
    store = GatedStore(open_store(bucket_url))
    spec = make_spec(group_size=2)

    async def body(r: Any) -> None:
        epoch, cleaner, (a,), ids = await submitted_and_claimed(r, store, spec, 1, 2)
        store.broken = True  # the cleaner's delete fails (a proxy dying here leaves the same state)
        await ack_stage.ack(r, store, RUN, spec, epoch=epoch, delivery_ids=ids, cleaner=cleaner)
        assert await cleaner.drain(10)
        assert store.exists(queue.batch_key(RUN, a.batch_id))
        assert await r.hexists(cleanup.doomed_key(RUN), a.batch_id)
        with pytest.raises(errors.Unavailable):  # a sweep while the bucket is still down changes nothing
            await cleanup.sweep(r, store, RUN, spec)
        assert await r.hexists(cleanup.doomed_key(RUN), a.batch_id)

    run(redis_server, body)

    async def later(r: Any) -> None:
        store.broken = False
        assert await cleanup.sweep(r, store, RUN, spec) == 1
        assert store.list_keys(f"runs/{RUN}/rollouts/") == []
        assert await r.hlen(cleanup.doomed_key(RUN)) == 0
        assert await cleanup.sweep(r, store, RUN, spec) == 0  # nothing left: a no-op
        snap = json.loads(snapshot.read_snapshot(store, RUN))
        assert not {"0-0", "0-1"} & set(snap["open"])

    run(redis_server, later)


def test_a_batch_no_longer_finished_in_redis_keeps_its_object(redis_server: RedisServer, bucket_url: str) -> None:
    """The cleaner's deletion of a finished batch can land after a Redis wipe whose rebuild queued the batch's
    groups again (the newest snapshot did not show them settled yet): it must leave that object alone, or the
    re-queued groups are lost (a chaos run counted 104 lost). Redis's ``queue:doomed`` decides."""
    store = open_store(bucket_url)
    spec = make_spec(group_size=2)

    async def body(r: Any) -> None:
        epoch, cleaner, (a,), ids = await submitted_and_claimed(r, store, spec, 1, 2)
        await r.hdel(cleanup.doomed_key(RUN), a.batch_id)  # as after a wipe: nothing says a is finished
        await cleanup.settle_objects(r, store, RUN, spec, [a.batch_id], 0)
        assert store.exists(queue.batch_key(RUN, a.batch_id))
        # Finished for real (the ack records it in queue:doomed): then the object goes.
        await ack_stage.ack(r, store, RUN, spec, epoch=epoch, delivery_ids=ids, cleaner=cleaner)
        assert await cleaner.drain(10)
        assert not store.exists(queue.batch_key(RUN, a.batch_id))

    run(redis_server, body)
