"""Issue 10 items 6-9: every write route replayed gives the same result as one timely delivery.

Each route's request is sent by the real client with a timeout shorter than the (slowed) bucket write, so
its transport retry replays the request while the first attempt is still running (concurrently); then the
same request is sent again after both finished. The bucket is the real file store, slowed by a wrapper
(the only stand-in: a slow disk or S3 cannot be ordered up here). Submit's lost-object race (item 8) is
ordered step by step against the queue functions instead, since its interleaving cannot be forced over HTTP.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from bucketrl import errors
from bucketrl.proxy.state import accounting, checkpoints, prompts, queue
from bucketrl.proxy.state import claim as claim_stage
from bucketrl.proxy.state import submit as submit_stage
from bucketrl.storage import open_store
from bucketrl.storage.base import BucketStore
from tests.proxy.harness import ProxyHarness, adapter_tar, checkpoint_tar
from tests.proxy.test_queue_state import RUN, lease_and_batch, make_spec, run, setup_run
from tests.proxy.test_rollouts_routes import Setup
from tests.support.services import RedisServer

SLOW_S = 1.5
CLIENT_TIMEOUT_S = 0.5


class SlowStore:
    """The real store; the writes that end an operation (a bundle's manifest, a batch object) and, when asked,
    the first ``slow_reads`` reads take ``slow_s`` longer. Records every write and deletion in order, so a test
    can see whether a committed object was deleted."""

    def __init__(
        self,
        inner: BucketStore,
        *,
        slow_writes: bool = True,
        slow_reads: int = 0,
        slow_s: float = SLOW_S,
        slow_keys: tuple[str, ...] = ("/manifest.json", "/rollouts/", "/prompts/"),
    ) -> None:
        self.inner, self.slow_writes, self.slow_reads, self.slow_s = inner, slow_writes, slow_reads, slow_s
        self.slow_keys = slow_keys  # the writes slowed: keys holding one of these
        self.slowing = threading.Event()  # set once a write is being slowed
        self.log: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def _write_delay(self, key: str) -> None:
        if self.slow_writes and any(part in key for part in self.slow_keys):
            self.slowing.set()
            time.sleep(self.slow_s)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._write_delay(key)
        self.inner.put_bytes(key, data)
        self.log.append(("put", key))

    def put_file(self, key: str, fileobj: BinaryIO, size: int | None = None) -> None:
        self._write_delay(key)
        self.inner.put_file(key, fileobj, size)
        self.log.append(("put", key))

    def get_bytes(self, key: str) -> bytes:
        with self._lock:
            slow, self.slow_reads = self.slow_reads > 0, max(0, self.slow_reads - 1)
        if slow:
            time.sleep(self.slow_s)
        return self.inner.get_bytes(key)

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self.log += [("delete", k) for k in keys]
        self.inner.delete(keys)

    def delete_prefix(self, prefix: str) -> int:
        self.log.append(("delete", prefix))
        return self.inner.delete_prefix(prefix)

    def after_commit(self, prefix: str) -> list[tuple[str, str]]:
        """What happened under ``prefix`` after its first manifest write (the commit)."""
        manifest = (("put", f"{prefix}/manifest.json"),)
        first = next(i for i, e in enumerate(self.log) if e in manifest)
        return [e for e in self.log[first + 1 :] if e[1].startswith(prefix)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _slow(proxy: ProxyHarness, **kw: Any) -> SlowStore:
    """Slow the proxy's bucket from now on (its cleaner keeps the real one: acks answer before it works)."""
    slow = SlowStore(proxy.ctx.store, **kw)
    proxy.ctx.store = slow  # type: ignore[assignment]
    return slow


def _impatient(proxy: ProxyHarness, role: str, epoch: int | None = None, timeout_s: float = CLIENT_TIMEOUT_S) -> Any:
    """A client whose timeout is shorter than the slowed bucket: its transport retries replay the request."""
    c = proxy.client("r1", role, timeout_s=timeout_s, retries=20, backoff_s=0.05)
    c.epoch = epoch
    return c


def test_checkpoint_put_replayed_never_deletes_the_committed_step(proxy_file: ProxyHarness) -> None:
    """Item 7: the retry waited for the step lock while its first attempt committed; it must answer that
    commit, not take the committed files for leftovers and delete them. And a 200 only when the files exist."""
    s = Setup(proxy_file)
    tar = checkpoint_tar(b"step-2")
    slow = _slow(proxy_file)
    info = _impatient(proxy_file, "trainer", epoch=1).put_checkpoint(2, tar)
    assert slow.after_commit(checkpoints.checkpoint_prefix("r1", 2)) == []  # not deleted, not rewritten
    slow.slow_writes = False
    assert s.t.put_checkpoint(2, tar) == info  # after completion: the same answer
    assert s.t.download_checkpoint(2) == tar and s.t.latest_checkpoint() == info
    # The files vanish behind the proxy's back: a PUT of the same bytes writes them again (no 200 from the
    # index alone: the trainer acks deliveries on that answer).
    proxy_file.ctx.store.inner.delete_prefix(checkpoints.checkpoint_prefix("r1", 2) + "/")  # type: ignore[attr-defined]
    s.t.put_checkpoint(2, tar)
    assert s.t.download_checkpoint(2) == tar


def test_adapter_publish_replayed_answers_the_commit(proxy_file: ProxyHarness) -> None:
    """Item 9: the retry passed the route's checks, waited for the lock, and found the version committed by
    its first attempt: 200 with that version, not a non-retryable 409 version_conflict."""
    s = Setup(proxy_file)
    _slow(proxy_file, slow_s=3.0)
    # The first attempt's commit takes about 3 s; the client gives up on it after 2 s and its retry waits for the
    # version's lock, then answers within its own 2 s: that answer is the one the client sees.
    info = _impatient(proxy_file, "trainer", epoch=1, timeout_s=2.0).publish_adapter(2, adapter_tar(2))
    assert info.version == 2
    proxy_file.ctx.store.slow_writes = False  # type: ignore[attr-defined]
    assert s.t.publish_adapter(2, adapter_tar(2)) == info
    assert s.t.get_run().state.latest_version == 2
    with pytest.raises(errors.Conflict) as exc:  # other bytes for the committed version: still a conflict
        s.t.publish_adapter(2, adapter_tar(3))
    assert exc.value.code == "version_conflict" and not exc.value.retryable


def test_claim_replayed_gets_the_same_deliveries(proxy_file: ProxyHarness) -> None:
    """Item 6 and "a claim answer lost after the script ran": the first attempt's script handed the groups to
    the epoch and its answer was lost (the bucket read outlasted the client): the retry, same request id, gets
    those deliveries (they are never redelivered to the live epoch otherwise)."""
    s = Setup(proxy_file, groups_per_step=8)
    s.g.submit_rollouts(s.batch(3), "a")
    _slow(proxy_file, slow_writes=False, slow_reads=1)
    got = _impatient(proxy_file, "trainer", epoch=1).claim("trainer-0", max_groups=8, request_id="claim-1")
    assert len(got.deliveries) == 3 and all(d.attempt == 1 for d in got.deliveries)
    again = s.t.claim("trainer-0", max_groups=8, request_id="claim-1")  # after completion
    assert [d.delivery_id for d in again.deliveries] == [d.delivery_id for d in got.deliveries]
    assert s.t.claim("trainer-0", max_groups=8, request_id="claim-2").deliveries == []
    q = s.t.status().queue
    assert (q.pending, q.groups) == (3, 0)


def test_submit_and_ack_replayed_count_once(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, groups_per_step=8)
    batch = s.batch(3)
    _slow(proxy_file)
    first = _impatient(proxy_file, "generator").submit_rollouts(batch, "k1")
    proxy_file.ctx.store.slow_writes = False  # type: ignore[attr-defined]
    again = s.g.submit_rollouts(batch, "k1")
    assert again.duplicate and again.batch_id == first.batch_id
    ids = [d.delivery_id for d in s.t.claim("trainer-0", max_groups=8).deliveries]
    proxy_file.ctx.store.slow_writes = True  # type: ignore[attr-defined]
    assert _impatient(proxy_file, "trainer", epoch=1).ack(ids) == 3
    assert s.t.ack(ids) == 0
    assert proxy_file.call(lambda ctx: ctx.cleaner.drain(30.0))
    q = s.t.status().queue
    assert (q.accepted_total, q.acked_total, q.lost_total, q.groups, q.pending) == (3, 3, 0, 0, 0)


def test_prompt_lease_replayed_gets_the_same_prompts(proxy_file: ProxyHarness) -> None:
    """The first lease of a run writes the prompt snapshot before it answers (slowed here past the client's
    timeout): its retries, same request id, answer the prompts it leased instead of leasing more."""
    s = Setup(proxy_file, groups_per_step=8)
    _slow(proxy_file)
    g = _impatient(proxy_file, "generator")
    got = g.lease_prompts("gen-0", 3, request_id="lease-1")
    assert len(got.prompts) == 3
    proxy_file.ctx.store.slow_writes = False  # type: ignore[attr-defined]
    again = s.g.lease_prompts("gen-0", 3, request_id="lease-1")  # after completion
    assert again.prompts == got.prompts and abs(again.expires_at - got.expires_at) < 1e-3
    assert s.t.status().prompts_inflight == 3  # not 3 per attempt
    assert [p.prompt_id for p in s.g.lease_prompts("gen-0", 2, request_id="lease-2").prompts] == ["0-3", "0-4"]


class GatedStore:
    """The real store; puts of one worker's batch objects and deletes wait for the test to open their gate."""

    def __init__(self, inner: BucketStore, worker: bytes) -> None:
        self.inner, self.worker = inner, worker
        self.put_gates = [threading.Event(), threading.Event()]
        self.puts_waiting = 0
        self.delete_gate = threading.Event()
        self.delete_waiting = threading.Event()

    def put_bytes(self, key: str, data: bytes) -> None:
        if "/rollouts/" in key and self.worker in data:
            gate = self.put_gates[self.puts_waiting]
            self.puts_waiting += 1
            gate.wait(30)
        self.inner.put_bytes(key, data)

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if any("/rollouts/" in k for k in keys):
            self.delete_waiting.set()
            self.delete_gate.wait(30)
        self.inner.delete(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _until(predicate: Any, *tasks: asyncio.Task[Any], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for t in tasks:
            if t.done():
                t.result()  # raises what the task raised
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_refused_submit_attempt_never_deletes_the_object_its_retry_enqueued(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Item 8, ordered: attempt A writes the batch object, finds the queue filled meanwhile (refused) and goes to
    delete it; its retry B (same key, same batch, so the same object key) is accepted after a claim made room.
    A's delete must not remove what B enqueued (it used to: the claim then counted B's groups lost)."""
    store = GatedStore(open_store(f"file://{tmp_path / 'b'}"), b"gen-x")
    spec = make_spec(queue_capacity_groups=4, groups_per_step=4)

    async def body(r: Any) -> None:
        epoch = await setup_run(r, spec)
        x = await lease_and_batch(r, store, spec, 2, 1)  # type: ignore[arg-type]
        x = x.model_copy(update={"worker_id": "gen-x"})
        # Its prompts leave the in-flight count (admission control would otherwise keep the filler below capacity
        # - 2) but stay open and off the reissue list: the filler must not be handed them (x would then repeat
        # prompts the filler completed, and be refused 409 repeated).
        k = prompts.PromptKeys.of(RUN)
        await r.zrem(k.inflight, *(g.prompt_id for g in x.groups))
        a = asyncio.create_task(submit_stage.submit(r, store, RUN, spec, x, "kx"))  # type: ignore[arg-type]
        await _until(lambda: store.puts_waiting == 1, a)  # A passed its checks and writes
        b = asyncio.create_task(submit_stage.submit(r, store, RUN, spec, x, "kx"))  # type: ignore[arg-type]
        await asyncio.sleep(0.3)  # B passed its checks too (and writes, or waits for A's attempt)
        filler = await lease_and_batch(r, store, spec, 4, 1)  # type: ignore[arg-type]
        await submit_stage.submit(r, store, RUN, spec, filler, "kf")  # type: ignore[arg-type]  # the queue is full
        store.put_gates[0].set()  # A's write lands: refused (full), A goes to delete its object
        await _until(store.delete_waiting.is_set)
        got = await claim_stage.claim(
            r, store, RUN, spec, epoch=epoch, consumer="t", max_groups=4, wait_s=0, redelivery_timeout_s=60
        )  # type: ignore[arg-type]
        assert len(got.claimed) == 4  # room for B
        store.put_gates[1].set()
        await asyncio.sleep(0.3)  # (the old code enqueued B here, before A's delete)
        store.delete_gate.set()
        with pytest.raises(errors.Backpressure):
            await a
        accepted = await b
        assert accepted.accepted_groups == 2 and not accepted.duplicate
        assert store.inner.exists(queue.batch_key(RUN, accepted.batch_id))
        mine = await claim_stage.claim(
            r, store, RUN, spec, epoch=epoch, consumer="t", max_groups=4, wait_s=0, redelivery_timeout_s=60
        )  # type: ignore[arg-type]
        assert len(mine.claimed) == 2 and mine.lost == 0
        st = await accounting.queue_status(r, RUN, spec)
        assert st.lost_total == 0 and st.accepted_total == 6

    run(redis_server, body)
