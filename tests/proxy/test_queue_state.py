"""The rollout queue's domain logic against a real Redis and both bucket backends (``state/queue.py``).

Covers invariant 4's accounting (accepted == acked + dropped stale + queued/pending), idempotent submit,
validation, staleness at submit and at claim, redelivery after the timeout and after a new trainer
epoch, ack idempotency, and the rebuild after a Redis wipe.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import pytest
import redis.asyncio as aioredis

from bucketrl import errors
from bucketrl.proxy.state import accounting, prompt_lease, prompts, queue, restore, runs, snapshot
from bucketrl.proxy.state import ack as ack_stage
from bucketrl.proxy.state import claim as claim_stage
from bucketrl.proxy.state import submit as submit_stage
from bucketrl.storage import open_store
from bucketrl.storage.base import BucketStore
from bucketrl.wire import ClaimResponse, PromptLeaseItem, RolloutBatch, RunSpec, SamplingSpec
from tests.support.services import RedisServer

RUN = "q-run"


def make_spec(**kw: Any) -> RunSpec:
    base: dict[str, Any] = {
        "base_model": "tiny",
        "reward": {"name": "toy"},
        "dataset": {"uri": "toy:digits", "size": 100},
        "vocab_size": 64,
        "group_size": 2,
        "max_staleness": 1,
        "groups_per_step": 4,
        "queue_capacity_groups": 16,
    }
    base.update(kw)
    return RunSpec.model_validate(base)


def make_batch(spec: RunSpec, items: list[PromptLeaseItem], version: int, worker: str = "g1") -> RolloutBatch:
    groups = [
        {
            "prompt_id": p.prompt_id,
            "prompt_index": p.index,
            "prompt_token_ids": [1, 2, 3],
            "completions": [
                {"token_ids": [4 + c, 5], "logprobs": [-0.5, -1.0], "reward": float(c), "finish_reason": "stop"}
                for c in range(spec.group_size)
            ],
        }
        for p in items
    ]
    return RolloutBatch.model_validate(
        {"worker_id": worker, "lease_id": "lease1", "version": version, "groups": groups}
    )


def run(redis_server: RedisServer, body: Callable[[Any], Awaitable[None]]) -> None:
    async def main() -> None:
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=False)
        try:
            await body(r)
        finally:
            await r.aclose()

    asyncio.run(main())


async def setup_run(r: Any, spec: RunSpec, latest: int = 1) -> int:
    await runs.put_spec(r, RUN, spec)
    await r.hset(f"brl:{RUN}:state", mapping={"latest_version": latest})
    return await runs.register_trainer(r, RUN)


async def lease_and_batch(r: Any, store: BucketStore, spec: RunSpec, n: int, version: int) -> RolloutBatch:
    got = await prompt_lease.lease(r, store, RUN, spec, "g1", n, 60)
    return make_batch(spec, got.prompts, version)


async def claim(
    r: Any, store: BucketStore, spec: RunSpec, epoch: int, n: int = 16, **kw: Any
) -> claim_stage.ClaimOutcome:
    kw.setdefault("wait_s", 0)
    kw.setdefault("redelivery_timeout_s", 60)
    return await claim_stage.claim(r, store, RUN, spec, epoch=epoch, consumer="t", max_groups=n, **kw)


async def assert_accounting(r: Any, spec: RunSpec) -> None:
    st = await accounting.queue_status(r, RUN, spec)
    assert st.accepted_total == st.acked_total + st.dropped_stale_total + st.groups + st.pending, st


def test_submit_claim_ack_idempotent(redis_server: RedisServer, bucket_url: str) -> None:
    store = open_store(bucket_url)
    spec = make_spec()

    async def body(r: Any) -> None:
        epoch = await setup_run(r, spec)
        batch = await lease_and_batch(r, store, spec, 3, version=1)
        first = await submit_stage.submit(r, store, RUN, spec, batch, "key-1")
        assert first.accepted_groups == 3 and not first.duplicate
        key = queue.batch_key(RUN, first.batch_id)
        stored = msgpack.unpackb(store.get_bytes(key), raw=False)
        assert stored["prompt_ids"] == ["0-0", "0-1", "0-2"]
        again = await submit_stage.submit(r, store, RUN, spec, batch, "key-1")
        assert again.duplicate and again.batch_id == first.batch_id
        # The same key reused for other content (a client bug) cannot replace what was enqueued.
        other = batch.model_copy(update={"groups": batch.groups[:1]})
        reused = await submit_stage.submit(r, store, RUN, spec, other, "key-1")
        assert reused.duplicate and reused.batch_id == first.batch_id
        assert store.list_keys(f"runs/{RUN}/rollouts/") == [key]
        st = await accounting.queue_status(r, RUN, spec)
        assert (st.groups, st.pending, st.accepted_total) == (3, 0, 3)
        assert await prompts.prompts_inflight(r, RUN) == 0  # completed by the accept

        got = await claim(r, store, spec, epoch, n=2)
        assert [d.groups[0].prompt_id for d in got.deliveries] == ["0-0", "0-1"]
        assert all(d.attempt == 1 and d.version == 1 and d.worker_id == "g1" for d in got.deliveries)
        assert got.deliveries[0].groups[0].completions[1].token_ids == [5, 5]
        st = await accounting.queue_status(r, RUN, spec)
        assert (st.groups, st.pending) == (1, 2)
        await assert_accounting(r, spec)

        dids = [d.delivery_id for d in got.deliveries]
        assert await ack_stage.ack(r, store, RUN, spec, epoch=epoch, delivery_ids=dids) == 2
        assert await ack_stage.ack(r, store, RUN, spec, epoch=epoch, delivery_ids=dids) == 0  # idempotent
        assert store.exists(key)  # 1 of 3 left; prompts.json records which are settled
        snap = json.loads(snapshot.read_snapshot(store, RUN))
        assert snap["queue"]["live"] == {first.batch_id: {"remaining": 1, "settled": [0, 1]}}
        assert snap["queue"]["counters"]["acked_total"] == 2
        rest = await claim(r, store, spec, epoch)
        assert await ack_stage.ack(r, store, RUN, spec, epoch=epoch, delivery_ids=[rest.deliveries[0].delivery_id]) == 1
        assert not store.exists(key) and not store.exists(queue.marker_key(RUN, first.batch_id))
        st = await accounting.queue_status(r, RUN, spec)
        assert (st.groups, st.pending, st.acked_total, st.accepted_total) == (0, 0, 3, 3)
        # A retry of the acked batch is still a duplicate: nothing is enqueued twice.
        assert (await submit_stage.submit(r, store, RUN, spec, batch, "key-1")).duplicate
        with pytest.raises(errors.Invalid, match=r"delivery_ids\[0\]"):
            await ack_stage.ack(r, store, RUN, spec, epoch=epoch, delivery_ids=["nope"])
        with pytest.raises(errors.Fenced):
            await ack_stage.ack(r, store, RUN, spec, epoch=epoch + 1, delivery_ids=dids)

    run(redis_server, body)


def test_validation_errors_name_the_field_and_change_nothing(redis_server: RedisServer, tmp_path: Any) -> None:
    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec(max_staleness=1)

    async def body(r: Any) -> None:
        await setup_run(r, spec, latest=3)
        good = await lease_and_batch(r, store, spec, 2, version=3)

        def mutate(fn: Callable[[dict[str, Any]], None]) -> RolloutBatch:
            raw = good.model_dump(mode="json")
            fn(raw)
            return RolloutBatch.model_validate(raw)

        cases: list[tuple[Callable[[dict[str, Any]], None], str]] = [
            (lambda b: b["groups"][1]["prompt_token_ids"].__setitem__(2, 64), r"groups\[1\]\.prompt_token_ids\[2\]"),
            (
                lambda b: b["groups"][0]["completions"][1]["token_ids"].__setitem__(0, 999),
                r"groups\[0\]\.completions\[1\]\.token_ids\[0\]",
            ),
            (lambda b: b["groups"][0]["completions"].pop(), r"groups\[0\]\.completions: 1 completions"),
            (lambda b: b["groups"][1].__setitem__("prompt_id", "0-77"), r"groups\[1\]\.prompt_index"),
            (lambda b: b["groups"][1].update(prompt_id="0-50", prompt_index=50), r"never leased"),
            (lambda b: b["groups"][1].update(prompt_id="x", prompt_index=1), r"groups\[1\]\.prompt_id"),
            (lambda b: b["groups"][1].update(prompt_id="0-0", prompt_index=0), r"appears twice"),
            (lambda b: b["groups"][0].update(prompt_id="0-100", prompt_index=100), r"outside the dataset"),
            (lambda b: b.__setitem__("version", 4), r"^version: 4 is newer"),
        ]
        for n, (fn, pattern) in enumerate(cases):
            with pytest.raises(errors.Invalid, match=pattern):
                await submit_stage.submit(r, store, RUN, spec, mutate(fn), f"k-{n}")
        for bad_key in (None, "", "has space", "x" * 201):
            with pytest.raises(errors.Invalid, match="Idempotency-Key"):
                await submit_stage.submit(r, store, RUN, spec, good, bad_key)
        with pytest.raises(errors.Stale):
            await submit_stage.submit(r, store, RUN, spec, mutate(lambda b: b.__setitem__("version", 1)), "k-stale")
        # Nothing was enqueued or written, and the prompts are still leased (not completed).
        st = await accounting.queue_status(r, RUN, spec)
        assert (st.accepted_total, st.groups, st.rejected_stale_total) == (0, 0, 2)
        assert store.list_keys(f"runs/{RUN}/rollouts/") == []
        assert await prompts.prompts_inflight(r, RUN) == 2
        ok = await submit_stage.submit(r, store, RUN, spec, good, "k-good")
        assert ok.accepted_groups == 2

    run(redis_server, body)


def test_backpressure_when_queue_full(redis_server: RedisServer, tmp_path: Any) -> None:
    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec(queue_capacity_groups=4, groups_per_step=2, max_staleness=4)

    async def body(r: Any) -> None:
        await setup_run(r, spec)
        items = (await prompt_lease.lease(r, store, RUN, spec, "g1", 4, 60)).prompts
        await submit_stage.submit(r, store, RUN, spec, make_batch(spec, items[:3], 1), "a")
        with pytest.raises(errors.Backpressure) as exc:
            await submit_stage.submit(r, store, RUN, spec, make_batch(spec, items[3:] + items[:1], 1), "b")
        assert exc.value.retry_after == submit_stage.RETRY_AFTER_S
        st = await accounting.queue_status(r, RUN, spec)
        assert (st.groups, st.backpressure_total) == (3, 1)

    run(redis_server, body)


def test_stale_groups_dropped_at_claim_and_counted(redis_server: RedisServer, bucket_url: str) -> None:
    store = open_store(bucket_url)
    spec = make_spec(max_staleness=1)

    async def body(r: Any) -> None:
        epoch = await setup_run(r, spec, latest=1)
        old = await submit_stage.submit(r, store, RUN, spec, await lease_and_batch(r, store, spec, 2, 1), "old")
        await r.hset(f"brl:{RUN}:state", "latest_version", 2)
        await submit_stage.submit(r, store, RUN, spec, await lease_and_batch(r, store, spec, 1, 2), "new")
        await r.hset(f"brl:{RUN}:state", "latest_version", 3)  # version 1 is now too stale
        got = await claim(r, store, spec, epoch)
        assert got.dropped == 2 and [d.version for d in got.deliveries] == [2]
        st = await accounting.queue_status(r, RUN, spec)
        assert (st.dropped_stale_total, st.pending, st.groups) == (2, 1, 0)
        await assert_accounting(r, spec)
        assert not store.exists(queue.batch_key(RUN, old.batch_id))  # fully settled -> deleted

    run(redis_server, body)


def test_vanished_batch_object_is_counted_lost_not_silently_skipped(redis_server: RedisServer, tmp_path: Any) -> None:
    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec()

    async def body(r: Any) -> None:
        epoch = await setup_run(r, spec)
        gone = await submit_stage.submit(r, store, RUN, spec, await lease_and_batch(r, store, spec, 2, 1), "gone")
        store.delete([queue.batch_key(RUN, gone.batch_id)])  # someone deleted it behind the proxy's back
        got = await claim(r, store, spec, epoch)
        assert got.deliveries == [] and got.lost == 2
        c = await accounting.counters(r, RUN)
        st = await accounting.queue_status(r, RUN, spec)
        assert c["lost_total"] == 2 and st.accepted_total == st.acked_total + c["lost_total"] + st.groups + st.pending

    run(redis_server, body)


def test_no_redelivery_to_the_live_epoch_replay_and_release_and_new_epoch(
    redis_server: RedisServer, tmp_path: Any
) -> None:
    """Issue 10 item 6: a pending delivery is never handed back to the epoch that holds it (the trainer keeps
    trained groups unacked until its checkpoint), however long it idles; a replayed claim (same request id,
    its answer lost) gets the first answer's deliveries; a released one and a new epoch's claim get them."""
    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec()

    async def body(r: Any) -> None:
        epoch = await setup_run(r, spec)
        await submit_stage.submit(r, store, RUN, spec, await lease_and_batch(r, store, spec, 2, 1), "a")
        first = await claim(r, store, spec, epoch, redelivery_timeout_s=0.3, request_id="req-1")
        ids = sorted(d.delivery_id for d in first.deliveries)
        assert len(ids) == 2
        # Idle well past the timeout, long-polled: still not redelivered to the epoch holding them.
        again = await claim(r, store, spec, epoch, redelivery_timeout_s=0.3, wait_s=1.5)
        assert again.deliveries == []
        # The first claim's answer was lost: its retry (same request id) gets the same deliveries, not counted
        # as another delivery attempt.
        replay = await claim(r, store, spec, epoch, redelivery_timeout_s=0.3, request_id="req-1")
        assert sorted(d.delivery_id for d in replay.deliveries) == ids
        assert all(d.attempt == 1 for d in replay.deliveries)
        assert (await claim(r, store, spec, epoch, redelivery_timeout_s=0.3, request_id="req-2")).deliveries == []
        # Given back untrained: claimable again at once.
        back = await claim(r, store, spec, epoch, redelivery_timeout_s=600, release=[ids[0]])
        assert [d.delivery_id for d in back.deliveries] == [ids[0]] and back.deliveries[0].attempt == 2
        with pytest.raises(errors.Invalid, match=r"release\[0\]"):
            await claim(r, store, spec, epoch, release=["nope"])
        # A new trainer registers: every pending delivery is re-claimable at once (long timeout).
        new_epoch = await runs.register_trainer(r, RUN)
        assert await claim_stage.on_trainer_registered(r, RUN, new_epoch, 600)
        with pytest.raises(errors.Fenced):
            await claim(r, store, spec, epoch, redelivery_timeout_s=600)
        third = await claim(r, store, spec, new_epoch, redelivery_timeout_s=600)
        assert sorted(d.delivery_id for d in third.deliveries) == ids
        # Even without the hook (registration on a replica that died), the epoch's first claim does it.
        newest = await runs.register_trainer(r, RUN)
        fourth = await claim(r, store, spec, newest, redelivery_timeout_s=600)
        assert len(fourth.deliveries) == 2
        await assert_accounting(r, spec)

    run(redis_server, body)


def test_redelivery_finds_old_epoch_entries_behind_many_fresh_ones(redis_server: RedisServer, tmp_path: Any) -> None:
    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec(queue_capacity_groups=64, groups_per_step=32)

    async def body(r: Any) -> None:
        epoch = await setup_run(r, spec)
        await submit_stage.submit(r, store, RUN, spec, await lease_and_batch(r, store, spec, 30, 1), "a")
        assert len((await claim(r, store, spec, epoch, n=30, redelivery_timeout_s=0.5)).deliveries) == 30
        epoch = await runs.register_trainer(r, RUN)
        # The 25 oldest come back to the new epoch; the 5 others sit behind them in the pending list.
        assert len((await claim(r, store, spec, epoch, n=25, redelivery_timeout_s=0.5)).deliveries) == 25
        tail = await claim(r, store, spec, epoch, n=1, redelivery_timeout_s=0.5)
        assert [d.groups[0].prompt_id for d in tail.deliveries] == ["0-25"]
        assert len((await claim(r, store, spec, epoch, n=30, redelivery_timeout_s=0.5)).deliveries) == 4

    run(redis_server, body)


def test_claim_long_poll_wakes_on_submit(redis_server: RedisServer, tmp_path: Any) -> None:
    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec()

    async def body(r: Any) -> None:
        epoch = await setup_run(r, spec)
        batch = await lease_and_batch(r, store, spec, 1, 1)

        async def late_submit() -> float:
            await asyncio.sleep(0.3)
            await submit_stage.submit(r, store, RUN, spec, batch, "late")
            return time.monotonic()

        t0 = time.monotonic()
        got, submitted_at = await asyncio.gather(claim(r, store, spec, epoch, wait_s=10), late_submit())
        woke = time.monotonic()
        assert len(got.deliveries) == 1
        # Woken by the submit itself: a re-check every WAIT_SLICE_S (1 s) would take ~0.7 s longer.
        assert woke - t0 < 2.0 and woke - submitted_at < 0.5
        t0 = time.monotonic()
        assert (await claim(r, store, spec, epoch, wait_s=0.3)).deliveries == []
        assert 0.25 < time.monotonic() - t0 < 1.5

    run(redis_server, body)


def test_invariant4_accounting_under_concurrent_mix(redis_server: RedisServer, tmp_path: Any) -> None:
    """Generators submit, a trainer claims/acks, versions advance: every accepted group is exactly one of
    acked / dropped stale / queued-or-pending, and every delivery id was acked at most once."""
    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec(
        dataset={"uri": "toy:digits", "size": 40}, max_staleness=1, groups_per_step=4, queue_capacity_groups=24
    )
    rng = random.Random(7)

    async def body(r: Any) -> None:
        epoch = await setup_run(r, spec, latest=1)
        stop = asyncio.Event()
        acked: list[str] = []

        async def generator(name: str) -> None:
            i = 0
            while not stop.is_set():
                try:
                    got = await prompt_lease.lease(r, store, RUN, spec, name, rng.randint(1, 3), 60)
                except errors.Backpressure:
                    await asyncio.sleep(0.01)
                    continue
                version = int(await r.hget(f"brl:{RUN}:state", "latest_version"))
                await asyncio.sleep(rng.random() * 0.02)
                batch = make_batch(spec, got.prompts, version, worker=name)
                for _ in range(2):  # every submit is retried once: idempotency must absorb it
                    try:
                        await submit_stage.submit(r, store, RUN, spec, batch, f"{name}-{i}")
                    except (errors.Stale, errors.Backpressure):
                        await prompts.release(r, RUN, name, [p.prompt_id for p in got.prompts])
                        break
                i += 1

        async def trainer() -> None:
            for _ in range(25):
                got = await claim(r, store, spec, epoch, n=4, wait_s=0.2)
                if rng.random() < 0.8:
                    ids = [d.delivery_id for d in got.deliveries]
                    await ack_stage.ack(r, store, RUN, spec, epoch=epoch, delivery_ids=ids + ids[:1])
                    acked.extend(ids)
                if rng.random() < 0.5:
                    await r.hincrby(f"brl:{RUN}:state", "latest_version", 1)
                await assert_accounting(r, spec)
            stop.set()

        await asyncio.gather(generator("g1"), generator("g2"), trainer())
        # Finally everything still queued goes stale at once: all of it must be dropped and counted.
        await r.hincrby(f"brl:{RUN}:state", "latest_version", spec.max_staleness + 1)
        before = await accounting.queue_status(r, RUN, spec)
        dropped = 0
        while True:
            got = await claim(r, store, spec, epoch, n=8)
            dropped += got.dropped
            if not got.deliveries and not got.dropped:
                break
        st = await accounting.queue_status(r, RUN, spec)
        await assert_accounting(r, spec)
        assert dropped == before.groups and st.groups == 0
        assert st.dropped_stale_total >= dropped
        assert st.acked_total == len(acked) == len(set(acked)) > 0

    run(redis_server, body)


def test_rebuild_after_wipe_requeues_unacked_only(redis_server: RedisServer, bucket_url: str) -> None:
    store = open_store(bucket_url)
    spec = make_spec(groups_per_step=8)
    state: dict[str, Any] = {}

    async def before(r: Any) -> None:
        epoch = await setup_run(r, spec)
        a = await submit_stage.submit(r, store, RUN, spec, await lease_and_batch(r, store, spec, 3, 1), "a")
        b = await submit_stage.submit(r, store, RUN, spec, await lease_and_batch(r, store, spec, 2, 1), "b")
        got = await claim(r, store, spec, epoch, n=4)  # a:0 a:1 a:2 b:0
        keep = [d.delivery_id for d in got.deliveries]
        # ack all of a and nothing of b; b:0 stays pending (claimed, unacked)
        await ack_stage.ack(r, store, RUN, spec, epoch=epoch, delivery_ids=keep[:3])
        state.update(a=a.batch_id, b=b.batch_id, pending=keep[3])
        c_batch = await lease_and_batch(r, store, spec, 2, 1)
        c = await submit_stage.submit(r, store, RUN, spec, c_batch, "c")
        state["c_batch"] = c_batch
        got_c = await claim(r, store, spec, epoch, n=2)
        await ack_stage.ack(r, store, RUN, spec, epoch=epoch, delivery_ids=[got_c.deliveries[0].delivery_id])
        assert got_c.deliveries[0].delivery_id.startswith(b.batch_id)  # b:1 first (FIFO)
        state["c"] = c.batch_id

    run(redis_server, before)
    redis_server.wipe()
    redis_server.start()

    async def after(r: Any) -> None:
        epoch = await setup_run(r, spec)
        # No explicit rebuild: the first claim on the wiped Redis restores the queue before it answers.
        got = await claim(r, store, spec, epoch)
        assert (await restore.ensure_ready(r, store, RUN, spec))["groups"] == 0  # idempotent
        st = await accounting.queue_status(r, RUN, spec)
        # a: fully acked (deleted). b: b:0 pending + b:1 acked -> only b:0. c: both groups.
        # The lifetime counters continue from the snapshot (issue 10 item 2): 7 accepted over the run, 4 acked.
        assert (st.accepted_total, st.acked_total, st.groups + st.pending) == (7, 4, 3)
        dids = sorted(d.delivery_id for d in got.deliveries)
        assert dids == sorted([state["pending"], f"{state['c']}:0", f"{state['c']}:1"])
        # Retries of accepted batches are duplicates after the rebuild too.
        assert (await submit_stage.submit(r, store, RUN, spec, state["c_batch"], "c")).duplicate
        # The ids a resumed trainer lists in its checkpoint still ack after the rebuild (stable ids).
        assert await ack_stage.ack(r, store, RUN, spec, epoch=epoch, delivery_ids=dids) == 3
        await assert_accounting(r, spec)
        assert store.list_keys(f"runs/{RUN}/rollouts/") == []

    run(redis_server, after)


def test_deliveries_carry_the_sampling_their_batch_was_generated_with(
    redis_server: RedisServer, bucket_url: str
) -> None:
    """A batch records its sampling settings (its own, or the run's at submit): a later change of the run's
    spec cannot change how the trainer recomputes the logprobs of groups sampled before it."""
    store = open_store(bucket_url)
    spec = make_spec()
    own = SamplingSpec(temperature=0.5, top_k=7, top_p=0.8, max_new_tokens=9)

    async def body(r: Any) -> None:
        epoch = await setup_run(r, spec)
        with_own = (await lease_and_batch(r, store, spec, 1, version=1)).model_copy(update={"sampling": own})
        await submit_stage.submit(r, store, RUN, spec, with_own, "k-own")
        without = await lease_and_batch(r, store, spec, 1, version=1)
        await submit_stage.submit(r, store, RUN, spec, without, "k-run")
        # The run's sampling changes after both were accepted.
        changed = spec.model_copy(update={"sampling": SamplingSpec(temperature=2.0)})
        await runs.put_spec(r, RUN, changed)
        got = await claim(r, store, changed, epoch)
        assert [d.sampling for d in got.deliveries] == [own, spec.sampling]
        # The claim answer (spliced from stored JSON) says the same as the models.
        answer = ClaimResponse.model_validate_json(got.response_json())
        assert [d.sampling for d in answer.deliveries] == [own, spec.sampling]

    run(redis_server, body)
