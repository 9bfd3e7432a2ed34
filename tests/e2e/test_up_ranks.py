"""``bucketrl up --trainer-procs 2``: the trainer as 2 CPU ranks (torchrun, gloo) learns the toy task like the
single-process demo; killing one rank brings the whole trainer down, and the restarted 2-rank trainer resumes from
the checkpoint; the DESIGN section 4 invariants hold at the end.

    .venv/bin/python -m pytest -q -s tests/e2e/test_up_ranks.py
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path

import pytest

from bucketrl.up.processes import trainer_command
from tests.e2e.helpers import Watch, audit, check_invariants, reward_curve, running_cluster, wait_for

pytestmark = pytest.mark.slow

STEPS = 24


def test_up_with_two_trainer_ranks_learns_and_survives_a_killed_rank(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with running_cluster(
        tmp_path, max_steps=STEPS, generators=2, trainer_procs=2, checkpoint_every=4, trainer_env=_fast_fail()
    ) as cluster:
        trainer = cluster.services["trainer"]
        assert trainer.argv[:3] == trainer_command(2)[:3] and "--nproc-per-node=2" in trainer.argv
        watch = Watch(cluster)

        def checkpointed() -> int:
            if not (cluster.logs / "trainer-audit.jsonl").exists():
                return 0
            return max((r["step"] for r in audit(cluster) if r["event"] == "checkpoint"), default=0)

        wait_for(lambda: watch.poll() and checkpointed() >= 8 and trainer.alive, 420, "checkpoint 8", cluster)
        assert trainer.pid is not None
        ranks = rank_pids(trainer.pid)
        assert sorted(ranks) == [0, 1], ranks
        killed = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        assert trainer.wait(120) not in (None, 0), "the trainer survived a killed rank"
        down_s = time.monotonic() - killed
        wait_for(lambda: not alive(ranks[0]), 30, "rank 0 to exit")
        trainer.start()  # what `bucketrl up` does on exit 1: start it again (a new epoch, from the checkpoint)
        deadline = time.monotonic() + 420
        while trainer.alive and time.monotonic() < deadline:
            watch.poll()
            time.sleep(1.0)
        assert trainer.wait(5) == 0, trainer.log_tail(30)
        cluster.stop_workers()
        report = check_invariants(cluster, watch)
        rewards = [r for _, r in reward_curve(cluster)]
        log = trainer.log_path.read_text()
        resumed = [r for r in audit(cluster) if r["event"] == "resume"]
    first, last = statistics.fmean(rewards[:6]), statistics.fmean(rewards[-6:])
    print(
        f"\n[up --trainer-procs 2] {report}\n{STEPS} steps in {time.monotonic() - t0:.0f}s; trainer down "
        f"{down_s:.1f}s after rank 1 was killed; reward first 6 steps {first:.3f} -> last 6 {last:.3f}"
    )
    assert "rank 1 of 2" in log and "rank 0 of 2" in log
    assert resumed and resumed[-1]["step"] >= 8
    assert len(rewards) == STEPS
    assert last >= 1.5 * first and last - first >= 0.1, (first, last)


def rank_pids(launcher: int) -> dict[int, int]:
    """RANK -> pid of the launcher's rank processes (its children with RANK in their environment)."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher:
            for var in environ:
                if var.startswith(b"RANK="):
                    found[int(var[5:])] = int(entry.name)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _fast_fail() -> dict[str, str]:
    # A generous collective timeout still ends a job whose rank hangs; a dead rank ends it at once (torchrun).
    return {"BUCKETRL_DIST_TIMEOUT_S": "120", "BUCKETRL_DIST_HEARTBEAT_S": "5"}
