"""The relay's adapter cache on a real directory: a byte cap with least-recently-served eviction that never
touches a file being served, files hashed once (as written, or on first use after a restart) and trusted by
their stamp afterwards."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bucketrl.relay import cache as cache_module
from bucketrl.relay.cache import AdapterCache, Entry

SIZE = 1000


def _body(v: int) -> bytes:
    return bytes([v]) * SIZE


def _fetch(v: int, calls: list[int]):
    async def fetch() -> AsyncIterator[bytes]:
        calls.append(v)
        yield _body(v)

    return fetch


def _get(cache: AdapterCache, v: int, calls: list[int]) -> Entry:
    sha = hashlib.sha256(_body(v)).hexdigest()
    return asyncio.run(cache.acquire("r1", v, sha, _fetch(v, calls)))


def _on_disk(root: Path) -> list[str]:
    return sorted(p.name.split(".")[0] for p in root.glob("r1/*.tar"))


def test_least_recently_served_goes_first_and_a_held_file_stays(tmp_path: Path) -> None:
    cache, calls = AdapterCache(tmp_path, max_bytes=int(2.5 * SIZE)), []
    for v in (1, 2):
        cache.release(_get(cache, v, calls))
    cache.release(_get(cache, 1, calls))  # v1 served again: v2 is now the least recently served
    held = _get(cache, 3, calls)
    assert _on_disk(tmp_path) == ["v1", "v3"] and calls == [1, 2, 3]
    assert (cache.stats.evictions, cache.stats.evicted_bytes, cache.stats.bytes) == (1, SIZE, 2 * SIZE)

    # Files being served stay, even over the cap; each goes once released, least recently served first.
    v4, v5 = _get(cache, 4, calls), _get(cache, 5, calls)
    assert _on_disk(tmp_path) == ["v3", "v4", "v5"] and cache.stats.bytes == 3 * SIZE
    cache.release(held)
    assert _on_disk(tmp_path) == ["v4", "v5"]
    cache.release(v4)
    cache.release(v5)
    assert _on_disk(tmp_path) == ["v4", "v5"] and cache.stats.evictions == 3
    restarted = AdapterCache(tmp_path, max_bytes=SIZE)  # a restart with a smaller cap keeps the newest file
    assert _on_disk(tmp_path) == ["v5"] and restarted.stats.files == 1


def test_a_file_is_hashed_once_not_on_every_hit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[Path] = []
    real = cache_module.sha_of
    monkeypatch.setattr(cache_module, "sha_of", lambda p: hashed.append(p) or real(p))
    cache, calls = AdapterCache(tmp_path), []
    for _ in range(3):
        cache.release(_get(cache, 1, calls))
    assert calls == [1] and hashed == []  # hashed while it was written, then trusted by its stamp
    restarted = AdapterCache(tmp_path)
    for _ in range(3):
        restarted.release(_get(restarted, 1, calls))
    assert calls == [1] and len(hashed) == 1  # once after the restart
    (path,) = tmp_path.glob("r1/*.tar")
    path.write_bytes(_body(9))  # rewritten: its stamp changed, so it is hashed, found wrong, fetched again
    restarted.release(_get(restarted, 1, calls))
    assert calls == [1, 1] and len(hashed) == 2 and path.read_bytes() == _body(1)
    assert (restarted.stats.corrupt, restarted.stats.verified) == (1, 2)


def test_partial_files_of_a_killed_relay_are_removed_at_start(tmp_path: Path) -> None:
    (tmp_path / "r1").mkdir()
    part = tmp_path / "r1" / ".v1.abc.tar.1234.part"
    part.write_bytes(b"half")
    assert AdapterCache(tmp_path).stats.files == 0 and not part.exists()
    assert os.listdir(tmp_path / "r1") == []


def _slow_fetch(parts: list[bytes], gate: asyncio.Event, fail: bool = False):
    """The first part at once, the rest once ``gate`` opens (or a link failure instead, ``fail``)."""

    async def fetch() -> AsyncIterator[bytes]:
        yield parts[0]
        await gate.wait()
        if fail:
            raise ConnectionResetError("the slow link went down mid-body")
        for p in parts[1:]:
            yield p

    return fetch


def test_callers_of_a_fetch_under_way_get_its_bytes_as_they_arrive(tmp_path: Path) -> None:
    """Cut-through: two callers of a version being fetched each get the first part while the rest has not come
    yet, then the whole tar; the file is cached for the next caller, and the descriptor they read is closed."""
    parts = [os.urandom(3000), os.urandom(5000)]
    sha = hashlib.sha256(b"".join(parts)).hexdigest()
    cache = AdapterCache(tmp_path)

    async def main() -> None:
        gate = asyncio.Event()
        fetch = _slow_fetch(parts, gate)
        followers = [await asyncio.wait_for(cache.open("r1", 1, sha, fetch), 5) for _ in range(2)]  # not the whole
        assert all(isinstance(f, cache_module.Follower) for f in followers)
        streams = [f.chunks() for f in followers]  # type: ignore[union-attr]
        firsts = [await anext(s) for s in streams]
        assert firsts == [parts[0]] * 2  # before the rest exists anywhere
        gate.set()
        rests = [b"".join([c async for c in s]) for s in streams]
        assert rests == [parts[1]] * 2
        flight = followers[0].flight  # type: ignore[union-attr]
        assert flight.rfd is None  # closed with the last reader
        e = await cache.open("r1", 1, sha, fetch)
        assert isinstance(e, Entry) and e.path.read_bytes() == b"".join(parts)

    asyncio.run(main())
    assert (cache.stats.upstream_fetches, cache.stats.streamed, cache.stats.hits) == (1, 2, 1)


@pytest.mark.parametrize("how", ["link dropped", "wrong sha256"])
def test_a_fetch_that_fails_under_its_followers_cuts_their_answers_short(tmp_path: Path, how: str) -> None:
    """A follower never gets what looks like a whole tar from a fetch that failed (the link dropped mid-body, or
    the bytes hash wrong at the end): its stream raises, and nothing is cached."""
    parts = [os.urandom(3000), os.urandom(5000)]
    sha = hashlib.sha256(b"".join(parts) + (b"x" if how == "wrong sha256" else b"")).hexdigest()
    cache = AdapterCache(tmp_path)

    async def main() -> None:
        gate = asyncio.Event()
        follower = await asyncio.wait_for(
            cache.open("r1", 1, sha, _slow_fetch(parts, gate, fail=how == "link dropped")), 5
        )
        assert isinstance(follower, cache_module.Follower)
        got: list[bytes] = []
        gate.set()
        with pytest.raises(cache_module.Truncated):
            async for chunk in follower.chunks():
                got.append(chunk)
        assert b"".join(got) in (parts[0], b"".join(parts))  # what it had, never more, never announced complete

    asyncio.run(main())
    assert cache.stats.files == 0 and not list(tmp_path.glob("r1/*"))
