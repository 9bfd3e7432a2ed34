"""Staged publish: an adapter upload's bytes, teed as they arrive, for the regional relays to pull before its commit.

Without it a version's bytes left for the regions only after the trainer's upload and the bucket commit had both
finished, so a sync cost upload + commit + slow link + load in series. Here the publish route tees the body into
a :class:`Staged` entry (memory, this process only) while it spools and commits it as before; a relay holding a
``relay`` token long-polls :meth:`Staging.wait` for new entries and streams each one's bytes into its cache as
they arrive (``bucketrl/relay/staging.py``). A generator that fetches from this proxy itself (no relay) does the
same with its own generator token, into its adapter cache (``bucketrl/generator/staging.py``).

What keeps it safe (docs/design.md, "Regional relay"): the last :data:`HOLD` bytes of an upload are withheld from
every reader until its commit succeeded, so no staged copy can be complete (nor hash to the declared sha256)
before the version exists. A publish that fails (sha256 or dtype refused, bucket write failed, version conflict,
fenced trainer, client gone) ends every reader's stream short, so a relay drops what it had, and the entry's
bytes are released here. A relay still serves a version only after the home proxy answered the caller's own
conditional GET for it (live, with that sha256): staging moves bytes early, never the moment a version is
announced, leasable or loadable.

Memory: at most ``max_bytes`` of uploads under way are staged at once (declared Content-Length); an upload that
does not fit, or declares no length, is published unstaged, as before. Entries are per proxy process: a relay
whose upstream is another replica than the one taking the trainer's upload fetches after the commit, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from bucketrl.wire.adapters import StagedUpload, StagingList

CHUNK = 1 << 20
HOLD = 1  # bytes withheld from readers until the commit: a staged copy is never whole before it


class Dropped(Exception):
    """The staged upload's publish failed: a reader's stream must end short."""


@dataclass(eq=False)
class Staged:
    info: StagedUpload
    data: bytearray = field(default_factory=bytearray)
    committed: bool | None = None  # None: the publish is under way
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # replaced on every change

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        self._wake()

    def settle(self, committed: bool) -> None:
        self.committed = committed
        if not committed:
            self.data = bytearray()  # readers stop at their next step; the bytes go now
        self._wake()

    def _wake(self) -> None:
        old, self.progress = self.progress, asyncio.Event()
        old.set()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The upload's bytes as they arrive, all but the last :data:`HOLD` until the commit; :class:`Dropped`
        (the HTTP answer then ends short) when the publish failed."""
        offset = 0
        while True:
            woken = self.progress
            if self.committed is False:
                raise Dropped(f"the publish of {self.info.run} v{self.info.version} failed")
            end = len(self.data) if self.committed else max(0, len(self.data) - HOLD)
            if offset < end:
                piece = bytes(self.data[offset : min(end, offset + CHUNK)])
                offset += len(piece)
                yield piece
                continue
            if self.committed:
                return
            await woken.wait()


class Staging:
    """The uploads under way in this proxy process, for the relays' long-poll."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.instance = uuid.uuid4().hex
        self._live: dict[str, Staged] = {}
        self._seq = 0
        self._changed = asyncio.Event()

    def begin(self, run: str, version: int, sha256: str, declared: int | None) -> Staged | None:
        """A new entry for an upload of ``declared`` bytes, or None when it does not fit (published unstaged)."""
        held = sum(s.info.bytes for s in self._live.values())
        if declared is None or declared <= HOLD or held + declared > self.max_bytes:
            return None
        self._seq += 1
        info = StagedUpload(
            run=run, version=version, upload_id=uuid.uuid4().hex, sha256=sha256, bytes=declared, seq=self._seq
        )
        staged = self._live[info.upload_id] = Staged(info)
        old, self._changed = self._changed, asyncio.Event()
        old.set()
        return staged

    def settle(self, staged: Staged, committed: bool) -> None:
        """The publish's outcome: readers under way get the rest (committed) or an end short; no new reader."""
        staged.settle(committed)
        self._live.pop(staged.info.upload_id, None)

    def get(self, upload_id: str) -> Staged | None:
        return self._live.get(upload_id)

    async def wait(
        self,
        after: int,
        instance: str,
        wait_s: float,
        visible: Callable[[str], bool],
        gone: Callable[[], Awaitable[bool]],
    ) -> StagingList:
        """The entries staged after ``after`` (every live one when ``instance`` is not this process: it
        restarted), waiting up to ``wait_s`` for one. ``visible(run) -> bool``: the caller's run scope; ``gone()``:
        whether the caller hung up (checked every second: a dead relay's poll must not hold a proxy's shutdown)."""
        if instance != self.instance:
            after = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            changed = self._changed
            new = [s.info for s in self._live.values() if s.info.seq > after and visible(s.info.run)]
            remaining = deadline - loop.time()
            if new or remaining <= 0 or await gone():
                return StagingList(instance=self.instance, seq=self._seq, uploads=new)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(remaining, 1.0))


async def teed(chunks: AsyncIterator[bytes], staged: Staged | None) -> AsyncIterator[bytes]:
    """``chunks``, each also added to ``staged`` as it passes."""
    async for chunk in chunks:
        if staged is not None:
            staged.add(chunk)
        yield chunk
