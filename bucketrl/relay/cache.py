"""The relay's on-disk adapter cache: one file per (run, version, sha256), capped in bytes, least recently
served evicted first.

A cache, nothing more: a relay that restarts finds its files again and one that loses them fetches them again.
Concurrent misses of one version share a single upstream fetch (single flight), so a publish that every
generator of a region asks for at once crosses the slow link once. Its callers do not wait for the whole tar:
each is sent the bytes as they arrive (cut-through, :class:`Follower`), so the region's fan-out overlaps the
slow link's transfer instead of following it. Those bytes are not verified yet when they leave; the caller
checks them against the sha256 header, and a fetch that fails or hashes wrong aborts every follower's answer
mid-body (the caller sees a truncated response and asks again).

Integrity without re-hashing every hit: a file is hashed once as it is written (it only appears under its final
name when it hashed right) and once more on its first use after a restart; each hit then checks that the file is
still the one hashed (inode, size, mtime), so anything that rewrote it is caught and the file re-hashed. What a
stat cannot see (a bit rotting in place) the caller catches: every worker checks the sha256 header against the
bytes it got, and asks again with ``Cache-Control: no-cache``, which makes the relay hash its file before
serving it (``fresh``).

Eviction never touches a file being served (``readers``): the cache may stand over its cap while every file is
in use, and shrinks as they are released.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("bucketrl.relay.cache")

CHUNK = 1 << 20

Fetch = Callable[[], AsyncIterator[bytes]]  # the upstream body, opened when iterated
Stamp = tuple[int, int, int]  # (inode, size, mtime_ns) of a file as it was hashed


class Mismatch(Exception):
    """What came from upstream does not hash to the sha256 it advertised."""


def sha_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_all(out: BinaryIO, chunk: bytes) -> None:
    view = memoryview(chunk)
    while view:
        view = view[out.write(view) or 0 :]


def stamp_of(path: Path) -> Stamp | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class Stats:
    upstream_fetches: int = 0  # asked for by a caller (not staged)
    staged_fetches: int = 0  # pulled from a staged upload before its commit (staging.py)
    staged_dropped: int = 0  # of those, ended short (the publish failed) or wrong: nothing kept
    bucket_fetches: int = 0  # of those, read straight from the bucket (presigned URLs)
    upstream_bytes: int = 0
    hits: int = 0  # served from a cached file
    shared: int = 0  # served by another caller's fetch (single flight)
    streamed: int = 0  # of the callers of a fetch, those sent its bytes while it was still under way
    verified: int = 0  # cached files hashed again (first use after a restart, a changed stamp, no-cache)
    corrupt: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    files: int = 0
    bytes: int = 0
    # The last RECENT_FETCHES upstream fetches: sha256, bytes and wall times (requested, first byte, last byte),
    # so a reader can tell a version's time on the slow link from its wait before it (bench/wan.py reads them).
    recent_fetches: list[dict[str, object]] = field(default_factory=list)

    def fetched(self, sha: str, n: int, started: float, first: float | None, last: float, staged: bool) -> None:
        self.recent_fetches.append(
            {
                "sha256": sha,
                "bytes": n,
                "started": started,
                "first_byte": first or last,
                "last_byte": last,
                "staged": staged,
            }
        )
        del self.recent_fetches[:-RECENT_FETCHES]


RECENT_FETCHES = 64


@dataclass
class Entry:
    path: Path
    size: int
    stamp: Stamp | None  # None: found on disk at start, not hashed yet by this process
    readers: int = 0


class Truncated(Exception):
    """The fetch a follower was streaming failed: its answer must end short, never look complete."""


@dataclass
class Flight:
    """One upstream fetch under way. Its bytes go to ``tmp`` and, as they land, to its followers: each reads
    them with ``pread`` on its own duplicate of the descriptor opened with the file, which stays valid when the
    file is renamed into place or unlinked after a failure, so a follower never races the rename."""

    tmp: Path
    task: asyncio.Task[None] | None = None
    rfd: int | None = None  # the fetch's own; closed when it ends (followers hold duplicates)
    written: int = 0
    streaming: asyncio.Event = field(default_factory=asyncio.Event)  # the first bytes are on disk
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # replaced on every write

    def wrote(self, n: int) -> None:
        self.written += n
        self.streaming.set()
        self._wake()

    def _wake(self) -> None:
        old, self.progress = self.progress, asyncio.Event()
        old.set()

    def ended(self) -> None:
        self._wake()
        if self.rfd is not None:
            os.close(self.rfd)
            self.rfd = None


class Follower:
    """A caller streaming a fetch under way (cut-through). Its descriptor is closed when its stream ends, or when
    the follower is collected: an answer whose stream never started (the caller gone first) leaks nothing."""

    def __init__(self, flight: Flight) -> None:
        assert flight.rfd is not None  # the fetch has written bytes and has not ended
        self.flight, self.fd = flight, os.dup(flight.rfd)
        self.close = weakref.finalize(self, os.close, self.fd)

    async def chunks(self) -> AsyncIterator[bytes]:
        flight, offset = self.flight, 0
        try:
            while True:
                woken = flight.progress
                if offset < flight.written:
                    data = os.pread(self.fd, min(CHUNK, flight.written - offset), offset)
                    offset += len(data)
                    yield data
                    continue
                task = flight.task
                if task is not None and task.done():
                    if task.cancelled() or task.exception() is not None:
                        raise Truncated(f"the fetch of {flight.tmp.name} failed after {offset} bytes")
                    return
                await woken.wait()
        finally:
            self.close()


@dataclass
class AdapterCache:
    root: Path
    max_bytes: int = 0  # 0: no cap
    stats: Stats = field(default_factory=Stats)
    _entries: OrderedDict[Path, Entry] = field(default_factory=OrderedDict)  # least recently served first
    _flights: dict[Path, Flight] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Files a previous run left are cached again (oldest first, to be hashed on first use); partial ones go."""
        found: list[tuple[int, Path, int]] = []
        for p in self.root.glob("*/*"):
            if p.name.endswith(".part"):
                p.unlink(missing_ok=True)
            elif p.name.endswith(".tar") and p.is_file():
                st = p.stat()
                found.append((st.st_mtime_ns, p, st.st_size))
        for _, p, size in sorted(found):
            self._entries[p] = Entry(p, size, None)
        self._count()
        self._prune()

    def path(self, run: str, version: int, sha: str) -> Path:
        return self.root / run / f"v{version}.{sha}.tar"

    async def acquire(self, run: str, version: int, sha: str, fetch: Fetch, fresh: bool = False) -> Entry:
        """The verified file of this version, held for serving until :meth:`release`; fetched (once, whoever else
        asks meanwhile) if absent or corrupt. ``fresh``: hash the cached file before trusting it."""
        got = await self.open(run, version, sha, fetch, fresh=fresh, follow=False)
        assert isinstance(got, Entry)
        return got

    async def open(
        self, run: str, version: int, sha: str, fetch: Fetch, fresh: bool = False, follow: bool = True
    ) -> Entry | Follower:
        """As :meth:`acquire`, but while a fetch of the version is under way (``follow``) the caller gets a
        :class:`Follower` of it as soon as its first bytes are on disk, instead of waiting for the last."""
        path = self.path(run, version, sha)
        while True:
            e = self._entries.get(path)
            if e is not None and not fresh and e.stamp is not None and stamp_of(path) == e.stamp:
                self.stats.hits += 1
                return self._hold(path, e)
            flight = self._flights.get(path)
            if flight is not None:
                self.stats.shared += 1
            else:
                flight = self._start(path, sha, fetch, check=e is not None)
            task = flight.task
            assert task is not None
            if follow:
                streaming = asyncio.ensure_future(flight.streaming.wait())
                try:  # asyncio.wait never cancels what it waits on: a caller going away leaves the fetch be
                    await asyncio.wait([task, streaming], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    streaming.cancel()
                if flight.streaming.is_set() and not task.done():
                    self.stats.streamed += 1
                    return Follower(flight)
            await asyncio.shield(task)
            e = self._entries.get(path)
            if e is not None:  # else evicted before this caller resumed (a tiny cap): once more
                return self._hold(path, e)
            fresh = False

    async def stage(self, run: str, version: int, sha: str, fetch: Fetch) -> None:
        """Pull a staged upload into the file a download of the committed version will use (callers asking
        meanwhile follow it); nothing when that file or a fetch of it is here already. Raises what the fetch
        raised (a publish that failed ends it short: its partial file is gone)."""
        path = self.path(run, version, sha)
        if path in self._entries or path in self._flights:
            return
        flight = self._start(path, sha, fetch, check=False, staged=True)
        assert flight.task is not None
        await asyncio.shield(flight.task)

    def _start(self, path: Path, sha: str, fetch: Fetch, check: bool, staged: bool = False) -> Flight:
        flight = Flight(path.with_name(f".{path.name}.{uuid.uuid4().hex}.part"))
        flight.task = asyncio.create_task(self._settle(path, sha, fetch, check, flight, staged))
        self._flights[path] = flight
        flight.task.add_done_callback(lambda _: self._flights.pop(path, None))
        return flight

    def in_flight(self) -> dict[str, int]:
        """The bytes on disk so far of each fetch under way, by its file's name."""
        return {path.name: flight.written for path, flight in self._flights.items()}

    def release(self, e: Entry) -> None:
        e.readers = max(0, e.readers - 1)
        self._prune()

    def _hold(self, path: Path, e: Entry) -> Entry:
        e.readers += 1
        self._entries.move_to_end(path)
        return e

    async def _settle(self, path: Path, sha: str, fetch: Fetch, check: bool, flight: Flight, staged: bool) -> None:
        """Hash the cached file (``check``) and keep it if it is right; else fetch it."""
        if check:
            stamp = stamp_of(path)
            got = await asyncio.to_thread(sha_of, path) if stamp is not None else None
            self.stats.verified += 1
            e = self._entries.get(path)
            if got == sha and e is not None and stamp_of(path) == stamp:
                e.stamp = stamp
                self.stats.hits += 1  # served from the cache all the same
                return
            self.stats.corrupt += got is not None
            log.warning("relay cache: %s hashes to %s, not %s; fetching it again", path, got, sha)
            self._drop(path)
        try:
            await self._fetch(path, sha, fetch, flight, staged)
        finally:
            flight.ended()

    async def _fetch(self, path: Path, sha: str, fetch: Fetch, flight: Flight, staged: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = flight.tmp
        h, n = hashlib.sha256(), 0
        if staged:
            self.stats.staged_fetches += 1
        else:
            self.stats.upstream_fetches += 1
        started, first, kept = time.time(), None, False
        try:
            # Unbuffered: a follower reads what ``written`` counts through its own descriptor.
            with tmp.open("wb", buffering=0) as out:
                flight.rfd = os.open(tmp, os.O_RDONLY)
                async for chunk in fetch():
                    first = first or time.time()
                    _write_all(out, chunk)
                    h.update(chunk)
                    n += len(chunk)
                    flight.wrote(len(chunk))
            self.stats.upstream_bytes += n
            self.stats.fetched(sha, n, started, first, time.time(), staged)
            if h.hexdigest() != sha:
                raise Mismatch(f"{path.name}: upstream sent {n} bytes hashing to {h.hexdigest()}")
            os.replace(tmp, path)  # whole or absent: a reader never sees a partial file under the final name
            self._entries[path] = Entry(path, n, stamp_of(path))
            log.info("relay cache: fetched %s (%d bytes%s)", path, n, ", staged" if staged else "")
            kept = True
        finally:
            tmp.unlink(missing_ok=True)
            self.stats.staged_dropped += staged and not kept
        self._count()
        self._prune()

    def _drop(self, path: Path) -> None:
        self._entries.pop(path, None)
        path.unlink(missing_ok=True)
        self._count()

    def _prune(self) -> None:
        """Evict least recently served files, none in use, until the cache fits its cap."""
        if not self.max_bytes:
            return
        for path, e in list(self._entries.items()):
            if self.stats.bytes <= self.max_bytes:
                break
            if e.readers or path in self._flights:
                continue
            self._drop(path)
            self.stats.evictions += 1
            self.stats.evicted_bytes += e.size
            log.info("relay cache: evicted %s (%d bytes, over the %d-byte cap)", path, e.size, self.max_bytes)

    def _count(self) -> None:
        self.stats.files = len(self._entries)
        self.stats.bytes = sum(e.size for e in self._entries.values())
