"""A trainer on spot (issue 25), as a real process against a real proxy and Redis: a drain with a 10 s notice
reaches it by its drain long-poll; it finishes the step in progress, checkpoints it at once and exits 0 inside the
notice, and a successor resumes at most one step back (the step lost is printed). Periodic checkpoints are off
(``checkpoint_every`` above the run's length), so only the notice's checkpoint can save the steps trained."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.proxy.harness import TOKENS, running
from tests.support.services import RedisServer
from tests.trainer.fake_generator import FakeGenerator, wait_until
from tests.trainer.test_worker_processes import audit, lineage, max_step, start_trainer

# Not alone: its notice (NOTICE_S) is far longer than a loaded machine's step, and alone its steps got fast enough
# (0.2 s) that two of them could end between reading the step and the notice reaching the trainer.
pytestmark = pytest.mark.slow

NOTICE_S = 10.0


def test_drained_trainer_checkpoints_inside_the_notice_and_its_successor_resumes_there(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        gen = FakeGenerator(proxy.url, "k1", TOKENS["generator"])
        gen.start()
        first = start_trainer(proxy, tmp_path, "trainer-1", tiny_model_dir, max_steps=1000, checkpoint_every=1000)
        second = None
        try:
            wait_until(lambda: max_step(tmp_path) >= 3 or first.poll() is not None, timeout_s=240)
            assert first.poll() is None, (tmp_path / "trainer-1.log").read_text()
            at_notice = max_step(tmp_path)
            t0 = time.monotonic()
            proxy.client("k1", "generator").drain_worker("trainer-1", NOTICE_S)
            rc1 = first.wait(30)
            elapsed = time.monotonic() - t0
            reached = max_step(tmp_path, epoch=1)
            checkpoint = proxy.client("k1").latest_checkpoint()
            second = start_trainer(proxy, tmp_path, "trainer-2", tiny_model_dir, max_steps=reached + 1)
            rc2 = second.wait(240)
        finally:
            for p in (first, second):
                if p is not None and p.poll() is None:
                    p.kill()
            gen.stop()
    log1 = (tmp_path / "trainer-1.log").read_text()
    assert rc1 == 0 and elapsed < NOTICE_S, (rc1, elapsed, log1[-3000:])
    assert "preemption notice (drain" in log1, log1[-3000:]
    stopped = re.search(r"stopped at step (\d+) \(checkpointed ([0-9.]+)s after the stop request", log1)
    assert stopped is not None and int(stopped.group(1)) == reached, log1[-3000:]
    assert checkpoint is not None and checkpoint.step == reached  # no periodic one: the notice's
    resumed = next(r["step"] for r in audit(tmp_path) if r["event"] == "start" and r["epoch"] == 2)
    lost = reached - resumed
    print(
        f"drained at step {at_notice}: finished step {reached}, checkpointed {float(stopped.group(2)):.1f}s after "
        f"the notice, exit 0 after {elapsed:.1f}s; the successor resumed at step {resumed}: {lost} step(s) lost"
    )
    assert 0 <= lost <= 1 and reached - at_notice <= 1
    assert rc2 == 0, (tmp_path / "trainer-2.log").read_text()[-3000:]
    kept = lineage(audit(tmp_path))
    trained = [d for step in sorted(kept) for d in kept[step]]
    assert sorted(kept) == list(range(1, reached + 2)) and len(trained) == len(set(trained))
