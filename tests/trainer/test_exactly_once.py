"""Issue 10 items 1, 2 and 6 on the real trainer: a Redis ``FLUSHALL`` at a step that is not a checkpoint step
while a real ``TrainerWorker`` (tiny model, in this process) trains from a real proxy fed by a fake generator.

The rebuild re-queues every group trained since the last checkpoint (unacked until that checkpoint); the
trainer must hold those repeats and ack them with its next checkpoint, never train them twice, and the
proxy's lifetime counters must continue from the bucket so that ``accepted = acked + dropped + lost +
queued + pending`` holds over the whole run, with nothing lost.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from bucketrl.proxy.state import snapshot
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.trainer.worker import EXIT_OK, TrainerWorker
from tests.proxy.harness import TOKENS, running
from tests.support.services import RedisServer
from tests.trainer.fake_generator import FakeGenerator, wait_until
from tests.trainer.test_worker import spec_json


class _WipingWorker(TrainerWorker):
    """The real worker; after step ``wipe_after`` (not a checkpoint step) Redis loses everything."""

    def __init__(self, *args: Any, redis_url: str, wipe_after: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.redis_url, self.wipe_after = redis_url, wipe_after
        self.before_wipe: dict[str, int] = {}
        self.trained_before_wipe: list[str] = []

    def _step(self, *args: Any, **kw: Any) -> None:
        super()._step(*args, **kw)
        if self.learner.step == self.wipe_after:
            self.trained_before_wipe = list(self.consumed)
            r = redis.Redis.from_url(self.redis_url)
            try:
                raw = r.hgetall("brl:r-wipe:counters")
                self.before_wipe = {k.decode(): int(v) for k, v in raw.items()}
                r.flushall()
            finally:
                r.close()


def test_a_redis_wipe_mid_interval_trains_nothing_twice_and_keeps_the_lifetime_counts(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        settings = TrainerSettings(
            proxy_url=proxy.url,
            token=TOKENS["trainer"],
            run="r-wipe",
            worker_id="trainer-a",
            run_spec=spec_json(tiny_model_dir, {"uri": "toy:digits", "size": 200}, max_staleness=16),
            max_steps=8,
            sync_every=1,
            checkpoint_every=4,
            device="cpu",
            lr=1e-2,
            claim_wait_s=0.5,
            audit_log=str(tmp_path / "audit.jsonl"),
            work_dir=str(tmp_path / "work"),
        )
        gen = FakeGenerator(proxy.url, "r-wipe", TOKENS["generator"], worker_id="gen-a")
        gen.start()
        out: list[str] = []
        worker = _WipingWorker(settings, echo=out.append, redis_url=redis_server.url, wipe_after=3)
        try:
            rc = worker.run()
        finally:
            gen.stop()
        assert rc == EXIT_OK, out
        assert worker.before_wipe and len(worker.trained_before_wipe) == 6  # 3 steps x 2 groups, unacked
        # The settle of the final checkpoint's acks happens in the proxy's background cleaner.
        assert proxy.call(lambda ctx: ctx.cleaner.drain(30.0))
        admin = proxy.client("r-wipe", role="admin")
        wait_until(lambda: admin.status().queue.pending == 0, timeout_s=30)
        q = admin.status().queue

    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    ckpts = [r for r in records if r["event"] == "checkpoint"]
    trained = [d for r in steps for d in r["deliveries"]]
    repeats = [d for r in steps for d in r.get("repeats", [])]
    assert [r["step"] for r in steps] == list(range(1, 9))
    # Each step's audit has its per-token version figures (whole-version groups here: one span, none masked).
    assert all(r["tokens"]["spans_per_completion"] == 1.0 and r["tokens"]["stale_masked"] == 0 for r in steps)
    # No delivery trained twice in the lineage; the re-queued ones came back and were held, not trained.
    assert len(trained) == len(set(trained)) == 16, trained
    assert set(worker.trained_before_wipe) <= set(repeats) | set(trained)
    assert set(repeats) and set(repeats) <= set(trained), repeats
    # Every repeat was acked with the next checkpoint (with the step-4 one, or the final one).
    acked = [d for r in ckpts for d in r["acked"]]
    assert set(trained) <= set(acked) and set(repeats) <= set(acked)
    # The lifetime counters went on from the bucket's snapshot (not from 0 at the rebuild) and balance exactly.
    assert q.accepted_total >= worker.before_wipe["accepted_total"] > 0
    assert q.lost_total == 0
    assert q.accepted_total == q.acked_total + q.dropped_stale_total + q.lost_total + q.groups + q.pending, q
    assert q.acked_total == len(set(acked)) >= 16  # each delivery the trainer acked counted acked, exactly once


def test_the_trainer_retries_a_retryable_conflict_and_stops_on_a_fence(monkeypatch: Any) -> None:
    """Item 9: a checkpoint write outlasting the lock wait answers 409 ``write_in_progress`` (retryable): the
    trainer retries it instead of exiting; a fence or a non-retryable conflict still ends it at once."""
    from bucketrl import errors
    from bucketrl.trainer import worker as worker_mod
    from tests.trainer.helpers import settings

    monkeypatch.setattr(worker_mod.time, "sleep", lambda _s: None)
    w = TrainerWorker(settings(proxy_url="http://127.0.0.1:9", run="r1"))
    try:
        answers: list[Any] = [errors.Conflict("busy", retryable=True, code="write_in_progress")] * 2 + ["ok"]

        def call() -> str:
            a = answers.pop(0)
            if isinstance(a, Exception):
                raise a
            return a

        assert w._retrying(call) == "ok" and answers == []
        for err in (errors.Fenced("fenced"), errors.Conflict("version_conflict", code="version_conflict")):
            calls: list[int] = []

            def failing(err: errors.BucketRLError = err, calls: list[int] = calls) -> str:
                calls.append(1)
                raise err

            with pytest.raises(type(err)):
                w._retrying(failing)
            assert calls == [1]
    finally:
        w._prefetch.shutdown()
        for c in (w.client, w.claim_client, w.write_client):
            c.close()


def test_the_ledger_holds_repeats_gives_back_and_forgets_old_checkpoints() -> None:
    from bucketrl.trainer.ledger import DeliveryLedger
    from bucketrl.wire import Delivery

    def d(i: int) -> Delivery:
        return Delivery(delivery_id=f"b{i:032x}:0", version=1, groups=[])

    ledger = DeliveryLedger(remember_checkpoints=2)
    ledger.seed([d(0).delivery_id])  # the resumed checkpoint's
    fresh, repeats = ledger.admit([d(0), d(1), d(1), d(2)])
    assert [x.delivery_id for x in fresh] == [d(1).delivery_id, d(2).delivery_id]
    assert repeats == [d(0).delivery_id, d(1).delivery_id]
    # A re-queued delivery the proxy dropped as stale after a rebuild is held (acked) only if this lineage took it.
    assert ledger.trained([d(1).delivery_id, d(3).delivery_id]) == [d(1).delivery_id]
    ledger.give_back([d(2).delivery_id])  # held back as too stale: claimable again, released by the next claim
    assert d(2).delivery_id not in ledger and ledger.take_release() == [d(2).delivery_id] and not ledger.take_release()
    ledger.checkpointed()
    assert set(ledger.remembered()) == {d(0).delivery_id, d(1).delivery_id}  # what a checkpoint records
    ledger.checkpointed()
    assert d(1).delivery_id in ledger and d(0).delivery_id not in ledger  # the seed is 2 checkpoints old


def _flushall(proxy: Any, url: str) -> None:
    """FLUSHALL on the running redis-server (as the chaos test does), then the proxy's rebuild from the bucket."""
    from bucketrl.proxy import rebuild

    r = redis.Redis.from_url(url)
    try:
        r.flushall()
    finally:
        r.close()
    assert any(proxy.call(rebuild.rebuild_if_wiped) for _ in range(3))


