"""A generator killed mid-continuation (issue 35, partial rollouts) loses nothing and trains nothing twice: real
processes (the proxy on a thread, redis-server, ``bucketrl generator`` processes on the simulated engine, a trainer
stand-in that claims and acks).

The victim's first call, under v1, is overtaken by v2 a few decode steps in and goes on under it; its log names the
prompts the continuation carries on. The continuation lasts more than twice the prompt lease TTL: the keeper renews
those leases all along (none expires, each stays live, though a second generator leasing beside it would take any
that ran out). The victim is SIGKILLed while it still continues, watched for from that log line, with nothing of the
call submitted (it still owns the prompts after the kill). Its leases then run out and the prompts go out again,
first in line, to the second generator: each is trained exactly once, none is lost (the proxy's lifetime counters
balance; every prompt not trained waits to be issued again), and no prompt or version lease is left behind.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
import redis

from bucketrl.wire import SamplingSpec
from tests.generator.worker_support import Consumer, create_run, held_by, start_generator, wait_until
from tests.proxy.harness import ProxyHarness, adapter_files, adapter_tar
from tests.support.services import RedisServer

RUN, VICTIM, OTHER = "pkill", "gen-victim", "gen-other"
TTL_S = 1.5  # the victim's prompt leases: its continuation (~5 s) outlives them twice over
# 24 tokens a completion (all at the cap): a 6 s call, cut a few steps in; ~5 s left to continue, the kill at ~3 s.
DECODE_STEP_S, MAX_NEW_TOKENS = 0.25, 24
SIM = {"engine": "sim", "sim_length_median": 1000, "sim_length_sigma": 0, "sim_decode_step_per_seq_s": 0}
CONTINUING = re.compile(r"continuing \d+ of \d+ completion\(s\) of prompts \[([^\]]*)\] under v(\d+)")


def live_leases(r: redis.Redis, worker_id: str) -> set[str]:
    """The prompts ``worker_id`` holds a lease on that has not run out (Redis TIME, as the proxy's scripts)."""
    secs, micros = r.time()
    now = secs + micros / 1e6
    held = held_by(r, RUN, worker_id)
    return {p for p in held if (r.zscore(f"brl:{RUN}:prompts:inflight", p) or 0.0) > now}


def counter(r: redis.Redis, name: str) -> int:
    return int(r.hget(f"brl:{RUN}:counters", name) or 0)


@pytest.mark.slow  # real processes for ~20 s: make test, not make test-fast
def test_a_generator_killed_mid_continuation_loses_nothing_and_trains_nothing_twice(
    proxy: ProxyHarness, redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapter = tmp_path / "v1"  # the simulated engine reads no weights
    adapter.mkdir()
    for name, data in adapter_files("v1").items():
        (adapter / name).write_bytes(data)
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS)
    trainer, _ = create_run(
        proxy, RUN, tiny_model_dir, adapter, partial_rollouts=True, max_staleness=4, sampling=sampling
    )
    viewer = proxy.client(RUN, "viewer")
    r = redis.Redis.from_url(redis_server.url)
    vlog, olog = tmp_path / "victim.log", tmp_path / "other.log"
    victim = start_generator(
        proxy,
        RUN,
        vlog,
        worker_id=VICTIM,
        prompts_per_request=2,
        prompt_lease_ttl_s=TTL_S,
        version_lease_ttl_s=3,
        metrics_interval_s=0.3,
        sim_decode_step_s=DECODE_STEP_S,
        **SIM,
    )
    # Beside it from the start: it would take any of the victim's prompts whose lease ran out.
    other = start_generator(proxy, RUN, olog, worker_id=OTHER, prompts_per_request=2, sim_decode_step_s=0.02, **SIM)
    t0 = time.monotonic()
    with Consumer(trainer) as consumer:
        try:
            wait_until(lambda: held_by(r, RUN, VICTIM) or victim.poll() is not None, 90, "the victim's first call")
            assert victim.poll() is None, vlog.read_text()[-3000:]
            trainer.publish_adapter(2, adapter_tar(2))
            m = wait_until(lambda: CONTINUING.search(vlog.read_text()), 20, "the v1 call going on under v2")
            continuing = set(m.group(1).split(", "))
            print(f"[kill] {time.monotonic() - t0:.1f}s: {m.group(0)}")
            assert m.group(2) == "2" and len(continuing) == 2, m.group(0)
            # Renewed while it runs: every lease of the continuation stays live past twice its TTL.
            until = time.monotonic() + 2 * TTL_S
            while time.monotonic() < until:
                assert continuing <= live_leases(r, VICTIM), f"a lease ran out mid-continuation:\n{vlog.read_text()}"
                time.sleep(0.1)
            assert counter(r, "prompts_expired_total") == 0
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            print(f"[kill] {time.monotonic() - t0:.1f}s: SIGKILL")
            time.sleep(0.3)  # a request the victim sent just before its death has landed by now
            held = held_by(r, RUN, VICTIM)  # the call's prompts and those leased for its next call
            # Killed mid-continuation: nothing of the call was submitted (that would have ended these leases).
            assert continuing <= held, f"the call ended before the kill:\n{vlog.read_text()[-3000:]}"
            assert not any(d.worker_id == VICTIM for d in consumer.deliveries)
            trained = lambda ds: held <= {g.prompt_id for d in ds for g in d.groups}  # noqa: E731
            consumer.wait_for(lambda ds: trained(ds) or other.poll() is not None, 90)
            print(f"[kill] {time.monotonic() - t0:.1f}s: the {len(held)} prompts it held trained")
            assert other.poll() is None, olog.read_text()[-3000:]
        finally:
            if other.poll() is None:
                other.send_signal(signal.SIGINT)
            rc = other.wait(30)
            victim.kill()
            victim.wait()
        time.sleep(1.0)  # the consumer's last claim
    assert rc == 0, olog.read_text()[-3000:]
    groups = [(d.delivery_id, g.prompt_id, d.worker_id) for d in consumer.deliveries for g in d.groups]
    prompts = [p for _, p, _ in groups]
    assert len(prompts) == len(set(prompts)), "a prompt was trained twice"
    assert len({(d, p) for d, p, _ in groups}) == len(groups), "a delivery was trained twice"
    assert {p for _, p, w in groups if p in held} == held and {w for _, p, w in groups if p in held} == {OTHER}
    # They came back by expiring (exactly the victim's), and no submit repeated a prompt already complete.
    assert counter(r, "prompts_expired_total") == len(held) and counter(r, "prompts_repeated_total") == 0
    assert counter(r, "prompts_refused_repeated_total") == 0
    status = viewer.status()
    q = status.queue
    assert q.lost_total == 0 and q.accepted_total == q.acked_total + q.dropped_stale_total + q.groups + q.pending, q
    assert status.prompts_inflight == 0 and all(v.leases == 0 for v in status.versions), status
    open_ = {p.decode() for p in r.smembers(f"brl:{RUN}:prompts:open")}
    assert open_ == {p.decode() for p in r.lrange(f"brl:{RUN}:prompts:reissue", 0, -1)} and not open_ & set(prompts)
