"""Chaos on a real ``bucketrl up`` (issue 10): a 100-step run takes 25 faults and finishes with nothing lost and
nothing trained twice; a second, shorter run on S3 rides out its endpoint going away; a third, with partial rollouts
(issue 35), its generators killed mid-continuation.

    .venv/bin/python -m pytest -q -s tests/e2e/test_chaos.py     # prints each fault and its recovery time

The supervisor is ``bucketrl up``'s own (``run_up`` in a child process); the test hits its services from
outside by pid (``tests/e2e/chaos.py``): SIGKILL of the trainer (6 times: more than the old "5 restarts over
the run" allowed), the generators, the proxy and redis-server (all restarted by ``up``), SIGSTOP/SIGCONT of a
generator, Redis ``FLUSHALL`` while the trainer holds unacked groups, and the ``file://`` bucket's directory
renamed away for 20 s. At the end, from the trainer's own audit log (which deliveries each step trained) and
the proxy's lifetime counters (Redis reopened from its append-only file):
- ``up`` exited 0 after the trainer's last step;
- no delivery was trained twice in the final lineage (the last execution of each step);
- ``lost_total == 0`` and accepted = acked + dropped + lost + queued + pending, exactly;
- the counters cover the whole run: at least every delivery trained was accepted, and acked_total is exactly the
  number of deliveries the trainer's log shows acked;
- versions are dense (a record for each of 1..latest, epochs never go back), no leased version was deleted
  (checked at every poll during the run and at the end), and the reward improved.
"""

from __future__ import annotations

import json
import statistics
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from bucketrl.up.cluster import LocalCluster
from tests.e2e.chaos import Chaos, UpProcess, reopen, rewards_by_step
from tests.e2e.helpers import check_invariants, effective_history
from tests.support.faults import TcpGate
from tests.support.services import MotoServer

pytestmark = pytest.mark.slow

# The faults need the steps, not the minutes after them: the trainer makes ~35 steps while the 25 faults run
# (each waits for its recovery) on a loaded machine, and then trains ~2 steps/s, so every step past the last
# fault is time with nothing to check. The run is still long enough that the faults end well before it on a
# quiet machine, where the trainer steps between faults while the test reacts: that is why the test polls every
# 0.2 s (tests/e2e/chaos.py; at 0.5 s an 80-step run once ended before its last fault).
STEPS = 100
CHECKPOINT_EVERY = 5
OUTAGE_S = 20.0
# The partial rollouts run (issue 35): its faults are kills, each recovered in seconds.
PARTIAL_STEPS = 28
PARTIAL_MAX_NEW_TOKENS = 32


def _final_checks(
    up: UpProcess,
    rc: int,
    *,
    steps: int,
    reward_window: int | None,
    on_cluster: Callable[[LocalCluster], None] | None = None,
) -> dict[str, int]:
    """The checks of the module docstring (the reward's only with ``reward_window``); ``on_cluster``: more checks on
    the reopened Redis and proxy."""
    assert rc == 0, up.output()[-4000:]
    assert "trainer finished" in up.output() or "summary" in up.output(), up.output()[-2000:]
    records = up.audit()
    history = effective_history(records)
    assert sorted(history) == list(range(1, steps + 1)), "the final lineage misses steps"
    trained = [d for deliveries in history.values() for d in deliveries]
    twice = {d for d in trained if trained.count(d) > 1}
    assert not twice, f"{len(twice)} deliveries trained twice in the final lineage, e.g. {sorted(twice)[:5]}"
    ever_trained = {d for r in records if r["event"] == "step" for d in r["deliveries"]}
    ever_acked = {d for r in records if r["event"] in ("checkpoint", "resume") for d in r.get("acked") or []}

    with reopen(up) as cluster:
        with cluster.client("viewer", retries=3) as c:
            q = c.status().queue
        # Dense versions, leased versions kept, staleness bound (records lost to a Redis wipe allowed, see there).
        report = check_invariants(cluster, wiped=True)
        if on_cluster is not None:
            on_cluster(cluster)
    lost = q.lost_total
    assert lost == 0, q
    assert q.accepted_total == q.acked_total + q.dropped_stale_total + lost + q.groups + q.pending, q
    # Lifetime, not "since the last Redis wipe": the counters cover everything the trainer's log shows.
    assert q.accepted_total >= len(ever_trained), (q.accepted_total, len(ever_trained))
    # Every delivery the trainer acked is counted acked, exactly once (a reset at a wipe would miss hundreds): also
    # those a rebuild re-queued although trained and that turned stale (handed over flagged, held by the ledger
    # and acked; they used to be dropped, and stayed counted dropped when the trainer died before acking them).
    assert q.acked_total == len(ever_acked), (q, len(ever_acked))
    print(f"[chaos] acked deliveries in the trainer's log {len(ever_acked)}, acked_total {q.acked_total}")
    print(f"[chaos] {report}; lost {lost}")
    if reward_window is not None:
        rewards = rewards_by_step(up)
        steps = sorted(rewards)
        first = statistics.fmean(rewards[s] for s in steps[:reward_window])
        last = statistics.fmean(rewards[s] for s in steps[-reward_window:])
        print(f"[chaos] reward first {reward_window} steps {first:.3f} -> last {last:.3f}")
        assert last > first, (first, last)
    return {
        "accepted": q.accepted_total,
        "acked": q.acked_total,
        "dropped_stale": q.dropped_stale_total,
        "lost": lost,
        "acked_in_trainer_log": len(ever_acked),
    }


