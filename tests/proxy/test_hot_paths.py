"""Guards of the proxy's hot paths (``bench/proxy_load.py``): each shortcut gives exactly what the slow way gave.

- no route or dependency is a plain ``def`` (FastAPI would run it in the thread pool: a hop per request);
- a claim answer spliced from the groups' stored bytes is exact: its JSON byte-identical to
  ``ClaimResponse.model_dump_json()``, its msgpack read back equal, also for batch objects of older formats;
- the C-speed logprob check accepts and refuses exactly what the per-value walk does;
- an ack that settles groups has ``prompts.json`` record them (prompts, settled groups, counters) before the
  batch object is deleted (it must never be the last record of them); concurrent acks share snapshots;
- routes that look their run up only when needed (version leases, rollout submit and ack) answer exactly what
  they answered with ``RunDep``: 404 ``unknown_run``, 410, 409 ``fenced``, a rebuild after a Redis wipe.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from typing import Any

import msgpack
import pytest
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from bucketrl import errors
from bucketrl.proxy.app import create_app
from bucketrl.proxy.settings import ProxySettings
from bucketrl.proxy.state import accounting, prompt_lease, queue, restore, snapshot
from bucketrl.proxy.state import ack as ack_stage
from bucketrl.proxy.state import claim as claim_stage
from bucketrl.proxy.state import submit as submit_stage
from bucketrl.storage import open_store
from bucketrl.storage.base import BucketStore
from bucketrl.wire import ClaimResponse, RolloutBatch, RolloutGroup, RunSpec, packed
from bucketrl.wire.rollouts import Completion, _all_finite_non_positive
from tests.proxy.harness import ProxyHarness
from tests.proxy.test_queue_state import RUN, make_batch, make_spec, run, setup_run
from tests.proxy.test_rollouts_routes import Setup
from tests.support.services import RedisServer


def _dependants(dependant: Dependant) -> list[Dependant]:
    out = [dependant] if dependant.call is not None else []
    for sub in dependant.dependencies:
        out += _dependants(sub)
    return out


def test_every_route_and_dependency_is_async() -> None:
    app = create_app(ProxySettings(tokens="admin:" + "x" * 32))
    sync = {
        f"{route.path} -> {getattr(d.call, '__name__', d.call)}"
        for route in app.routes
        if isinstance(route, APIRoute)
        for d in _dependants(route.dependant)
        if not (d.is_coroutine_callable or d.is_async_gen_callable)  # FastAPI's own test for "await, no thread"
    }
    assert not sync, f"plain def (a thread-pool hop per request): {sorted(sync)}"


def test_fast_logprob_check_agrees_with_the_walk() -> None:
    def walk(values: list[float]) -> bool:
        return all(math.isfinite(v) and v <= 0.0 for v in values)

    rng = random.Random(7)
    specials = [0.0, -0.0, 5e-324, -5e-324, 1e-300, math.inf, -math.inf, math.nan, -1.7e308, 1.0]
    cases = [[-rng.random() * 10 for _ in range(64)] for _ in range(50)]
    for s in specials:
        for _ in range(20):
            values = [-rng.random() * 10 for _ in range(rng.randint(1, 40))]
            values.insert(rng.randrange(len(values) + 1), s)
            cases.append(values)
    cases += [[-1.7e308] * 3, [-1.7e308, -1.7e308, 0.5], [-1e308, -1e308, math.nan]]  # the sum overflows
    for values in cases:
        fast = _all_finite_non_positive(values)
        # Never a false "ok"; a false "bad" only when the sum overflows (then the walk decides, below).
        assert fast == walk(values) or (walk(values) and not math.isfinite(sum(values))), values
        # The model is the contract: it refuses exactly what the walk refuses, naming the first bad entry.
        data = {"token_ids": [1] * len(values), "logprobs": values, "reward": None}
        if walk(values):
            assert Completion.model_validate(data).logprobs == values
        else:
            bad = next(i for i, v in enumerate(values) if not (math.isfinite(v) and v <= 0.0))
            # NaN/infinity is refused by the strict wire config (naming the item), a positive value by the check.
            with pytest.raises(ValueError, match=rf"logprobs(\[{bad}\] = |\.{bad}\n)"):
                Completion.model_validate(data)
    with pytest.raises(ValueError, match="token_ids must be >= 0"):
        Completion.model_validate({"token_ids": [3, -1], "logprobs": [-1.0, -1.0], "reward": 1.0})


def _old_format_object(batch: RolloutBatch, batch_id: str, idem: str, run: str, fmt: int = 1) -> bytes:
    """A batch object as development builds before the packed wire wrote it: format 1 (the batch's own fields) or
    2 (``groups_json``). Never shipped: a proxy refuses them by name."""
    obj: dict[str, Any] = {"format": fmt, "batch_id": batch_id, "idem": idem, "run": run, "accepted_at": time.time()}
    if fmt == 1:
        obj.update(batch.model_dump(mode="json"))
    else:
        obj.update(worker_id=batch.worker_id, lease_id=batch.lease_id, version=batch.version)
        obj.update(prompt_ids=[g.prompt_id for g in batch.groups], sampling=None)
        obj["groups_json"] = [g.model_dump_json().encode() for g in batch.groups]
    return msgpack.packb(obj, use_bin_type=True)


def test_claim_answers_are_the_model_dumps(redis_server: RedisServer, bucket_url: str) -> None:
    """A claim's spliced answers are exact: the JSON byte-identical to ``ClaimResponse.model_dump_json()``, the
    msgpack read back equal (the object holds the submitted msgpack)."""
    store = open_store(bucket_url)
    spec = make_spec(group_size=3, queue_capacity_groups=32, groups_per_step=8)

    async def body(r: Any) -> None:
        epoch = await setup_run(r, spec)
        items = (await prompt_lease.lease(r, store, RUN, spec, "g1", 2, 60)).prompts
        assert len(items) == 2
        rng = random.Random(3)
        raw = make_batch(spec, items[:2], 1, worker="gen-7.a_b").model_dump(mode="json")
        for group in raw["groups"]:
            for c in group["completions"]:  # full-precision floats, an unscorable completion, odd finish reasons
                c["logprobs"] = [-rng.random() * 20 for _ in c["token_ids"]]
            group["completions"][0]["reward"] = None
            group["completions"][1]["finish_reason"] = "length"
        batch = RolloutBatch.model_validate(raw)
        new = await submit_stage.submit(r, store, RUN, spec, batch, "new-format")
        stored = msgpack.unpackb(store.get_bytes(queue.batch_key(RUN, new.batch_id)), raw=False)
        assert stored["format"] == 3 and "groups" not in stored  # the groups are stored once, packed
        assert stored["prompt_ids"] == [items[0].prompt_id, items[1].prompt_id]
        assert [RolloutGroup.model_validate(msgpack.unpackb(g)) for g in stored["groups_msgpack"]] == batch.groups
        assert stored["groups_msgpack"] == [packed.packb(g) for g in batch.groups]
        got = await claim_stage.claim(
            r, store, RUN, spec, epoch=epoch, consumer="t", max_groups=8, wait_s=0, redelivery_timeout_s=60
        )
        assert len(got.claimed) == 2
        assert [d.groups[0] for d in got.deliveries] == batch.groups
        response = ClaimResponse(deliveries=got.deliveries, dropped_stale=got.dropped)
        assert got.response_json() == response.model_dump_json().encode()
        assert json.loads(got.response_json())["deliveries"][0]["worker_id"] == "gen-7.a_b"
        # The msgpack answer: the stored bytes spliced in; read back (lists, as the trainer gets them) it is equal.
        answer = msgpack.unpackb(got.response_msgpack(), raw=False)
        assert isinstance(answer["deliveries"][0]["groups"][0]["completions"][0]["token_ids"], msgpack.ExtType)
        assert ClaimResponse.model_validate(answer) == response
        assert msgpack.unpackb(packed.packb(response)) == answer  # what packing the model whole gives
        empty = claim_stage.ClaimOutcome([], dropped=3)
        assert empty.response_json() == ClaimResponse(deliveries=[], dropped_stale=3).model_dump_json().encode()
        assert ClaimResponse.model_validate(msgpack.unpackb(empty.response_msgpack())) == ClaimResponse(
            deliveries=[], dropped_stale=3
        )

    run(redis_server, body)


def test_rebuild_requeues_the_stored_groups(redis_server: RedisServer, bucket_url: str) -> None:
    """A wiped Redis is rebuilt from the batch objects (header + groups_msgpack): same versions, workers, group
    counts and completed prompts, and the claims answer the stored groups."""
    store = open_store(bucket_url)
    spec = make_spec(group_size=2, queue_capacity_groups=16)
    state: dict[str, Any] = {}

    async def before(r: Any) -> None:
        await setup_run(r, spec)
        items = (await prompt_lease.lease(r, store, RUN, spec, "g1", 4, 60)).prompts
        for name, chunk in (("a", items[:2]), ("b", items[2:])):
            batch = make_batch(spec, chunk, 1, worker=f"gen-{name}")
            accepted = await submit_stage.submit(r, store, RUN, spec, batch, name)
            state[name] = (accepted.batch_id, batch)
        state["ids"] = {i.prompt_id for i in items}

    run(redis_server, before)
    redis_server.wipe()
    redis_server.start()

    async def after(r: Any) -> None:
        epoch = await setup_run(r, spec)
        got = await claim_stage.claim(
            r, store, RUN, spec, epoch=epoch, consumer="t", max_groups=8, wait_s=0, redelivery_timeout_s=60
        )
        by_batch: dict[str, list[Any]] = {}
        for d in got.deliveries:
            by_batch.setdefault(d.delivery_id.rsplit(":", 1)[0], []).append(d)
        for name in ("a", "b"):
            batch_id, batch = state[name]
            assert [d.worker_id for d in by_batch[batch_id]] == [f"gen-{name}"] * len(batch.groups)
            assert [d.version for d in by_batch[batch_id]] == [1] * len(batch.groups)
            assert [d.groups[0] for d in by_batch[batch_id]] == batch.groups
        # Every prompt of every batch counts as completed: none is issued again.
        again = (await prompt_lease.lease(r, store, RUN, spec, "g2", 8, 60)).prompts
        assert not {i.prompt_id for i in again} & state["ids"]

    run(redis_server, after)


@pytest.mark.parametrize("fmt", [1, 2])
def test_objects_of_formats_1_and_2_are_refused_by_name(redis_server: RedisServer, bucket_url: str, fmt: int) -> None:
    """Formats 1-2 were never shipped: a claim of one, and a rebuild that finds one, fail naming the object and its
    format (409) instead of misreading it; the claimed group is handed out again, not lost."""
    store = open_store(bucket_url)
    spec = make_spec(group_size=2, queue_capacity_groups=16)
    state: dict[str, Any] = {}

    async def before(r: Any) -> None:
        epoch = await setup_run(r, spec)
        items = (await prompt_lease.lease(r, store, RUN, spec, "g1", 1, 60)).prompts
        old_batch = make_batch(spec, items, 1)
        old = await submit_stage.submit(r, store, RUN, spec, old_batch, "old")
        key = queue.batch_key(RUN, old.batch_id)
        store.put_bytes(key, _old_format_object(old_batch, old.batch_id, "x", RUN, fmt))
        state["key"] = key
        for _ in range(2):  # the refused claim gave its delivery back: the next one meets it again
            with pytest.raises(queue.UnsupportedBatchObject, match=f"{key} is format {fmt}; this proxy reads format 3"):
                await claim_stage.claim(
                    r, store, RUN, spec, epoch=epoch, consumer="t", max_groups=8, wait_s=0, redelivery_timeout_s=60
                )
        st = await accounting.queue_status(r, RUN, spec)
        assert (st.accepted_total, st.lost_total, st.groups + st.pending) == (1, 0, 1)

    run(redis_server, before)
    redis_server.wipe()
    redis_server.start()

    async def after(r: Any) -> None:
        await setup_run(r, spec)
        with pytest.raises(errors.Conflict, match=f"{state['key']} is format {fmt}"):
            await restore.ensure_ready(r, store, RUN, spec)

    run(redis_server, after)


class CountingStore:
    """The real store, counting the writes of ``prompts.json``."""

    def __init__(self, inner: BucketStore) -> None:
        self.inner = inner
        self.snapshot_writes = 0

    def put_bytes(self, key: str, data: bytes) -> None:
        if key.startswith(snapshot.snapshot_prefix(RUN)):
            self.snapshot_writes += 1
        self.inner.put_bytes(key, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_an_ack_that_settles_persists_one_snapshot_before_the_object_goes(
    redis_server: RedisServer, bucket_url: str
) -> None:
    store = CountingStore(open_store(bucket_url))
    spec = make_spec(group_size=2, queue_capacity_groups=16, groups_per_step=8)

    def newest() -> dict[str, Any]:
        return json.loads(snapshot.read_snapshot(store.inner, RUN))

    async def body(r: Any) -> None:
        epoch = await setup_run(r, spec)

        async def submit_one(item: Any, key: str) -> None:
            await submit_stage.submit(r, store, RUN, spec, make_batch(spec, [item], 1), key)  # type: ignore[arg-type]

        async def claim_ack() -> list[str]:
            got = await claim_stage.claim(
                r, store, RUN, spec, epoch=epoch, consumer="t", max_groups=1, wait_s=0, redelivery_timeout_s=60
            )
            ids = [c.delivery_id for c in got.claimed]
            assert await ack_stage.ack(r, store, RUN, spec, epoch=epoch, delivery_ids=ids) == len(ids)  # type: ignore[arg-type]
            # A replayed ack settles nothing: nothing is written.
            writes = store.snapshot_writes
            assert await ack_stage.ack(r, store, RUN, spec, epoch=epoch, delivery_ids=ids) == 0  # type: ignore[arg-type]
            assert store.snapshot_writes == writes
            return [d.groups[0].prompt_id for d in got.deliveries]

        items = (await prompt_lease.lease(r, store, RUN, spec, "g1", 6, 60)).prompts  # type: ignore[arg-type]
        await submit_one(items[0], "a")
        await submit_one(items[1], "b")
        before = store.snapshot_writes
        # Each ack: the snapshot records it (prompt completed, batch no longer live, acked_total) before the
        # object goes, so a rebuild after a Redis wipe neither re-enqueues nor loses count of it.
        for n, item in enumerate(items[:2], 1):
            assert await claim_ack() == [item.prompt_id]
            assert store.snapshot_writes == before + n
            snap = newest()
            assert item.prompt_id not in snap["open"]
            assert snap["queue"]["counters"]["acked_total"] == n and len(snap["queue"]["live"]) == 2 - n
        assert store.list_keys(f"runs/{RUN}/rollouts/") == []

    run(redis_server, body)


def test_ack_reads_the_spec_only_to_restore_or_persist(redis_server: RedisServer, tmp_path: Any) -> None:
    store = open_store(f"file://{tmp_path / 'b'}")
    spec = make_spec(group_size=2, queue_capacity_groups=16, groups_per_step=8)
    loads: list[int] = []

    async def loader() -> RunSpec:
        loads.append(1)
        return spec

    async def body(r: Any) -> None:
        epoch = await setup_run(r, spec)
        items = (await prompt_lease.lease(r, store, RUN, spec, "g1", 3, 60)).prompts
        for i, item in enumerate(items):
            await submit_stage.submit(r, store, RUN, loader, make_batch(spec, [item], 1), f"k{i}")
        assert loads == []  # the pre-check brought the spec along
        got = await claim_stage.claim(
            r, store, RUN, spec, epoch=epoch, consumer="t", max_groups=3, wait_s=0, redelivery_timeout_s=60
        )
        ids = [c.delivery_id for c in got.claimed]
        assert await ack_stage.ack(r, store, RUN, loader, epoch=epoch, delivery_ids=ids[:1]) == 1
        assert loads == [1]  # an ack that settles persists prompts.json: that needs the spec
        assert await ack_stage.ack(r, store, RUN, loader, epoch=epoch, delivery_ids=ids[:1]) == 0
        assert loads == [1]  # a replay settles nothing: no spec, no write
        assert await ack_stage.ack(r, store, RUN, loader, epoch=epoch, delivery_ids=ids[1:2]) == 1
        assert loads == [1, 1]
        # Redis wiped (the core's rebuild put the run state back): the ack restores the queue from the bucket.
        await r.flushdb()
        await setup_run(r, spec)
        await r.hset(f"brl:{RUN}:state", "trainer_epoch", epoch)
        assert await ack_stage.ack(r, store, RUN, loader, epoch=epoch, delivery_ids=ids[2:]) == 1
        assert len(loads) >= 2
        assert store.list_keys(f"runs/{RUN}/rollouts/") == []

    run(redis_server, body)


def test_lazily_resolved_routes_answer_like_before(proxy_file: ProxyHarness) -> None:
    """Version lease create/release, rollout submit and ack look their run up only when needed; an unknown
    run is still 404 ``unknown_run`` (not 410 or 409), and a refused lease is still what it was."""
    s = Setup(proxy_file, groups_per_step=8)
    batch = s.batch(1)
    epoch = {"X-Trainer-Epoch": "1"}
    with proxy_file.http("admin") as http:
        ghost = "/v1/runs/ghost"
        for method, path, kw in [
            ("POST", f"{ghost}/leases", {"json": {"worker_id": "g", "ttl_s": 5}}),
            ("DELETE", f"{ghost}/leases/abc", {}),
            ("POST", f"{ghost}/rollouts", {"json": batch.model_dump(mode="json"), "headers": {"Idempotency-Key": "k"}}),
            ("POST", f"{ghost}/rollouts/ack", {"json": {"delivery_ids": ["b" + "0" * 32 + ":0"]}, "headers": epoch}),
            ("POST", f"{ghost}/rollouts/ack", {"json": {"delivery_ids": []}, "headers": epoch}),
        ]:
            r = http.request(method, path, **kw)
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_run", (method, path, r.text)
        r = http.delete(s.path("/leases/no-such-lease"))
        assert r.status_code == 410 and r.json()["error"]["code"] == "lease_expired"
        r = http.post(s.path("/leases"), json={"worker_id": "g", "version": 9, "ttl_s": 5})
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_version"
        s.t.register_trainer("trainer-1")  # epoch 2: epoch 1 is fenced, with or without ids
        for ids in ([], ["b" + "0" * 32 + ":0"]):
            r = http.post(s.path("/rollouts/ack"), json={"delivery_ids": ids}, headers=epoch)
            assert r.status_code == 409 and r.json()["error"]["code"] == "fenced", r.text
        r = http.post(s.path("/rollouts/ack"), json={"delivery_ids": []})
        assert r.status_code == 422 and "X-Trainer-Epoch" in r.json()["error"]["message"]
    assert s.g.submit_rollouts(batch, "k").accepted_groups == 1


def test_version_lease_after_a_redis_wipe_rebuilds_first(proxy_file: ProxyHarness, redis_server: RedisServer) -> None:
    s = Setup(proxy_file)
    redis_server.wipe()
    redis_server.start()
    g = proxy_file.client(s.run, "generator", retries=3)
    # The first request on the empty Redis is a lease: refused there, so the run is resolved (rebuilt from
    # the bucket) and the lease granted.
    assert g.lease_version("gen-1").version == 1


def test_concurrent_acks_share_one_prompts_snapshot(redis_server: RedisServer, bucket_url: str) -> None:
    store = CountingStore(open_store(bucket_url))
    spec = make_spec(group_size=2, queue_capacity_groups=32, groups_per_step=16)

    async def body(r: Any) -> None:
        epoch = await setup_run(r, spec)
        items = (await prompt_lease.lease(r, store, RUN, spec, "g1", 12, 60)).prompts  # type: ignore[arg-type]
        for i, item in enumerate(items):
            await submit_stage.submit(r, store, RUN, spec, make_batch(spec, [item], 1), f"k{i}")  # type: ignore[arg-type]
        got = await claim_stage.claim(
            r, store, RUN, spec, epoch=epoch, consumer="t", max_groups=12, wait_s=0, redelivery_timeout_s=60
        )
        before = store.snapshot_writes
        acked = await asyncio.gather(
            *(ack_stage.ack(r, store, RUN, spec, epoch=epoch, delivery_ids=[c.delivery_id]) for c in got.claimed)  # type: ignore[arg-type]
        )
        assert acked == [1] * 12
        # Every ack needs a snapshot newer than its settle: the one being written when the others arrive, then
        # one that covers all of them (group commit), not twelve.
        assert store.snapshot_writes - before <= 2
        snap = json.loads(snapshot.read_snapshot(store.inner, RUN))
        assert snap["queue"]["counters"]["acked_total"] == 12 and snap["queue"]["live"] == {}
        assert not {i.prompt_id for i in items} & set(snap["open"])
        assert store.list_keys(f"runs/{RUN}/rollouts/") == []

    run(redis_server, body)


def test_coalescing_transport_sends_a_pass_in_one_write_in_order() -> None:
    """``bucketrl proxy``'s HTTP protocol (``http_protocol.py``; the CLI tests serve through it for real)."""
    from bucketrl.proxy.http_protocol import WRITE_THROUGH_BYTES, CoalescingTransport

    class Recorder:  # the uvloop transport's write/close surface
        def __init__(self) -> None:
            self.writes: list[bytes] = []
            self.closed = False

        def write(self, data: bytes) -> None:
            self.writes.append(bytes(data))

        def is_closing(self) -> bool:
            return self.closed

        def close(self) -> None:
            self.closed = True

        def get_extra_info(self, name: str) -> str:
            return f"info:{name}"

    async def main() -> None:
        real = Recorder()
        t = CoalescingTransport(real, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"")
        t.write(b'{"ok":1}')
        assert real.writes == []  # gathered until the end of this loop pass
        await asyncio.sleep(0)
        assert real.writes == [b'HTTP/1.1 200 OK\r\n\r\n{"ok":1}']
        big = b"x" * WRITE_THROUGH_BYTES
        t.write(b"head")
        t.write(big)  # large: leaves at once, after what was gathered before it
        assert real.writes[1:] == [b"head" + big]
        t.write(b"last")
        t.close()  # a response written just before close still leaves first
        assert real.writes[2:] == [b"last"] and real.closed
        await asyncio.sleep(0)
        assert len(real.writes) == 3
        assert t.get_extra_info("peername") == "info:peername"  # everything else delegates

    asyncio.run(main())


def test_only_a_serving_app_tunes_the_garbage_collector(redis_server: RedisServer, tmp_path: Any) -> None:
    import gc

    from bucketrl.proxy import runtime

    settings = ProxySettings(
        redis_url=redis_server.url, bucket_url=f"file://{tmp_path / 'b'}", tokens="admin:" + "a" * 32, host="127.0.0.1"
    )
    before = gc.get_threshold()

    async def start_and_stop(serving: bool) -> tuple[int, int]:
        app = create_app(settings, serving=serving)
        async with app.router.lifespan_context(app):
            return gc.get_threshold()[0], gc.get_freeze_count()

    try:
        assert asyncio.run(start_and_stop(False)) == (before[0], gc.get_freeze_count())
        threshold, frozen = asyncio.run(start_and_stop(True))
        assert threshold == runtime.GEN0_THRESHOLD and frozen > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
