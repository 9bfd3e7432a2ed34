"""The relay's on-disk adapter cache: one file per (run, version, sha256), verified on every read.

A cache, nothing more: a relay that restarts finds its files again (each is re-hashed before it is served) and
one that loses them fetches them again. Concurrent misses of one version share a single upstream fetch (single
flight), so a publish that every generator of a region asks for at once crosses the slow link once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("bucketrl.relay.cache")

CHUNK = 1 << 20

Fetch = Callable[[], AsyncIterator[bytes]]  # the upstream body, opened when iterated


class Mismatch(Exception):
    """What came from upstream does not hash to the sha256 it advertised."""


def sha_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Stats:
    upstream_fetches: int = 0
    upstream_bytes: int = 0
    hits: int = 0  # served from a verified file
    shared: int = 0  # served by another caller's fetch (single flight)
    corrupt: int = 0


@dataclass
class AdapterCache:
    root: Path
    stats: Stats = field(default_factory=Stats)
    _flights: dict[Path, asyncio.Task[None]] = field(default_factory=dict)

    def path(self, run: str, version: int, sha: str) -> Path:
        return self.root / run / f"v{version}.{sha}.tar"

    async def ensure(self, run: str, version: int, sha: str, fetch: Fetch) -> Path:
        """The verified file of this version, fetched (once, whoever else asks meanwhile) if absent or corrupt."""
        path = self.path(run, version, sha)
        if path.exists():
            got = await asyncio.to_thread(sha_of, path)
            if got == sha:
                self.stats.hits += 1
                return path
            self.stats.corrupt += 1
            log.warning("relay cache: %s hashes to %s, not %s; fetching it again", path, got, sha)
            path.unlink(missing_ok=True)
        flight = self._flights.get(path)
        if flight is not None:
            self.stats.shared += 1
        else:
            flight = asyncio.create_task(self._fetch(path, sha, fetch))
            self._flights[path] = flight
            flight.add_done_callback(lambda _: self._flights.pop(path, None))
        await asyncio.shield(flight)  # a caller that goes away does not cancel the others' fetch
        return path

    async def _fetch(self, path: Path, sha: str, fetch: Fetch) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
        h, n = hashlib.sha256(), 0
        self.stats.upstream_fetches += 1
        try:
            with tmp.open("wb") as out:
                async for chunk in fetch():
                    out.write(chunk)
                    h.update(chunk)
                    n += len(chunk)
            self.stats.upstream_bytes += n
            if h.hexdigest() != sha:
                raise Mismatch(f"{path.name}: upstream sent {n} bytes hashing to {h.hexdigest()}")
            os.replace(tmp, path)  # whole or absent: a reader never sees a partial file under the final name
            log.info("relay cache: fetched %s (%d bytes)", path, n)
        finally:
            tmp.unlink(missing_ok=True)