def test_bucketrl_up_survives_25_faults_on_a_file_bucket(tmp_path: Path) -> None:
    up = UpProcess(
        tmp_path,
        max_steps=STEPS,
        generators=2,
        checkpoint_every=CHECKPOINT_EVERY,
        prompt_lease_ttl_s=6.0,
        # Fewer prompts per engine call: a killed or frozen generator's leases are few and soon reissued.
        generator_env={"BUCKETRL_PROMPTS_PER_REQUEST": "4"},
        # A crash loop is 5 deaths within 30 s here: a trainer takes ~7 s from its start to its first step on
        # this machine, and the test kills it only after that step, with other faults in between. (The old
        # policy, 5 restarts over the whole run, ended this run at the 6th trainer kill.)
        restart_max_deaths=5,
        restart_window_s=30.0,
    )
    bucket, away = up.dir / "bucket", up.dir / "bucket.away"
    up.start()
    chaos = Chaos(up)
    try:
        chaos.until_step(2, 300)
        # Generator faults do not wait for their recovery: they overlap the next faults.
        chaos.kill("gen-0")
        chaos.freeze("gen-1", 6)
        chaos.kill_trainer()  # 1
        chaos.kill("proxy")
        flushed_at = chaos.flushall(CHECKPOINT_EVERY)
        chaos.kill("gen-1")
        chaos.kill_trainer()  # 2
        chaos.freeze("gen-0", 6)
        chaos.kill("redis")
        chaos.outage("file bucket gone", lambda: bucket.rename(away), lambda: away.rename(bucket), OUTAGE_S)
        chaos.kill("gen-0")
        chaos.kill_trainer()  # 3
        chaos.freeze("gen-1", 6)
        chaos.kill("proxy")
        chaos.kill("gen-1")
        chaos.kill("redis")
        chaos.kill_trainer()  # 4
        chaos.freeze("gen-0", 6)
        chaos.flushall(CHECKPOINT_EVERY)
        chaos.kill("gen-0")
        chaos.kill("proxy")
        chaos.kill_trainer()  # 5
        chaos.kill("gen-1")
        chaos.kill("redis")
        chaos.kill_trainer()  # 6
        last_fault_step = chaos.step()
        rc = chaos.wait_for_exit()
    finally:
        up.stop()
    print(chaos.report())
    print(f"[chaos] the last fault recovered at step {last_fault_step} of {STEPS}")
    kinds = [f.kind for f in chaos.faults]
    assert all(f.recovered is not None for f in chaos.faults), [f.kind for f in chaos.faults if f.recovered is None]
    assert len(chaos.faults) >= 25 and sum(k == "SIGKILL trainer" for k in kinds) >= 6, kinds
    assert flushed_at % CHECKPOINT_EVERY != 0
    assert last_fault_step < STEPS, "the faults came too late to test recovery: raise STEPS"
    assert chaos.leased_checks > 0
    figures = _final_checks(up, rc, steps=STEPS, reward_window=10)
    print(f"[chaos] file run: {figures}")


REPEAT_COUNTERS = ("prompts_repeated_total", "prompts_refused_repeated_total")
ONE_CALL = 8  # prompts in one engine call at the demo's settings, which the partial run keeps


