"""Recently downloaded adapter tars, in memory, per proxy process: one bucket read per version per replica.

At a publish every generator asks for the new version within milliseconds of the others. Without this,
each download was its own bucket read (a manifest GET and the bundle GET), so a fleet of N generators cost
2N bucket requests and N times the adapter's bytes out of the bucket per version, all at the same moment
(measured by ``bench/scale_sim.py``). A version's bytes never change (invariant 3: one name, one set of
weights), so they can be kept: the first download of a version reads the bucket, the ones arriving
meanwhile wait for that read (single flight), and the next ones are answered from memory.

What keeps it correct: the route checks in Redis that the version is live (410 after garbage collection)
before asking the cache, and the key includes the sha256 the version was committed with, so a version
number re-published after a Redis wipe with other bytes can never be answered with the old ones. The
bytes read are checked against that sha256 before they are kept. The cache holds at most ``max_bytes``
(least recently used out first); a tar bigger than that is streamed from the bucket as before.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable

Key = tuple[str, int, str]  # (run, version, sha256)


class AdapterCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._data: OrderedDict[Key, bytes] = OrderedDict()
        self._size = 0
        self._loading: dict[Key, asyncio.Future[bytes]] = {}
        self.hits = 0
        self.misses = 0

    def fits(self, size: int) -> bool:
        return 0 < size <= self.max_bytes

    async def get(self, key: Key, load: Callable[[], Awaitable[bytes]]) -> bytes:
        """The tar of ``key``: from memory, from a read in progress, or read now by ``load`` (and kept when its
        sha256 is the key's). A failed read raises to every request that waited for it; nothing is kept."""
        data = self._data.get(key)
        if data is not None:
            self._data.move_to_end(key)
            self.hits += 1
            return data
        pending = self._loading.get(key)
        if pending is not None:
            self.hits += 1
            return await asyncio.shield(pending)
        self.misses += 1
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._loading[key] = fut
        try:
            data = await load()
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            self._loading.pop(key, None)
        if not fut.done():
            fut.set_result(data)
        if hashlib.sha256(data).hexdigest() == key[2]:
            self._keep(key, data)
        return data

    def _keep(self, key: Key, data: bytes) -> None:
        if not self.fits(len(data)) or key in self._data:
            return
        self._data[key] = data
        self._size += len(data)
        while self._size > self.max_bytes:
            _, old = self._data.popitem(last=False)
            self._size -= len(old)
