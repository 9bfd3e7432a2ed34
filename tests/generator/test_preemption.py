"""Preemption notices (issue 25) against a real proxy and Redis, the generator as a real process: a drain mid-call
submits what finishes in time, hands the rest back at once (not at lease expiry) and exits 0 before the notice
ends; the handed-back prompts are issued again before any never-leased one; nothing is lost or trained twice."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import redis

from bucketrl import errors
from bucketrl.wire import MetricsPush, RewardSpec
from tests.generator.helpers import make_adapter, run_spec
from tests.generator.worker_support import Consumer, create_run, held_by, start_generator, wait_until
from tests.proxy.harness import ProxyHarness
from tests.support.services import RedisServer

# alone: the drain must finish inside its notice and hand back within a second.
pytestmark = [pytest.mark.slow, pytest.mark.alone]

NOTICE_S = 10.0


def test_drain_mid_call_submits_what_finishes_and_hands_back_the_rest(
    proxy: ProxyHarness, redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapter = make_adapter(tiny_model_dir, tmp_path / "v1", seed=11)
    # Scoring a batch takes ~3 s (8 completions x 0.4 s): a drain always finds one being scored.
    reward = RewardSpec(name="tests.generator.reward_fixtures:sleepy", kwargs={"seconds": 0.4})
    trainer, _ = create_run(proxy, "pre", tiny_model_dir, adapter, reward=reward)
    viewer, admin = proxy.client("pre", "viewer"), proxy.client("pre", "generator")
    r = redis.Redis.from_url(redis_server.url)
    log = tmp_path / "gen.log"
    # Long prompt leases: only a release, never an expiry, can empty prompts_inflight within the notice.
    proc = start_generator(proxy, "pre", log, worker_id="gen-spot", prompt_lease_ttl_s=300, prompts_per_request=2)
    with Consumer(trainer) as consumer:
        try:
            consumer.wait_for(lambda ds: len(ds) >= 1, 240)
            wait_until(lambda: viewer.status().prompts_inflight >= 2, 60, "prompts in flight")
            before = len(consumer.deliveries)
            t0 = time.monotonic()
            notice = admin.drain_worker("gen-spot", NOTICE_S)
            assert 0 < notice.notice_s <= NOTICE_S
            rc = proc.wait(30)
            elapsed = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        time.sleep(1.0)  # the consumer's last claim
        delivered = [g.prompt_id for d in consumer.deliveries for g in d.groups]
        after = len(consumer.deliveries) - before
    out = log.read_text()
    assert rc == 0, out[-3000:]
    assert "preemption notice (drain" in out, out[-3000:]
    # The worker's own account of its exit (the heartbeat that carried the drain came after t0): inside the notice.
    stopped = re.search(r"stopped ([0-9.]+)s after the preemption notice", out)
    assert stopped is not None and float(stopped.group(1)) < NOTICE_S, out[-3000:]
    assert elapsed < NOTICE_S + 5, f"{elapsed:.1f}s"  # slack: the heartbeat's delay and the interpreter's exit
    assert after >= 1, "the batch being scored at the notice was not submitted"
    status = viewer.status()
    assert status.prompts_inflight == 0 and all(v.leases == 0 for v in status.versions), out[-3000:]
    assert len(delivered) == len(set(delivered)), "a prompt was trained twice"
    # Nothing lost: every issued prompt not delivered is waiting to be issued again, and goes out first.
    open_ = {p.decode() for p in r.smembers("brl:pre:prompts:open")}
    reissue = [p.decode() for p in r.lrange("brl:pre:prompts:reissue", 0, -1)]
    assert open_ == set(reissue) and not open_ & set(delivered)
    cursor = status.prompt_cursor
    if reissue:
        got = admin.lease_prompts("gen-next", len(reissue[:4]), ttl_s=60)
        assert [p.prompt_id for p in got.prompts] == reissue[: len(got.prompts)]
        assert viewer.status().prompt_cursor == cursor  # no never-leased prompt went out before them
        admin.release_prompts("gen-next", [p.prompt_id for p in got.prompts])


def test_drain_long_poll_hands_back_within_a_second_on_the_sim_engine(
    proxy: ProxyHarness, redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A drain reaches the generator by its long-poll, not its heartbeat (60 s apart here, so only the long-poll can
    carry it): the prompts leased for its next call are back in the pool in under 1 s, the call in the engine
    (~3 s on the simulated GPU) finishes and is submitted, and the process exits 0 inside the 10 s notice."""
    adapter = make_adapter(tiny_model_dir, tmp_path / "v1", seed=12)
    trainer, _ = create_run(proxy, "fast", tiny_model_dir, adapter)
    viewer, admin = proxy.client("fast", "viewer"), proxy.client("fast", "generator")
    r = redis.Redis.from_url(redis_server.url)
    log = tmp_path / "gen.log"
    # 8 decode steps of 0.4 s: each call (2 prompts x G=4, max_new_tokens=8) takes ~3.2 s.
    settings = {"engine": "sim", "sim_decode_step_s": 0.4, "metrics_interval_s": 60, "prompt_lease_ttl_s": 300}
    proc = start_generator(proxy, "fast", log, worker_id="gen-fast", prompts_per_request=2, **settings)
    with Consumer(trainer) as consumer:
        try:
            consumer.wait_for(lambda ds: len(ds) >= 1, 120)
            wait_until(lambda: len(held_by(r, "fast", "gen-fast")) >= 4, 30, "a call sampling and the next leased")
            t0 = time.monotonic()
            admin.drain_worker("gen-fast", NOTICE_S)
            held = wait_until(lambda: [h for h in [held_by(r, "fast", "gen-fast")] if len(h) <= 2], 3, "hand-back")
            sampling = held[0]  # the call in the engine, or none when it had just ended
            handed_back_s = time.monotonic() - t0
            assert viewer.status().prompts_inflight <= 2
            reissued = {p.decode() for p in r.lrange("brl:fast:prompts:reissue", 0, -1)}
            rc = proc.wait(15)
            elapsed = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        time.sleep(1.0)  # the consumer's last claim
        delivered = [g.prompt_id for d in consumer.deliveries for g in d.groups]
    out = log.read_text()
    print(f"handed back {handed_back_s:.2f}s after the drain, exited {elapsed:.1f}s after it")
    assert rc == 0 and elapsed < NOTICE_S, (rc, elapsed, out[-3000:])
    assert handed_back_s < 1.0, f"{handed_back_s:.2f}s: {out[-3000:]}"
    assert reissued, "no prompt was handed back"
    assert sampling <= set(delivered), "the call in the engine at the drain was not submitted"
    assert len(delivered) == len(set(delivered)), "a prompt was trained twice"
    status = viewer.status()
    assert status.prompts_inflight == 0 and all(v.leases == 0 for v in status.versions), out[-3000:]
    open_ = {p.decode() for p in r.smembers("brl:fast:prompts:open")}
    assert open_ == {p.decode() for p in r.lrange("brl:fast:prompts:reissue", 0, -1)} and not open_ & set(delivered)


