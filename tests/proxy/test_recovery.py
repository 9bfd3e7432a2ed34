"""Recovery: Redis killed mid-operation (503, retryable) and back (everything works, nothing lost or
half-done); Redis wiped (automatic rebuild from bucket manifests); the proxy restarted (stateless)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from bucketrl import errors
from bucketrl.wire import MetricsPush
from tests.proxy.harness import TOKENS, ProxyHarness, adapter_tar, checkpoint_tar, make_spec, running
from tests.support.services import RedisServer


def test_redis_killed_mid_operation_is_503_then_full_recovery(
    proxy_file: ProxyHarness, redis_server: RedisServer
) -> None:
    t = proxy_file.client("r1", "trainer")
    t.put_run(make_spec(max_staleness=8))
    t.register_trainer("t0")
    t.publish_adapter(1, adapter_tar(1))
    g = proxy_file.client("r1", "generator")
    lease = g.lease_version("g1", ttl_s=120)

    # Kill Redis while a publish's body is still streaming in.
    tar = adapter_tar(2, size=64_000)
    import hashlib

    sha = hashlib.sha256(tar).hexdigest()

    def slow_body():
        for i in range(0, len(tar), 8_000):
            if i == 16_000:
                redis_server.kill()
            yield tar[i : i + 8_000]
            time.sleep(0.02)

    with proxy_file.http("admin") as h:
        r = h.put(
            "/v1/runs/r1/adapters/2", content=slow_body(), headers={"X-Trainer-Epoch": "1", "X-Content-SHA256": sha}
        )
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["retryable"] is True and err["code"] == "redis_unavailable"
        for method, path in [("GET", "/v1/runs/r1/status"), ("GET", "/v1/runs/r1"), ("POST", "/v1/runs/r1/leases")]:
            r = h.request(method, path, json={"worker_id": "g1"}) if method == "POST" else h.request(method, path)
            assert r.status_code == 503 and r.json()["error"]["retryable"] is True, (method, path, r.text)
    with proxy_file.http(None) as anon:
        ready = anon.get("/readyz")
        assert ready.status_code == 503 and ready.json()["redis"].startswith("unavailable")
        assert anon.get("/healthz").status_code == 200  # alive, just not ready
    with pytest.raises(errors.Unavailable):
        t.publish_adapter(2, tar)
    assert not proxy_file.ctx.store.exists("runs/r1/adapters/v2/manifest.json")  # no half-done version

    redis_server.start()  # same port, append-only data: nothing Redis acknowledged is lost
    with proxy_file.http(None) as anon:
        assert anon.get("/readyz").status_code == 200
    assert t.publish_adapter(2, tar).version == 2
    assert g.renew_lease(lease.lease_id).version == 1  # the lease survived
    st = proxy_file.client("r1", "viewer").status()
    assert st.latest_version == 2 and {v.version: v.leases for v in st.versions} == {1: 1, 2: 0}

    # A worker client with retries rides out a Redis outage on its own.
    redis_server.kill()
    threading.Timer(0.8, redis_server.start).start()
    patient = proxy_file.client("r1", "trainer", retries=8, backoff_s=0.1)
    patient.epoch = 1
    assert patient.publish_adapter(3, adapter_tar(3)).version == 3


def test_wiped_redis_is_rebuilt_from_the_bucket(redis_server: RedisServer, bucket_url: str) -> None:
    with running(redis_server.url, bucket_url, gc_interval_s=0.1) as p:
        old = p.client("r1", "trainer")
        spec = make_spec(max_staleness=1)
        old.put_run(spec)
        old.register_trainer("t0")
        for v in (1, 2, 3):
            old.publish_adapter(v, adapter_tar(v))
        deadline = time.monotonic() + 10  # the GC loop collects v1 (latest 3, staleness 1)
        while p.ctx.store.exists("runs/r1/adapters/v1/manifest.json") and time.monotonic() < deadline:
            time.sleep(0.05)
        ck = checkpoint_tar(b"step 7")
        old.put_checkpoint(7, ck)
        other = p.client("r2", "trainer")
        other.put_run(make_spec(base_model="other"))

        redis_server.wipe()
        redis_server.start()
        g = p.client("r1", "generator", retries=3)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                if g.get_run().state.latest_version == 3:
                    break
            except (errors.NotFound, errors.Unavailable):
                pass
            time.sleep(0.1)
        info = g.get_run()
        assert info.spec == spec and info.state.latest_version == 3 and info.state.trainer_epoch == 1
        # Runs are rebuilt one after another: r2 may still answer 503 (Retry-After) once r1 is back, as a
        # generator of r2 would see it; the client's retries ride that out.
        assert p.client("r2", "viewer", retries=3).get_run().spec.base_model == "other"
        assert g.download_adapter(3) == adapter_tar(3) and g.download_adapter(2) == adapter_tar(2)
        with pytest.raises(errors.Gone):
            g.download_adapter(1)
        assert old.latest_checkpoint().step == 7 and old.download_checkpoint(7) == ck
        assert g.wait_for_version(2, wait_s=0).version == 3
        # The run keeps going: dense numbering, fencing still works.
        lease = g.lease_version("g1", version=2, ttl_s=60)
        new = p.client("r1", "trainer")
        assert new.register_trainer("t1").epoch == 2
        with pytest.raises(errors.Fenced):
            old.publish_adapter(4, adapter_tar(4))
        assert new.publish_adapter(4, adapter_tar(4)).version == 4
        # Leases died with Redis: the rebuild holds GC back so generators can lease again.
        time.sleep(0.3)
        assert p.ctx.store.exists("runs/r1/adapters/v2/manifest.json")
        g.release_lease(lease.lease_id)


def test_put_run_after_wipe_restores_instead_of_restarting_numbering(proxy_file: ProxyHarness, redis_server) -> None:
    t = proxy_file.client("r1", "trainer")
    t.put_run(make_spec())
    t.register_trainer("t0")
    t.publish_adapter(1, adapter_tar(1))
    t.publish_adapter(2, adapter_tar(2))
    redis_server.wipe()
    redis_server.start()
    t.retries = 3
    assert t.put_run(make_spec()).state.latest_version == 2  # restored, not created afresh
    t.register_trainer("t1")
    with pytest.raises(errors.Conflict):
        t.publish_adapter(1, adapter_tar(99))
    assert t.publish_adapter(3, adapter_tar(3)).version == 3
    assert proxy_file.client("r1", "generator").download_adapter(1) == adapter_tar(1)


def test_proxy_restart_loses_nothing(proxy: ProxyHarness) -> None:
    t = proxy.client("r1", "trainer")
    t.put_run(make_spec())
    t.register_trainer("t0")
    t.publish_adapter(1, adapter_tar(1))
    t.put_checkpoint(3, checkpoint_tar(b"3"))
    g = proxy.client("r1", "generator")
    lease = g.lease_version("g1", ttl_s=60)
    g.push_metrics(MetricsPush(worker_id="g1", metrics={"reward": 0.5}, loaded_versions=[1]))
    before = proxy.client("r1", "viewer").status()
    proxy.restart()
    after = proxy.client("r1", "viewer").status()
    assert after.latest_version == before.latest_version == 1
    assert after.versions == before.versions and after.trainer == before.trainer
    assert [w.worker_id for w in after.workers] == ["g1"] and after.metrics["g1"]["reward"] == 0.5
    assert g.renew_lease(lease.lease_id).version == 1
    assert t.publish_adapter(2, adapter_tar(2)).version == 2  # the epoch survived
    assert t.latest_checkpoint().step == 3
    with httpx.Client(base_url=proxy.url, headers={"Authorization": f"Bearer {TOKENS['viewer']}"}) as v:
        assert v.get("/v1/runs/r1").json()["state"]["latest_version"] == 2


def test_readyz_reports_an_unreachable_bucket(redis_server: RedisServer, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the bucket directory should be")
    with running(redis_server.url, f"file://{blocker}/bucket") as p, p.http(None) as anon:
        r = anon.get("/readyz")
        assert r.status_code == 503 and r.json()["redis"] == "ok" and r.json()["bucket"].startswith("unavailable")


def test_first_request_after_a_wipe_rebuilds_inline(proxy_file: ProxyHarness, redis_server: RedisServer) -> None:
    """No waiting for the maintenance loop (hourly in this harness): the first request that finds its run
    missing from an empty Redis triggers the rebuild and gets its answer."""
    t = proxy_file.client("r1", "trainer")
    t.put_run(make_spec())
    t.register_trainer("t0")
    t.publish_adapter(1, adapter_tar(1))
    redis_server.wipe()
    redis_server.start()
    g = proxy_file.client("r1", "generator", retries=3)
    assert g.wait_for_version(0, wait_s=0).version == 1
    with pytest.raises(errors.NotFound):  # a run the bucket does not know stays unknown
        proxy_file.client("ghost", "viewer").get_run()


def test_a_run_not_yet_restored_by_a_rebuild_is_503_not_unknown(redis_server: RedisServer, bucket_url: str) -> None:
    """A rebuild restores runs one by one: while it runs, a run that is not back yet is retried (503), never
    answered 404 unknown_run (which workers do not retry). Once no rebuild is under way, unknown is unknown."""
    import redis

    from bucketrl.proxy import keys

    with running(redis_server.url, bucket_url, gc_interval_s=30) as p:
        p.client("r1", "trainer").put_run(make_spec())
        raw = redis.Redis.from_url(redis_server.url)
        raw.set(keys.REBUILDING, "1", px=60_000)  # what another replica's rebuild sets while it restores
        with pytest.raises(errors.Unavailable) as caught:
            p.client("r2", "viewer").get_run()
        assert caught.value.retryable and caught.value.retry_after
        assert p.client("r1", "viewer").get_run().spec == make_spec()  # restored runs answer as usual
        raw.delete(keys.REBUILDING)
        with pytest.raises(errors.NotFound):
            p.client("r2", "viewer").get_run()
        # A rebuild of this process clears the marker when it ends.
        raw.flushall()
        assert p.client("r1", "viewer", retries=3).get_run().spec == make_spec()
        assert not raw.exists(keys.REBUILDING)