def _claimer(proxy_url: str, worker_id: str, spec: Any) -> TrainerWorker:
    """A real worker whose claim path (``_claim_groups``: the claim loop and its ledger) is driven step by step."""
    from tests.trainer.helpers import settings

    w = TrainerWorker(
        settings(
            proxy_url=proxy_url,
            token=TOKENS["trainer"],
            run="r1",
            worker_id=worker_id,
            claim_wait_s=0.2,
            max_rollout_wait_s=30,
        )
    )
    w.spec = spec
    w.epoch = w.claim_client.epoch = w.write_client.epoch = w.client.register_trainer(worker_id).epoch
    return w


def _close(w: TrainerWorker) -> None:
    w._prefetch.shutdown()
    for c in (w.client, w.claim_client, w.write_client):
        c.close()


def test_groups_trained_before_a_wipe_end_counted_acked_though_stale_after_it_and_the_trainer_died(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The README's old known limit, exact: trainer A acked batch a (checkpoint 1) and b (checkpoint 2) after the
    proxy's last snapshot; Redis is wiped, so the rebuild re-queues a, b and the never-claimed d, and the versions
    move past them (stale). A's next claim meets them; A dies before its next checkpoint; B resumes from
    checkpoint 2 (which lists b, and a among its earlier deliveries) and acks b. The proxy used to drop a, b and d
    as stale at A's claim: B's resume ack moved b back to acked, a stayed counted dropped although the trainer's log
    shows it acked (acked_total 4 for 6 acked). Now a re-queued group below the floor is handed over flagged and
    never trained: the ledger of the trainer holding it acks it (trained before) or gives it back (d: dropped)."""
    from tests.proxy.harness import adapter_tar
    from tests.proxy.test_rollouts_routes import Setup

    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        s = Setup(proxy, groups_per_step=2, max_staleness=4)  # admission: 8 groups queued or leased
        a, b, _d = (s.g.submit_rollouts(s.batch(2), key) for key in ("a", "b", "d"))  # d: never claimed
        assert proxy.call(lambda ctx: ctx.cleaner.drain(10.0))
        store = proxy.ctx.store
        # The bucket when Redis is wiped: the background settle of the acks below (a snapshot covering them, then
        # the deletion of the finished batch objects) has not happened yet.
        kept = [*store.list_keys(snapshot.snapshot_prefix("r1")), *store.list_keys("runs/r1/rollouts/")]
        saved = {key: store.get_bytes(key) for key in kept}

        ta = _claimer(proxy.url, "trainer-a", s.spec)
        tb: TrainerWorker | None = None
        try:
            acked_in_log: list[str] = []
            checkpoint_earlier: list[str] = []
            for batch in (a, b):  # one step per checkpoint: claim, train, checkpoint, ack
                got, dropped, repeats = ta._claim_groups(1)
                ids = [x.delivery_id for x in got]
                assert (dropped, repeats) == (0, []) and {i.rsplit(":", 1)[0] for i in ids} == {batch.batch_id}
                checkpoint_earlier = ta.ledger.remembered()
                assert ta.write_client.ack(ids) == 2
                acked_in_log += ids
                ta.ledger.checkpointed()
            checkpoint_consumed = ids  # checkpoint 2: b's groups, a's among its earlier ones
            assert proxy.call(lambda ctx: ctx.cleaner.drain(10.0))
            store.delete(store.list_keys(snapshot.snapshot_prefix("r1")))
            for key, body in saved.items():
                store.put_bytes(key, body)  # (the batch objects too)
            _flushall(proxy, redis_server.url)
            q = proxy.client("r1", "viewer").status().queue
            assert (q.accepted_total, q.acked_total, q.groups) == (6, 0, 6)  # a, b and d are queued again

            for v in range(2, 7):  # v1 < 6 - max_staleness 4: all six are stale
                ta.write_client.publish_adapter(v, adapter_tar(v))
            s.lease_id = s.g.lease_version("gen-0").lease_id
            c = s.g.submit_rollouts(s.batch(2, version=6), "c")
            got, dropped, repeats = ta._claim_groups(6)  # floor v2
            assert {x.delivery_id.rsplit(":", 1)[0] for x in got} == {c.batch_id}  # nothing below the floor trained
            assert sorted(repeats) == sorted(acked_in_log) and dropped == 2  # a and b held; d given back, dropped
            # A dies here, before the checkpoint that would ack c and the held a and b.
            _close(ta)

            tb = _claimer(proxy.url, "trainer-b", s.spec)  # resumes from checkpoint 2
            tb.ledger.seed(checkpoint_earlier)
            tb.ledger.seed(checkpoint_consumed)
            tb.write_client.ack(checkpoint_consumed)
            acked_in_log += checkpoint_consumed
            got, dropped, repeats = tb._claim_groups(6)
            trained = [x.delivery_id for x in got]
            assert {i.rsplit(":", 1)[0] for i in trained} == {c.batch_id}  # A's work died with it: trained again
            tb.write_client.ack(trained + repeats)  # its next checkpoint
            acked_in_log += trained + repeats
            assert proxy.call(lambda ctx: ctx.cleaner.drain(10.0))
            q = proxy.client("r1", "viewer").status().queue
            assert q.acked_total == len(set(acked_in_log)) == 6, (q, sorted(set(acked_in_log)))
            assert (q.accepted_total, q.dropped_stale_total, q.lost_total, q.groups, q.pending) == (8, 2, 0, 0, 0), q
            _flushall(proxy, redis_server.url)  # and so it stays across another wipe
            q2 = proxy.client("r1", "viewer").status().queue
            assert (q2.accepted_total, q2.acked_total, q2.dropped_stale_total, q2.groups + q2.pending) == (8, 6, 2, 0)
        finally:
            _close(ta)
            if tb is not None:
                _close(tb)