def test_drain_long_poll_answers_at_once_or_when_woken(proxy: ProxyHarness, tmp_path: Path) -> None:
    proxy.client("lp", "trainer").put_run(run_spec(tmp_path))
    gen = proxy.client("lp", "generator")
    gen.push_metrics(MetricsPush(worker_id="gen-1", loaded_versions=[]))
    t0 = time.monotonic()
    assert gen.wait_drain("gen-1", 0.3) is None and time.monotonic() - t0 >= 0.3  # 204 after wait_s
    threading.Timer(0.5, lambda: proxy.client("lp", "generator").drain_worker("gen-1", 10)).start()
    t0 = time.monotonic()
    got = gen.wait_drain("gen-1", 30)
    woke = time.monotonic() - t0
    assert got is not None and 0 < got.notice_s <= 10 and woke < 1.5, woke  # woken by pub/sub, not the 30 s
    t0 = time.monotonic()
    assert gen.wait_drain("gen-1", 30) is not None and time.monotonic() - t0 < 0.5  # pending: at once
    assert gen.wait_drain("gen-2", 0) is None  # another worker's drain is not this one's
    with pytest.raises(errors.Forbidden):
        proxy.client("lp", "viewer").wait_drain("gen-1", 0)


def test_released_prompts_go_out_before_expired_and_fresh_ones(proxy: ProxyHarness, tmp_path: Path) -> None:
    admin = proxy.client("rel", "generator")
    trainer = proxy.client("rel", "trainer")
    trainer.put_run(run_spec(tmp_path, group_size=2, groups_per_step=8, queue_capacity_groups=16, max_staleness=2))
    a = admin.lease_prompts("gen-a", 2, ttl_s=0.5).prompts
    b = admin.lease_prompts("gen-b", 2, ttl_s=300).prompts
    time.sleep(0.8)  # gen-a's leases expire
    admin.release_prompts("gen-b", [p.prompt_id for p in b])
    got = [p.prompt_id for p in admin.lease_prompts("gen-c", 6, ttl_s=300).prompts]
    # Handed back on purpose first, then the expired, then fresh positions.
    assert got[:4] == [b[1].prompt_id, b[0].prompt_id, a[0].prompt_id, a[1].prompt_id], got
    assert got[4:] == ["0-4", "0-5"]


def test_drain_route_refuses_mistakes(proxy: ProxyHarness, tmp_path: Path) -> None:
    proxy.client("dr", "trainer").put_run(run_spec(tmp_path))
    gen = proxy.client("dr", "generator")
    with pytest.raises(errors.NotFound):
        gen.drain_worker("nobody", 10)
    gen.push_metrics(MetricsPush(worker_id="gen-1", loaded_versions=[]))
    with pytest.raises(errors.Forbidden):
        proxy.client("dr", "viewer").drain_worker("gen-1", 10)
    first = gen.drain_worker("gen-1", 10)
    assert gen.drain_worker("gen-1", 100).notice_s <= first.notice_s  # a repeated call never lengthens it
    got = gen.push_metrics(MetricsPush(worker_id="gen-1", loaded_versions=[]))
    assert got is not None and got.drain is not None and got.drain.notice_s <= 10
    assert gen.push_metrics(MetricsPush(worker_id="gen-2", loaded_versions=[])) is None  # no drain for others