def test_partial_rollouts_ride_out_kills_mid_continuation(tmp_path: Path) -> None:
    """Issue 35: a run with partial rollouts keeps the same promises under kills that land while a generator continues
    a call under a newer version (detected from its log line, never a guessed sleep), with the trainer and the proxy
    killed between them: nothing trained twice (per delivery, and no prompt accepted twice), nothing lost (every
    prompt not trained is waiting to go out again), and tokens of mixed-version completions trained."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"partial_rollouts": True}))
    up = UpProcess(
        tmp_path,
        max_steps=PARTIAL_STEPS,
        generators=2,
        checkpoint_every=CHECKPOINT_EVERY,
        prompt_lease_ttl_s=3.0,  # a killed generator's prompts are back 3 s on
        run_spec=spec,
        max_new_tokens=PARTIAL_MAX_NEW_TOKENS,
        # Long calls, so that a continuation lasts long enough to be killed in: more sequences per step.
        generator_env={"BUCKETRL_PROMPTS_PER_REQUEST": "8"},
    )
    up.start()
    chaos = Chaos(up)
    try:
        chaos.until_step(2, 300)
        chaos.kill_mid_continuation("gen-0")
        chaos.kill_mid_continuation("gen-1")
        chaos.kill_trainer()
        chaos.kill_mid_continuation("gen-0")
        chaos.kill("proxy")
        chaos.kill_mid_continuation("gen-1")
        last_fault_step = chaos.step()
        rc = chaos.wait_for_exit()
    finally:
        up.stop()
    print(chaos.report())
    print(f"[chaos] the last fault recovered at step {last_fault_step} of {PARTIAL_STEPS}")
    assert all(f.recovered is not None for f in chaos.faults), [f.kind for f in chaos.faults if f.recovered is None]
    assert last_fault_step < PARTIAL_STEPS, "the faults came too late to test recovery: raise PARTIAL_STEPS"
    landed = [continued for continued, mid in chaos.continuations_killed if mid]
    assert len(landed) >= 2, f"too few kills landed mid-continuation: {chaos.continuations_killed}"

    def prompts_once_and_none_lost(cluster: LocalCluster) -> None:
        r = redis.Redis.from_url(cluster.redis_url)
        try:
            k = f"brl:{up.cfg.run}"
            # A prompt handed out again while its holder still ran. Accepted twice (prompts_repeated_total): never,
            # the proxy refuses such a batch whole. Refused (prompts_refused_repeated_total): at most one call's
            # worth, when a long continuation's leases lapsed under the suite's load (seen once in CI: 8); a cut that
            # handed its prompts back (the partial-cut-hands-prompts-back mutation) repeats every continued call's.
            counters = r.hgetall(f"{k}:counters")
            accepted, refused = (int(counters.get(c.encode(), 0)) for c in REPEAT_COUNTERS)
            assert accepted == 0, f"{accepted} prompts accepted again after another batch had completed them"
            assert refused <= ONE_CALL, f"{refused} prompts submitted again after another batch had completed them"
            waiting = {
                p.decode()
                for p in [*r.lrange(f"{k}:prompts:reissue", 0, -1), *r.zrange(f"{k}:prompts:inflight", 0, -1)]
            }
            open_ = {p.decode() for p in r.smembers(f"{k}:prompts:open")}
        finally:
            r.close()
        assert open_ <= waiting, f"prompts neither trained nor waiting to go out again: {sorted(open_ - waiting)}"
        killed = set().union(*landed)
        print(f"[chaos] of {len(killed)} prompts killed mid-continuation, {len(killed - open_)} trained since")

    figures = _final_checks(up, rc, steps=PARTIAL_STEPS, reward_window=None, on_cluster=prompts_once_and_none_lost)
    mixed = [r["tokens"]["mixed_version_frac"] for r in up.audit() if r["event"] == "step" and "tokens" in r]
    assert max(mixed, default=0.0) > 0, "no mixed-version tokens were trained: the run continued no call"
    print(f"[chaos] partial run: {figures}; mixed-version token share per step, max {max(mixed):.2f}")


def test_bucketrl_up_rides_out_an_s3_outage(tmp_path: Path, moto_server: MotoServer) -> None:
    name = f"chaos-{uuid.uuid4().hex[:10]}"
    moto_server.create_bucket(name)
    # The endpoint the proxy uses goes through a gate: "refuse" is the S3 server stopped (connection refused),
    # "open" the server back. moto keeps objects in memory only, so stopping moto itself would be a bucket
    # wipe, not an outage (that case is the bucket identity check's: tests/proxy/test_bucket_outage.py).
    gate = TcpGate(moto_server.port).start()
    steps = 16
    up = UpProcess(
        tmp_path,
        max_steps=steps,
        generators=2,
        checkpoint_every=CHECKPOINT_EVERY,
        prompt_lease_ttl_s=6.0,
        bucket_url=f"s3://{name}/chaos",
        proxy_env={"BUCKETRL_S3_ENDPOINT_URL": gate.endpoint},
        generator_env={"BUCKETRL_PROMPTS_PER_REQUEST": "4"},
    )
    up.start()
    chaos = Chaos(up)
    try:
        chaos.until_step(2, 300)
        chaos.outage("S3 endpoint down", lambda: gate.set_mode("refuse"), lambda: gate.set_mode("open"), OUTAGE_S)
        chaos.outage("S3 answering 503", lambda: gate.set_mode("error"), lambda: gate.set_mode("open"), 8)
        rc = chaos.wait_for_exit()
        print(chaos.report())
        figures = _final_checks(up, rc, steps=steps, reward_window=5)  # the reopened proxy goes through the gate
        print(f"[chaos] s3 run: {figures}")
    finally:
        up.stop()
        gate.stop()
