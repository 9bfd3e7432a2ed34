"""Version leases and garbage collection (docs/design.md invariant 1), including a concurrent race of publishes,
leases, renewals, releases, expiries and GC passes that asserts no leased version was ever deleted."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from pathlib import Path

import httpx
import pytest

from bucketrl import errors
from bucketrl.proxy import gc
from bucketrl.proxy.state import leases
from tests.proxy.harness import TOKENS, ProxyHarness, adapter_tar, make_spec, running
from tests.support.services import RedisServer


def _setup(p: ProxyHarness, run: str = "r1", versions: int = 0, **spec_kw):
    t = p.client(run, "trainer")
    t.put_run(make_spec(**spec_kw))
    t.register_trainer("t0")
    for v in range(1, versions + 1):
        t.publish_adapter(v, adapter_tar(v))
    return t, p.client(run, "generator")


def _gc(p: ProxyHarness, run: str = "r1") -> list[int]:
    async def one_pass(ctx):
        from bucketrl.proxy.state import runs

        return await gc.collect_run(ctx, run, await runs.get_spec(ctx.redis, run))

    return p.call(one_pass)


def test_lease_lifecycle_and_errors(proxy_file: ProxyHarness) -> None:
    t, g = _setup(proxy_file)
    with pytest.raises(errors.NotFound, match="no published version"):
        g.lease_version("g1")
    t.publish_adapter(1, adapter_tar(1))
    t.publish_adapter(2, adapter_tar(2))
    lease = g.lease_version("g1")
    assert lease.version == 2 and lease.expires_at > time.time() + 50
    pinned = g.lease_version("g1", version=1, ttl_s=0.3)
    assert pinned.version == 1
    with pytest.raises(errors.NotFound):
        g.lease_version("g1", version=3)
    renewed = g.renew_lease(lease.lease_id, ttl_s=120)
    assert renewed.version == 2 and renewed.expires_at > lease.expires_at
    time.sleep(0.45)
    with pytest.raises(errors.Gone) as exc:
        g.renew_lease(pinned.lease_id)
    assert exc.value.status == 410 and exc.value.code == "lease_expired"
    g.release_lease(lease.lease_id)
    g.release_lease(lease.lease_id)  # a replayed release answers like the first (test_replays_leases.py)
    with pytest.raises(errors.Gone):
        g.renew_lease(lease.lease_id)
    with pytest.raises(errors.Gone):
        g.renew_lease("never-issued")


def test_gc_deletes_old_unleased_versions_and_never_leased_ones(proxy: ProxyHarness) -> None:
    t, g = _setup(proxy, versions=2, max_staleness=1)
    hold = g.lease_version("g1", version=1, ttl_s=60)
    for v in (3, 4, 5):
        t.publish_adapter(v, adapter_tar(v))
    short = g.lease_version("g2", version=2, ttl_s=1.0)
    # latest 5, max_staleness 1: versions < 4 are collectable unless leased.
    assert _gc(proxy) == [3]  # v1 is leased, v2's lease is still live
    time.sleep(max(0.0, short.expires_at - time.time()) + 0.05)
    assert _gc(proxy) == [2]  # v2's lease expired
    store = proxy.ctx.store
    assert not store.exists("runs/r1/adapters/v2/manifest.json")
    assert store.list_keys("runs/r1/adapters/v3") == []
    assert store.exists("runs/r1/adapters/v1/manifest.json")
    assert g.download_adapter(1) == adapter_tar(1)
    for gone in (2, 3):
        with pytest.raises(errors.Gone) as exc:
            g.download_adapter(gone)
        assert exc.value.code == "version_gone"
        with pytest.raises(errors.Gone):
            g.lease_version("g3", version=gone)
    with pytest.raises(errors.NotFound):
        g.download_adapter(6)
    g.release_lease(hold.lease_id)
    assert _gc(proxy) == [1]
    st = proxy.client("r1", "viewer").status()
    assert [v.version for v in st.versions] == [4, 5] and st.gc_versions_total == 3
    with proxy.http(None) as anon:
        text = anon.get("/metrics").text
    assert 'bucketrl_gc_versions_total{run="r1"} 3.0' in text
    assert 'bucketrl_latest_version{run="r1"} 5.0' in text


def test_max_staleness_window_and_latest_are_never_collected(proxy_file: ProxyHarness) -> None:
    _setup(proxy_file, versions=4, max_staleness=2)
    assert _gc(proxy_file) == [1]  # keep 2..4 (latest - max_staleness .. latest)
    with proxy_file.http("admin") as a:
        a.put("/v1/runs/r1", content=make_spec(max_staleness=0).model_dump_json())
    assert _gc(proxy_file) == [2, 3]  # staleness 0: only the latest remains
    assert [v.version for v in proxy_file.client("r1", "viewer").status().versions] == [4]


def test_gc_runs_in_the_background_loop(redis_server: RedisServer, tmp_path: Path) -> None:
    with running(redis_server.url, f"file://{tmp_path / 'b'}", gc_interval_s=0.05) as p:
        _setup(p, versions=3, max_staleness=0)
        deadline = time.monotonic() + 10
        while p.ctx.store.exists("runs/r1/adapters/v2/manifest.json") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not p.ctx.store.exists("runs/r1/adapters/v1/manifest.json")
        assert not p.ctx.store.exists("runs/r1/adapters/v2/manifest.json")
        assert p.ctx.store.exists("runs/r1/adapters/v3/manifest.json")


def test_concurrent_publishes_leases_expiries_and_gc_never_delete_a_leased_version(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Invariant 1 under a race. A publisher adds versions (max_staleness 0, so every older version is
    immediately collectable); a GC loop runs every 5 ms; generators lease random recent versions with tiny
    TTLs, renew, release or let them expire, and download while they hold a live lease. Every download
    under a live lease must return the exact bytes, and at the end every live lease's version must exist."""
    with running(redis_server.url, f"file://{tmp_path / 'b'}", gc_interval_s=0.005) as p:
        _setup(p, versions=1, max_staleness=0)
        stats = {"downloads": 0, "lease_refused": 0, "renew_expired": 0, "released": 0, "expired": 0}
        violations: list[str] = []
        stop = asyncio.Event()

        async def publisher(c: httpx.AsyncClient) -> None:
            for v in range(2, 41):
                tar = adapter_tar(v)
                r = await c.put(
                    f"/v1/runs/r1/adapters/{v}",
                    content=tar,
                    headers={"X-Trainer-Epoch": "1", "X-Content-SHA256": hashlib.sha256(tar).hexdigest()},
                )
                assert r.status_code == 200, r.text
                await asyncio.sleep(0.01)
            stop.set()

        async def generator(c: httpx.AsyncClient, wid: str) -> None:
            rng = random.Random(wid)
            while not stop.is_set():
                latest = (await c.get("/v1/runs/r1")).json()["state"]["latest_version"]
                want = max(1, latest - rng.randint(0, 2))
                ttl = rng.choice([0.02, 0.05, 0.2])
                r = await c.post("/v1/runs/r1/leases", json={"worker_id": wid, "version": want, "ttl_s": ttl})
                if r.status_code == 410:
                    stats["lease_refused"] += 1
                    continue
                assert r.status_code == 200, r.text
                lease = r.json()
                for _ in range(rng.randint(0, 3)):
                    # Only trust the lease while it is clearly live (same host clock as Redis).
                    if time.time() < lease["expires_at"] - 0.01:
                        d = await c.get(f"/v1/runs/r1/adapters/{lease['version']}")
                        if time.time() < lease["expires_at"]:
                            stats["downloads"] += 1
                            if d.status_code != 200 or d.content != adapter_tar(lease["version"]):
                                violations.append(f"v{lease['version']} -> {d.status_code} under a live lease")
                    action = rng.random()
                    if action < 0.4:
                        rr = await c.post(f"/v1/runs/r1/leases/{lease['lease_id']}/renew", json={"ttl_s": ttl})
                        if rr.status_code == 200:
                            lease = rr.json()
                        else:
                            assert rr.status_code == 410
                            stats["renew_expired"] += 1
                            break
                    await asyncio.sleep(rng.choice([0.0, 0.01, 0.03]))
                if rng.random() < 0.5:
                    rr = await c.delete(f"/v1/runs/r1/leases/{lease['lease_id']}")
                    assert rr.status_code in (204, 410)
                    stats["released"] += 1
                else:
                    stats["expired"] += 1

        async def main() -> None:
            limits = httpx.Limits(max_connections=20)
            async with (
                httpx.AsyncClient(
                    base_url=p.url, headers={"Authorization": f"Bearer {TOKENS['admin']}"}, limits=limits, timeout=30
                ) as c,
            ):
                await asyncio.gather(publisher(c), *(generator(c, f"g{i}") for i in range(6)))

        asyncio.run(main())
        assert not violations, violations[:5]

        async def audit(ctx) -> tuple[int, list[str]]:
            bad = []
            sec, usec = await ctx.redis.time()
            now = sec + usec / 1e6
            for lid, exp in await ctx.redis.zrange("brl:r1:leases", 0, -1, withscores=True):
                if exp > now:
                    v = int(await ctx.redis.hget(f"brl:r1:lease:{lid.decode()}", "version"))
                    if await ctx.redis.hget(f"brl:r1:version:{v}", "state") != b"live":
                        bad.append(f"live lease {lid!r} on v{v} which is not live")
            total = int(await ctx.redis.hget("brl:r1:counters", "gc_versions") or 0)
            return total, bad

        gc_total, bad = p.call(audit)
        assert not bad, bad
        # The race really happened: versions were collected around live leases, leases expired and were refused.
        assert gc_total >= 20, gc_total
        assert stats["downloads"] >= 20 and stats["expired"] + stats["renew_expired"] > 0, stats
        for v in range(1, 41):
            exists = p.ctx.store.exists(f"runs/r1/adapters/v{v}/manifest.json")
            state = p.call(lambda ctx, v=v: ctx.redis.hget(f"brl:r1:version:{v}", "state"))
            if state == b"live":
                assert exists, f"v{v} is live but its files are gone"
            elif state == b"gone":
                assert not exists, f"v{v} is gone but its files remain"


def test_mark_collectable_is_atomic_with_lease_creation(proxy_file: ProxyHarness) -> None:
    """Direct Lua-level check: a lease created on a version makes the GC decision skip it, and once GC marked a
    version, lease creation refuses it — whichever comes first wins, never both."""
    _setup(proxy_file, versions=3, max_staleness=0)

    async def race(ctx):
        results = await asyncio.gather(
            leases.create(ctx.redis, "r1", "g", 1, 30),
            leases.mark_collectable(ctx.redis, "r1", 0),
            return_exceptions=True,
        )
        return results

    lease_result, marked = proxy_file.call(race)
    if isinstance(lease_result, errors.Gone):
        assert 1 in marked
    else:
        assert lease_result.version == 1 and 1 not in marked and 2 in marked
