"""Workers of different GPU classes and prices push their metrics to a real proxy on a real Redis: the status shows
their classes, throughput per class and a cost consistent with the declared prices, and Prometheus carries it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

from rich.console import Console

from bucketrl.status_cli import render_status
from bucketrl.wire import MetricsPush
from tests.proxy.harness import make_spec, running
from tests.support.services import RedisServer


def test_status_carries_classes_and_a_cost_from_declared_prices(redis_server: RedisServer, tmp_path) -> None:
    prices = '{"gpu_usd_per_hour": {"a10g": 1.8}}'
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}", prices=prices) as proxy:
        proxy.client("r1", "trainer").put_run(make_spec())
        gen, trainer = proxy.client("r1", "generator"), proxy.client("r1", "trainer")

        def push_all(k: int) -> None:
            done = {"rollout/tokens_total": 100.0 * k, "rollout/groups_submitted_total": 2.0 * k}
            # g-h100 declares its own price; g-a10g declares only its class (priced from BUCKETRL_PRICES).
            gen.push_metrics(
                MetricsPush(
                    worker_id="g-h100",
                    loaded_versions=[],
                    phase="generating",
                    metrics=done,
                    gpu_class="h100",
                    usd_per_hour=36.0,
                )
            )
            gen.push_metrics(
                MetricsPush(
                    worker_id="g-a10g", loaded_versions=[], phase="waiting for the first version", gpu_class="a10g"
                )
            )
            trainer.push_metrics(
                MetricsPush(worker_id="t", step=k, metrics={"train/tokens": 1000.0}, gpu_class="cpu", usd_per_hour=0.0)
            )

        push_all(1)
        time.sleep(1.5)
        push_all(2)
        status = proxy.client("r1", "viewer").status()
        body = proxy.http("viewer").get("/metrics").text

    classes = {w.worker_id: (w.gpu_class, w.usd_per_hour) for w in status.workers}
    assert classes == {"g-h100": ("h100", 36.0), "g-a10g": ("a10g", None), "t": ("cpu", 0.0)}
    cost = status.cost
    assert cost is not None and cost.prices.gpu_price("a10g") == 1.8
    by = {(u.role, u.gpu_class): u for u in cost.classes}
    h100, a10g = by[("generator", "h100")], by[("generator", "a10g")]
    assert 1.0 < h100.worker_s < 60 and 1.0 < a10g.worker_s < 60  # the seconds between the two pushes
    assert math.isclose(h100.usd, h100.worker_s / 3600 * 36.0)
    assert math.isclose(a10g.usd, a10g.worker_s / 3600 * 1.8)
    assert by[("trainer", "cpu")].usd == 0.0
    assert math.isclose(cost.usd_total, h100.usd + a10g.usd + cost.usd_requests + cost.usd_egress)
    assert cost.trainer_steps == 2 and cost.trained_tokens == 2000.0
    assert math.isclose(cost.usd_per_step or 0, cost.usd_total / 2)
    assert math.isclose(cost.usd_per_trained_token or 0, cost.usd_total / 2000)
    # The a10g waited for a version the whole time: all its dollars are waste, none of the busy h100's.
    assert a10g.idle_s == a10g.worker_s and h100.idle_s == 0.0
    assert math.isclose(cost.waste_fraction, a10g.usd / cost.usd_total)
    assert math.isclose(h100.tokens_per_s or 0, 200.0 / h100.worker_s)  # throughput per worker of the class
    (line,) = [x for x in body.splitlines() if x.startswith('bucketrl_cost_usd_total{run="r1"}')]
    assert math.isclose(float(line.split()[-1]), cost.usd_total)
    console = Console(width=200, record=True)
    console.print(*render_status(status))
    text = console.export_text()
    assert "h100" in text and "a10g" in text and "$ per step" in text and "proxy -> workers" in text


def test_proxy_refuses_a_bad_price_at_start(tmp_path) -> None:
    env = {
        **os.environ,
        "BUCKETRL_PRICES": '{"gpu_usd_per_hour": {"h100": -3}}',
        "BUCKETRL_BUCKET_URL": f"file://{tmp_path}",
    }
    cmd = [sys.executable, "-m", "bucketrl.cli", "proxy"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "h100" in out.stderr and "price" in out.stderr, out.stderr[-2000:]


def test_the_cost_so_far_survives_a_redis_wipe(redis_server: RedisServer, tmp_path) -> None:
    """The cost usage rides in the prompt snapshot with the counters: a rebuild continues the run's cost from it
    (before, a wipe restarted every dollar and worker-second at 0)."""
    from bucketrl.proxy import rebuild
    from tests.proxy.test_pool import Run

    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        run = Run(proxy, "r1", 2)
        for _ in range(2):
            run.g.push_metrics(MetricsPush(worker_id="g", phase="generating", gpu_class="h100", usd_per_hour=36.0))
            time.sleep(1.0)
        run.submit(run.g.lease_prompts("g", 1).prompts)
        claimed = run.t.claim("trainer-r1", max_groups=1)
        assert run.t.ack([d.delivery_id for d in claimed.deliveries]) == 1
        assert proxy.call(lambda ctx: ctx.cleaner.drain(10.0))  # the ack's snapshot is in the bucket
        before = proxy.client("r1", "viewer").status().cost
        assert before is not None and before.usd_total > 0
        redis_server.wipe()
        redis_server.start()
        assert any(proxy.call(rebuild.rebuild_if_wiped) for _ in range(3))
        after = proxy.client("r1", "viewer").status().cost
    assert after is not None
    assert math.isclose(after.usd_gpu, before.usd_gpu)
    # The bucket counts continue from the snapshot too (those made after it, before the wipe, are lost).
    assert after.bucket_requests > 0
    assert [(c.gpu_class, c.worker_s) for c in after.classes] == [(c.gpu_class, c.worker_s) for c in before.classes]


def test_bucket_requests_and_the_bytes_on_each_link_are_counted_and_priced(redis_server: RedisServer, tmp_path) -> None:
    """The proxy counts its bucket requests (writes and listings apart from reads) and the bytes on each link:
    bucket -> proxy, and proxy -> workers (adapters served), per run; a status read adds the counts so far."""
    from tests.proxy.harness import adapter_tar
    from tests.proxy.test_pool import Run

    prices = '{"usd_per_gb_egress": 10.0, "usd_per_gb_bucket_egress": 1.0}'
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}", prices=prices) as proxy:
        run = Run(proxy, "r1", 2)  # put the run, register, publish v1
        other = Run(proxy, "r2", 2)
        viewer = proxy.client("r1", "viewer")
        before = viewer.status().cost
        assert before is not None and before.bucket_requests > 0 and before.egress_gb == 0.0
        size = len(adapter_tar(1))
        for _ in range(3):  # every generator asks after a publish; the proxy's cache reads the bucket once
            assert len(run.g.download_adapter(1)) == size
        after = viewer.status().cost
        untouched = proxy.client("r2", "viewer").status().cost
        other.g.download_adapter(1)
    assert after is not None and untouched is not None
    assert after.egress_gb == 3 * size / 1e9  # exactly what was served to workers
    assert size / 1e9 <= after.bucket_egress_gb - before.bucket_egress_gb < 3 * size / 1e9
    assert after.bucket_reads > before.bucket_reads
    assert untouched.egress_gb == 0.0  # r1's downloads are r1's
    p = after.prices
    want = after.bucket_requests / 1000 * p.usd_per_1k_requests + after.bucket_reads / 1000 * p.usd_per_1k_reads
    assert math.isclose(after.usd_requests, want)
    assert math.isclose(after.usd_egress, after.egress_gb * 10.0 + after.bucket_egress_gb * 1.0)


def test_prompts_lost_in_flight_count_as_waste(redis_server: RedisServer, tmp_path) -> None:
    """A generator that vanishes mid-call (SIGKILL, a preemption without notice) leaves its prompt leases to expire:
    when they are offered again, each counts as a wasted group, and its share of the busy dollars as waste."""
    from tests.proxy.test_pool import Run

    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        run = Run(proxy, "r1", 2)
        for _ in range(2):  # a busy h100 generator: dollars to share out
            run.g.push_metrics(MetricsPush(worker_id="g", phase="generating", gpu_class="h100", usd_per_hour=36.0))
            time.sleep(1.0)
        run.submit(run.g.lease_prompts("g", 1).prompts)  # one group produced and accepted
        run.g.lease_prompts("dead", 3, ttl_s=0.5)  # a worker that then vanished
        time.sleep(1.0)
        again = run.g.lease_prompts("g", 3)  # the expired ones are offered first
        cost = proxy.client("r1", "viewer").status().cost
    assert len(again.prompts) == 3
    assert cost is not None and cost.wasted_groups == 3
    gen = [u for u in cost.classes if u.role == "generator"]
    busy = sum(u.usd for u in gen) - sum(u.usd * u.idle_s / u.worker_s for u in gen if u.worker_s > 0)
    assert math.isclose(cost.waste_usd, busy * 3 / 4)  # 3 of the 4 groups worked on were lost
