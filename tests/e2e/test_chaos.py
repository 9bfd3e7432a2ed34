"""Chaos during one run: SIGKILL a generator, SIGKILL + restart the trainer, restart the proxy, kill + restart
Redis (append-only file, fsync always). After each, the invariants hold; the run still finishes.

    .venv/bin/python -m pytest -q -s tests/e2e/test_chaos.py

What each fault must show:
- generator SIGKILL: the prompts it held are issued again once their lease expires and get completed by the
  surviving generator (read-only look at the proxy's Redis: they leave the ``open`` set while the killed
  worker is still dead).
- trainer SIGKILL: the restarted trainer gets a new epoch, resumes from its checkpoint (audit log ``resume``
  with step > 0), versions stay dense, no delivery is trained twice in the final history.
- proxy restart: workers ride it out (their HTTP clients retry); nothing accepted is lost.
- Redis SIGKILL + restart: coordination state comes back from the append-only file (counters do not reset).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
import redis

from bucketrl.up.cluster import LocalCluster
from tests.e2e.helpers import (
    Watch,
    audit,
    check_invariants,
    print_sync_latency,
    reward_curve,
    running_cluster,
    status,
    wait_for,
)

pytestmark = pytest.mark.slow

STEPS = 80  # the run must outlast four faults and the waits between them (steps take ~0.1 s here)
GAP = 4  # steps the run must make between two faults (each fault hits a run that is moving)
LEASE_TTL_S = 6.0


def _owned_prompts(cluster: LocalCluster, worker: str) -> set[str]:
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        owners = r.hgetall(f"brl:{cluster.cfg.run}:prompts:owner")
        return {pid for pid, w in owners.items() if w == worker}
    finally:
        r.close()


def _still_open(cluster: LocalCluster, prompts: set[str]) -> set[str]:
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        open_ = r.smembers(f"brl:{cluster.cfg.run}:prompts:open")
        return prompts & set(open_)
    finally:
        r.close()


def test_run_survives_kills_and_restarts(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with running_cluster(
        tmp_path,
        max_steps=STEPS,
        generators=2,
        checkpoint_every=5,
        prompt_lease_ttl_s=LEASE_TTL_S,
        # Fewer prompts per engine call: the killed generator's leases are few and soon reissued.
        generator_env={"BUCKETRL_PROMPTS_PER_REQUEST": "4"},
    ) as cluster:
        watch = Watch(cluster)
        watch.until_step(3, 240)

        # 1. SIGKILL a generator while it holds prompt leases; it stays dead while the other faults happen.
        held = wait_for(lambda: _owned_prompts(cluster, "gen-0"), 60, "gen-0 to hold prompt leases")
        cluster.services["gen-0"].kill()
        killed_gen_at = time.monotonic()
        held |= _owned_prompts(cluster, "gen-0")  # leases granted just before the kill landed
        print(f"\n[chaos] gen-0 SIGKILLed at step {watch.step()} holding {len(held)} prompts")

        # 2. SIGKILL the trainer mid-run and start it again: it resumes from its checkpoint.
        watch.until_step(watch.step() + GAP, 240)
        # Checkpoints are stored on the trainer's uploader thread, behind its steps: wait for one to be stored.
        wait_for(lambda: [r for r in audit(cluster) if r["event"] == "checkpoint"], 120, "a stored checkpoint")
        epoch = status(cluster).trainer.epoch
        cluster.services["trainer"].kill()
        killed_at = watch.step()
        cluster.services["trainer"].start()
        wait_for(lambda: status(cluster).trainer.epoch > epoch, 120, "the restarted trainer to register")
        wait_for(lambda: [r for r in audit(cluster) if r["event"] == "resume"], 120, "the trainer to resume")
        resumes = [r for r in audit(cluster) if r["event"] == "resume"]
        assert resumes[-1]["step"] > 0 and resumes[-1]["epoch"] > epoch, resumes
        print(f"[chaos] trainer SIGKILLed at step {killed_at}; resumed from checkpoint step {resumes[-1]['step']}")
        watch.until_step(killed_at + 2, 240)
        check_invariants(cluster, watch, final=False)

        # 3. Restart the proxy (same address): workers retry through the gap.
        watch.until_step(watch.step() + GAP, 240)
        before = status(cluster).queue.accepted_total
        proxy_at = watch.step()
        cluster.restart("proxy")
        watch.until_step(watch.step() + GAP, 240)
        assert status(cluster).queue.accepted_total > before
        print(f"[chaos] proxy restarted at step {proxy_at}, {before} accepted groups; the run continued")
        check_invariants(cluster, watch, final=False)

        # The killed generator's prompts were issued again (its leases expired) and completed by gen-1.
        wait_for(
            lambda: not _still_open(cluster, held), 120, f"the {len(held)} prompts of the killed gen-0 to complete"
        )
        assert not cluster.services["gen-0"].alive
        print(
            f"[chaos] gen-0's prompts all completed by gen-1 within {time.monotonic() - killed_gen_at:.0f}s of the kill"
        )
        cluster.services["gen-0"].start()

        # 4. SIGKILL Redis and start it again on its append-only file: the run continues where it was.
        watch.until_step(watch.step() + GAP, 240)
        before_q = status(cluster).queue
        redis_at = watch.step()
        cluster.restart("redis", kill=True)
        after_q = wait_for(lambda: watch.poll() and watch.last.queue, 60, "the proxy to see Redis again")
        assert after_q.accepted_total >= before_q.accepted_total, (before_q, after_q)
        print(
            f"[chaos] redis SIGKILLed at step {redis_at} and restarted: accepted {before_q.accepted_total} -> "
            f"{after_q.accepted_total}"
        )
        assert redis_at < STEPS - GAP, "the faults came too late to test recovery: raise STEPS"

        trainer = cluster.services["trainer"]
        deadline = time.monotonic() + 300
        while trainer.alive and time.monotonic() < deadline:
            watch.poll()
            time.sleep(1.0)
        assert trainer.wait(5) == 0, trainer.log_tail()
        for name in cluster.generator_names:
            assert cluster.services[name].alive, f"{name} died: {cluster.services[name].log_tail()}"
        cluster.stop_workers()
        report = check_invariants(cluster, watch)
        rewards = [r for _, r in reward_curve(cluster)]
        print(f"[chaos] {report}; {time.monotonic() - t0:.0f}s")
        first, last = statistics.fmean(rewards[:8]), statistics.fmean(rewards[-8:])
        print(f"[chaos] reward first 8 steps {first:.3f} -> last 8 {last:.3f}")
        print_sync_latency(cluster)
    assert report.steps == STEPS and report.latest_version >= STEPS + 1
