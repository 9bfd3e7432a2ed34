"""A slow GPU class (issue 25): a generator whose calls outlast the staleness window, against a real proxy and
Redis, the generator a real process on the simulated engine. Its call is abandoned as soon as its version leaves
the window (the prompts back at once, first in line for a faster worker), it then leases nothing while versions
come that fast (the warning says why), nothing it sampled is refused stale, and it samples again once the trainer
slows; nothing is lost or trained twice. Without the guard (bucketrl/generator/staleness_guard.py) the call runs
to its end and its groups are refused stale at submit."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from bucketrl.client import ProxyClient
from tests.generator.helpers import make_adapter
from tests.generator.test_preemption import held_by
from tests.generator.worker_support import Consumer, create_run, start_generator, wait_until
from tests.proxy.harness import ProxyHarness, adapter_tar
from tests.support.services import RedisServer

pytestmark = pytest.mark.slow

RUN, WORKER = "slow", "gen-t4"
PUBLISH_EVERY_S = 0.4  # the fast fleet's trainer: a version every 0.4 s; max_staleness 2 spans ~1 s
DECODE_STEP_S = 0.5  # the slow class: 8 decode steps, a 4 s call


class Publisher(threading.Thread):
    """The trainer of a fast fleet: publishes the next version every ``PUBLISH_EVERY_S`` until stopped."""

    def __init__(self, proxy: ProxyHarness, trainer: ProxyClient) -> None:
        super().__init__(daemon=True, name="publisher")
        self.client = proxy.client(RUN, "trainer")
        self.client.epoch = trainer.epoch
        self.version, self.stop = 1, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(PUBLISH_EVERY_S):
            self.version += 1
            self.client.publish_adapter(self.version, adapter_tar(self.version))


def test_a_slow_class_gives_its_prompts_back_and_never_submits_stale(
    proxy: ProxyHarness, redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapter = make_adapter(tiny_model_dir, tmp_path / "v1", seed=13)
    trainer, _ = create_run(proxy, RUN, tiny_model_dir, adapter, max_staleness=2)
    viewer, admin = proxy.client(RUN, "viewer"), proxy.client(RUN, "generator")
    r = redis.Redis.from_url(redis_server.url)
    log = tmp_path / "gen.log"
    sim = {"engine": "sim", "sim_decode_step_s": DECODE_STEP_S, "sim_length_median": 1000}  # every call 8 steps
    proc = start_generator(
        proxy, RUN, log, worker_id=WORKER, prompts_per_request=2, prompt_lease_ttl_s=300, metrics_interval_s=0.3, **sim
    )
    publisher = Publisher(proxy, trainer)
    with Consumer(trainer) as consumer:
        try:
            sampling = wait_until(lambda: held_by(r, RUN, WORKER), 90, "the first call")
            publisher.start()
            # Its version leaves the window ~1 s into the 4 s call: abandoned, its prompts back at once.
            wait_until(lambda: "left the staleness window" in log.read_text(), 10, "the call abandoned")
            reissue = wait_until(lambda: {p.decode() for p in r.lrange(f"brl:{RUN}:prompts:reissue", 0, -1)}, 2, "")
            assert sampling & reissue, (sampling, reissue)
            # First in line: the next lease (a faster worker's) gets a prompt handed back before any never-leased
            # one, so the cursor stays. Not necessarily one of those read above: under load the slow worker's next
            # call can be abandoned too before this lease, and its prompts are then ahead of them.
            cursor = viewer.status().prompt_cursor
            got = admin.lease_prompts("gen-h100", 1, ttl_s=60)
            assert viewer.status().prompt_cursor == cursor, (got.prompts, cursor, reissue)
            admin.release_prompts("gen-h100", [p.prompt_id for p in got.prompts])
            wait_until(lambda: "staleness guard: a call here takes" in log.read_text(), 10, "the guard's warning")
            # While versions come this fast it leases nothing (versions keep loading: it is alive).
            time.sleep(0.5)
            for _ in range(25):
                assert not held_by(r, RUN, WORKER), f"leased while declining:\n{log.read_text()[-3000:]}"
                time.sleep(0.1)
            # The trainer waits for groups (versions stop): the slow worker samples again and is accepted.
            publisher.stop.set()
            publisher.join(5)
            consumer.wait_for(lambda ds: any(d.worker_id == WORKER for d in ds), 40)
        finally:
            publisher.stop.set()
            proc.send_signal(2)
            rc = proc.wait(30)
        time.sleep(1.0)  # the consumer's last claim
        delivered = [g.prompt_id for d in consumer.deliveries for g in d.groups]
    out = log.read_text()
    assert rc == 0, out[-3000:]
    metrics = viewer.status().metrics[WORKER]
    assert isinstance(metrics, dict)
    assert metrics.get("rollout/dropped_stale_total", 0) == 0, out[-3000:]  # nothing it submitted was refused
    assert metrics["rollout/stale_abandoned_total"] >= 2
    assert len(delivered) == len(set(delivered)), "a prompt was trained twice"
    status = viewer.status()
    assert status.prompts_inflight == 0, out[-3000:]
    open_ = {p.decode() for p in r.smembers(f"brl:{RUN}:prompts:open")}
    assert open_ == {p.decode() for p in r.lrange(f"brl:{RUN}:prompts:reissue", 0, -1)}
    assert not open_ & set(delivered)  # nothing lost: every prompt issued and not trained waits to go out again
