"""The proxy's adapter cache: one bucket read per version per process, never a stale or collected version."""

from __future__ import annotations

import asyncio
import hashlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from bucketrl import errors
from bucketrl.proxy.adapter_cache import AdapterCache
from tests.proxy.harness import ProxyHarness, adapter_tar, make_spec
from tests.proxy.test_leases_gc import _gc


def _key(data: bytes, version: int = 1) -> tuple[str, int, str]:
    return ("r", version, hashlib.sha256(data).hexdigest())


def test_single_flight_then_memory_and_failures_are_not_kept() -> None:
    async def scenario() -> None:
        cache = AdapterCache(max_bytes=1000)
        data = b"x" * 100
        calls: list[int] = []
        gate = asyncio.Event()

        async def slow_load() -> bytes:
            calls.append(1)
            await gate.wait()
            return data

        waiters = [asyncio.create_task(cache.get(_key(data), slow_load)) for _ in range(20)]
        await asyncio.sleep(0.01)
        gate.set()
        assert await asyncio.gather(*waiters) == [data] * 20
        assert len(calls) == 1  # twenty concurrent requests, one bucket read
        assert await cache.get(_key(data), slow_load) == data and len(calls) == 1

        async def broken() -> bytes:
            raise errors.Unavailable("bucket down")

        other = b"y" * 100
        first = asyncio.create_task(cache.get(_key(other, 2), broken))
        second = asyncio.create_task(cache.get(_key(other, 2), broken))
        for task in (first, second):
            with pytest.raises(errors.Unavailable):
                await task

        async def good() -> bytes:
            return other

        assert await cache.get(_key(other, 2), good) == other  # the failure was not kept

        # bytes that do not match the key's sha256 are answered (the client checks) but never kept
        async def wrong() -> bytes:
            return b"z" * 100

        assert await cache.get(_key(b"w" * 100, 3), wrong) == b"z" * 100
        assert _key(b"w" * 100, 3) not in cache._data

    asyncio.run(scenario())


def test_least_recently_used_out_by_bytes() -> None:
    async def scenario() -> None:
        cache = AdapterCache(max_bytes=250)
        blobs = [bytes([i]) * 100 for i in range(3)]
        for i, b in enumerate(blobs):

            async def load(b: bytes = b) -> bytes:
                return b

            await cache.get(_key(b, i), load)
        assert list(cache._data) == [_key(blobs[1], 1), _key(blobs[2], 2)]  # the oldest went
        assert not cache.fits(251) and cache.fits(250)

    asyncio.run(scenario())


def test_route_reads_the_bucket_once_per_version_and_still_answers_410_after_gc(proxy: ProxyHarness) -> None:
    t = proxy.client("r1", "trainer")
    t.put_run(make_spec(max_staleness=1))
    t.register_trainer("t0")
    for v in (1, 2):
        t.publish_adapter(v, adapter_tar(v, size=4096))
    g = proxy.client("r1", "generator")
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: g.download_adapter(2), range(16)))
    assert got == [adapter_tar(2, size=4096)] * 16
    cache = proxy.ctx.adapter_cache
    assert cache is not None and cache.misses == 1 and cache.hits == 15
    assert g.download_adapter(1) == adapter_tar(1, size=4096) and cache.misses == 2
    for v in (3, 4):
        t.publish_adapter(v, adapter_tar(v, size=4096))
    assert _gc(proxy) == [1, 2]
    with pytest.raises(errors.Gone):  # cached, but collected: the Redis check comes first
        g.download_adapter(2)
