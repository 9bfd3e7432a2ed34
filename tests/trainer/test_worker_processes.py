"""``bucketrl trainer`` as real processes against a real proxy + Redis: SIGKILL and restart, fencing, SIGTERM.

Invariant 4 is checked from the trainers' audit logs (``BUCKETRL_AUDIT_LOG``): the lineage of the final
weights (each epoch keeps the steps up to the checkpoint the next epoch resumed from) trains every
delivery at most once, and every accepted group is in that lineage, dropped as stale, or still queued.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.proxy.harness import TOKENS, ProxyHarness, running
from tests.support.services import RedisServer
from tests.trainer.fake_generator import FakeGenerator, wait_until
from tests.trainer.test_worker import spec_json

pytestmark = pytest.mark.slow


def start_trainer(proxy: ProxyHarness, tmp: Path, name: str, model_dir: Path, **settings: Any) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUCKETRL_")}
    env.update(
        {
            "BUCKETRL_PROXY_URL": proxy.url,
            "BUCKETRL_TOKEN": TOKENS["trainer"],
            "BUCKETRL_RUN": "k1",
            "BUCKETRL_WORKER_ID": name,
            "BUCKETRL_RUN_SPEC": spec_json(model_dir, {"uri": "toy:digits", "size": 64}),
            "BUCKETRL_DEVICE": "cpu",
            "BUCKETRL_LR": "0.01",
            "BUCKETRL_CLAIM_WAIT_S": "0.5",
            "BUCKETRL_AUDIT_LOG": str(tmp / "audit.jsonl"),
            "HF_HUB_OFFLINE": "1",
        }
    )
    env.update({f"BUCKETRL_{k.upper()}": str(v) for k, v in settings.items()})
    log = (tmp / f"{name}.log").open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "bucketrl.cli", "trainer"], env=env, stdout=log, stderr=subprocess.STDOUT
    )


def audit(tmp: Path) -> list[dict[str, Any]]:
    path = tmp / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def max_step(tmp: Path, epoch: int | None = None) -> int:
    steps = [r["step"] for r in audit(tmp) if r["event"] == "step" and (epoch is None or r["epoch"] == epoch)]
    return max(steps, default=0)


def stored_checkpoint(tmp: Path) -> int:
    """The newest checkpoint step a trainer has recorded as stored (and acked), 0 if none."""
    return max((r["step"] for r in audit(tmp) if r["event"] == "checkpoint"), default=0)


def epoch_steps(tmp: Path, epoch: int) -> int:
    return sum(1 for r in audit(tmp) if r["event"] == "step" and r["epoch"] == epoch)


def lineage(records: list[dict[str, Any]]) -> dict[int, list[str]]:
    """Step -> deliveries of the steps that made the final weights."""
    kept: dict[int, list[str]] = {}
    for r in records:
        if r["event"] == "start":  # a new epoch starts from the checkpoint at r["step"]: later steps are gone
            kept = {s: d for s, d in kept.items() if s <= r["step"]}
        elif r["event"] == "step":
            kept[r["step"]] = r["deliveries"]
    return kept


def test_sigkill_mid_run_then_restart_loses_nothing_and_trains_nothing_twice(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        gen = FakeGenerator(proxy.url, "k1", TOKENS["generator"])
        gen.start()
        first = start_trainer(proxy, tmp_path, "trainer-1", tiny_model_dir, max_steps=8, checkpoint_every=3)
        try:
            # Checkpoints are stored on the uploader thread, behind training: kill once checkpoint 3 is stored
            # and a later step is trained (checkpoints at 3, 6), so the restart has steps to redo.
            wait_until(
                lambda: (
                    (stored_checkpoint(tmp_path) >= 3 and max_step(tmp_path) > stored_checkpoint(tmp_path))
                    or first.poll() is not None
                ),
                timeout_s=240,
            )
            assert first.poll() is None, (tmp_path / "trainer-1.log").read_text()
            first.send_signal(signal.SIGKILL)
            first.wait(30)
            killed_at = max_step(tmp_path)
            checkpointed = stored_checkpoint(tmp_path)
            second = start_trainer(proxy, tmp_path, "trainer-2", tiny_model_dir, max_steps=8, checkpoint_every=3)
            rc = second.wait(300)
        finally:
            for p in (first, locals().get("second")):
                if p is not None and p.poll() is None:
                    p.kill()
            gen.stop()
        log2 = (tmp_path / "trainer-2.log").read_text()
        assert rc == 0, log2
        assert "runs/k1/adapters/" in log2
        client = proxy.client("k1")
        status = client.status()

    records = audit(tmp_path)
    starts = [r for r in records if r["event"] == "start"]
    assert [r["epoch"] for r in starts] == [1, 2]
    # The restart resumes from the last checkpoint stored before the kill (one whose store finished between the
    # kill and its audit record is the next multiple of 3), and redoes the steps after it.
    resumed = starts[1]["step"]
    assert resumed in (checkpointed, checkpointed + 3) and 3 <= resumed < killed_at, (resumed, checkpointed, killed_at)
    # Dense versions across the restart (max_staleness is large: nothing garbage-collected).
    assert [v.version for v in status.versions] == list(range(1, status.latest_version + 1))
    # The restored weights were published as a new version (the killed trainer's later ones died with it).
    assert status.latest_version >= 8
    # Invariant 4: the final weights trained every delivery at most once ...
    kept = lineage(records)
    assert sorted(kept) == list(range(1, 9))
    trained = [d for step in sorted(kept) for d in kept[step]]
    assert len(trained) == len(set(trained)) == 16
    # ... a delivery trained by the killed trainer after its last checkpoint was trained again from that state,
    lost_steps = [r for r in records if r["event"] == "step" and r["epoch"] == 1 and r["step"] > resumed]
    redone = {d for r in lost_steps for d in r["deliveries"]}
    assert redone and redone <= set(trained)
    # ... and every accepted group is trained into the final weights, dropped as stale (counted) or queued.
    q = status.queue
    assert set(trained) <= set(gen.accepted)
    assert q.acked_total == len(trained)
    assert q.accepted_total == len(gen.accepted) == q.acked_total + q.dropped_stale_total + q.groups + q.pending
    assert q.pending == 0


def test_second_trainer_fences_the_first_and_sigterm_checkpoints(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        gen = FakeGenerator(proxy.url, "k1", TOKENS["generator"])
        gen.start()
        procs: list[subprocess.Popen] = []
        try:
            procs.append(
                start_trainer(proxy, tmp_path, "trainer-1", tiny_model_dir, max_steps=1000, checkpoint_every=2)
            )
            wait_until(lambda: max_step(tmp_path) >= 2 or procs[0].poll() is not None, timeout_s=240)
            procs.append(
                start_trainer(proxy, tmp_path, "trainer-2", tiny_model_dir, max_steps=1000, checkpoint_every=2)
            )
            rc1 = procs[0].wait(240)  # fenced as soon as its next claim/publish/ack reaches the proxy
            log1 = (tmp_path / "trainer-1.log").read_text()
            assert rc1 == 3, log1
            assert "FENCED" in log1
            wait_until(lambda: epoch_steps(tmp_path, 2) >= 2 or procs[1].poll() is not None, timeout_s=240)
            assert procs[1].poll() is None, (tmp_path / "trainer-2.log").read_text()
            procs[1].send_signal(signal.SIGTERM)
            rc2 = procs[1].wait(60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            gen.stop()
        log2 = (tmp_path / "trainer-2.log").read_text()
        assert rc2 == 0, log2
        assert "stopped at step" in log2 and "steps lost: 0" in log2  # issue 25: SIGTERM is a preemption notice
        status = proxy.client("k1").status()
        latest_ckpt = proxy.client("k1").latest_checkpoint()

    records = audit(tmp_path)
    epoch2_steps = [r["step"] for r in records if r["event"] == "step" and r["epoch"] == 2]
    # SIGTERM: the last step of the run is checkpointed (and its deliveries acked) before exit 0.
    assert latest_ckpt is not None and latest_ckpt.step == max(epoch2_steps)
    assert [v.version for v in status.versions] == list(range(1, status.latest_version + 1))
    # Invariant 4 across the fence: the final lineage trains each delivery once and exactly those are acked;
    # what the fenced trainer claimed but never checkpointed is pending, re-claimable by the next trainer.
    kept = lineage(records)
    trained = [d for step in sorted(kept) for d in kept[step]]
    assert len(trained) == len(set(trained))
    q = status.queue
    assert q.acked_total == len(trained)
    assert q.accepted_total == q.acked_total + q.dropped_stale_total + q.groups + q.pending
    # The fenced trainer wrote nothing after the new registration: no step of epoch 1 got checkpointed later.
    ckpt_epochs = [r["epoch"] for r in records if r["event"] == "checkpoint"]
    assert ckpt_epochs == sorted(ckpt_epochs)
