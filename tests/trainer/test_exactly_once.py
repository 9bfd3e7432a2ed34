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
