"""``bucketrl trainer`` as a 2-rank torchrun job (``python -m bucketrl.trainer.launch``) against a real proxy + Redis:
a killed rank brings the whole job down, and one process resumes the 2-rank job's checkpoint and finishes the run
with nothing lost and nothing trained twice (DESIGN invariant 4, from the audit log as in test_worker_processes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.proxy.harness import TOKENS, ProxyHarness, running
from tests.support.services import RedisServer
from tests.trainer.fake_generator import FakeGenerator, wait_until
from tests.trainer.test_worker import spec_json
from tests.trainer.test_worker_processes import audit, lineage, max_step, start_trainer, stored_checkpoint

pytestmark = pytest.mark.slow


def start_ranks(proxy: ProxyHarness, tmp: Path, name: str, model_dir: Path, procs: int, **settings: object):
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUCKETRL_")}
    env.update(
        {
            "BUCKETRL_PROXY_URL": proxy.url,
            "BUCKETRL_TOKEN": TOKENS["trainer"],
            "BUCKETRL_RUN": "k1",
            "BUCKETRL_WORKER_ID": name,
            "BUCKETRL_RUN_SPEC": spec_json(model_dir, {"uri": "toy:add", "size": 64}),
            "BUCKETRL_DEVICE": "cpu",
            "BUCKETRL_LR": "0.01",
            "BUCKETRL_CLAIM_WAIT_S": "0.5",
            "BUCKETRL_AUDIT_LOG": str(tmp / "audit.jsonl"),
            "BUCKETRL_DIST_TIMEOUT_S": "60",
            "BUCKETRL_DIST_HEARTBEAT_S": "2",
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
        }
    )
    env.update({f"BUCKETRL_{k.upper()}": str(v) for k, v in settings.items()})
    argv = [sys.executable, "-m", "bucketrl.trainer.launch", "--standalone", f"--nproc-per-node={procs}"]
    log = (tmp / f"{name}.log").open("w")
    return subprocess.Popen([*argv, "-m", "bucketrl.cli", "trainer"], env=env, stdout=log, stderr=subprocess.STDOUT)


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


def test_killed_rank_ends_the_job_and_one_process_resumes_its_checkpoint(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        gen = FakeGenerator(proxy.url, "k1", TOKENS["generator"])
        gen.start()
        job = start_ranks(proxy, tmp_path, "ranks", tiny_model_dir, 2, max_steps=8, checkpoint_every=3)
        single = None
        try:
            wait_until(
                lambda: (
                    (stored_checkpoint(tmp_path) >= 3 and max_step(tmp_path) > stored_checkpoint(tmp_path))
                    or job.poll() is not None
                ),
                timeout_s=300,
            )
            log = (tmp_path / "ranks.log").read_text()
            assert job.poll() is None, log
            assert "rank 1 of 2" in log and "rank 0 of 2" in log
            ranks = rank_pids(job.pid)
            assert sorted(ranks) == [0, 1], ranks
            killed_at = max_step(tmp_path)
            t0 = time.monotonic()
            os.kill(ranks[1], signal.SIGKILL)
            rc = job.wait(120)
            down_s = time.monotonic() - t0
            # The whole job is down, rank 0 included: no rank trains or talks to the proxy any more.
            assert rc != 0
            wait_until(lambda: not alive(ranks[0]), timeout_s=30)
            checkpointed = stored_checkpoint(tmp_path)

            # One process resumes the 2-rank job's checkpoint (a new epoch) and finishes the run.
            single = start_trainer(proxy, tmp_path, "single", tiny_model_dir, max_steps=8, checkpoint_every=3)
            rc2 = single.wait(300)
        finally:
            for p in (job, single):
                if p is not None and p.poll() is None:
                    p.kill()
            gen.stop()
        assert rc2 == 0, (tmp_path / "single.log").read_text()
        status = proxy.client("k1").status()

    print(f"\n[ranks] job down {down_s:.1f}s after rank 1 was killed (at step {killed_at})")
    records = audit(tmp_path)
    starts = [r for r in records if r["event"] == "start"]
    assert [r["epoch"] for r in starts] == [1, 2]
    assert starts[1]["step"] in (checkpointed, checkpointed + 3) and starts[1]["step"] >= 3
    kept = lineage(records)
    assert sorted(kept) == list(range(1, 9))
    trained = [d for step in sorted(kept) for d in kept[step]]
    assert len(trained) == len(set(trained)) == 16
    q = status.queue
    assert q.acked_total == len(trained)
    assert q.accepted_total == q.acked_total + q.dropped_stale_total + q.groups + q.pending
    assert [v.version for v in status.versions] == list(range(1, status.latest_version + 1))
