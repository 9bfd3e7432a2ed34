"""Settling batch objects in the bucket once Redis has settled their groups (acked, dropped or lost).

Every settle moves the state's seq on, and ``prompts.json`` must then reach it: the snapshot records the
prompts, which groups of each live batch are settled, and the run's lifetime counters (a rebuild after a
Redis wipe restores all three from it, so ``accepted = acked + dropped + lost + queued + pending`` holds
over the run's whole life). When the last group of a batch is settled, its object
``runs/{run}/rollouts/{batch_id}`` must go, or a rebuild would enqueue it again; it goes only after a
snapshot that shows it settled (the object was the only other record of its prompts and its groups).

The ack and claim scripts record every batch they finish in ``queue:doomed`` (batch -> the seq the snapshot
must reach first), in the same atomic step that settles it. The bucket work then happens off the request
path: :class:`BatchCleaner` (one per app) persists the snapshot once for everything waiting, deletes the
objects in one thread hop, and removes the batches from ``queue:doomed``. An ack or claim therefore answers
after its Redis script alone. A proxy that dies before its cleaner finished leaves the batches in
``queue:doomed``; the maintenance loop's :func:`sweep` finishes them (any replica). (``{batch_id}.done``
markers, written by older proxies for partly settled batches, are deleted with their batch.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bucketrl.proxy import keys
from bucketrl.proxy.state import snapshot
from bucketrl.storage.base import BucketStore
from bucketrl.wire import RunSpec

log = logging.getLogger("bucketrl.proxy.cleanup")

SpecSource = RunSpec | Callable[[], Awaitable[RunSpec]]


def batch_key(run: str, batch_id: str) -> str:
    return f"runs/{run}/rollouts/{batch_id}"


def marker_key(run: str, batch_id: str) -> str:
    return f"runs/{run}/rollouts/{batch_id}.done"


def doomed_key(run: str) -> str:
    """Redis hash: finished batch -> prompt-state seq that prompts.json must reach before its object goes."""
    return keys.run_key(run, "queue:doomed")


async def _spec_of(spec: SpecSource) -> RunSpec:
    return spec if isinstance(spec, RunSpec) else await spec()


def _delete(store: BucketStore, run: str, finished: list[str]) -> None:
    """Delete finished objects (and an older proxy's markers) in one thread hop."""
    store.delete([key for b in finished for key in (batch_key(run, b), marker_key(run, b))])


async def settle_objects(
    r: Any, store: BucketStore, run: str, spec: SpecSource, finished: list[str], persist_seq: int
) -> None:
    """Persist the snapshot when needed, then delete finished objects and forget their doomed entries.

    ``persist_seq``: the state seq prompts.json must reach first (0: the newest snapshot already does)."""
    if persist_seq > 0:
        await snapshot.persist(r, store, run, await _spec_of(spec), min_seq=persist_seq)
    if finished:
        # Only batches Redis still holds finished: a Redis wipe (and the rebuild from the bucket) between the
        # ack that finished a batch and this deletion may have queued its groups again (the newest snapshot did
        # not show them settled yet); deleting its object then would lose them (seen in the chaos run: 104
        # groups counted lost after a FLUSHALL). A batch left here is finished again by a later ack or claim.
        still = await r.hmget(doomed_key(run), *finished)
        finished = [b for b, mark in zip(finished, still, strict=True) if mark is not None]
    if finished:
        await asyncio.to_thread(_delete, store, run, finished)
        await r.hdel(doomed_key(run), *finished)


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


@dataclass
class _Job:
    run: str
    spec: SpecSource
    finished: list[str]
    persist_seq: int


class BatchCleaner:
    """Settles batch objects in the background, in submission order (see the module docstring)."""

    def __init__(self, r: Any, store: BucketStore) -> None:
        self._r = r
        self._store = store
        self._jobs: list[_Job] = []
        self._task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    def submit(self, run: str, spec: SpecSource, finished: list[str], persist_seq: int) -> None:
        if not finished and persist_seq <= 0:
            return
        self._jobs.append(_Job(run, spec, finished, persist_seq))
        self._idle.clear()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._work(), name="bucketrl-batch-cleaner")

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until everything submitted so far is settled (True) or ``timeout_s`` passed (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _work(self) -> None:
        try:
            while self._jobs:
                jobs, self._jobs = self._jobs, []
                for run in dict.fromkeys(j.run for j in jobs):  # runs in order of first appearance
                    mine = [j for j in jobs if j.run == run]
                    finished = [b for j in mine for b in j.finished]
                    try:
                        await settle_objects(
                            self._r, self._store, run, mine[0].spec, finished, max(j.persist_seq for j in mine)
                        )
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        # Finished batches stay in queue:doomed for the maintenance sweep; a snapshot not
                        # written only matters to a rebuild after a Redis wipe, and the next settle writes one.
                        log.warning(
                            "run %r: settling %d batch objects failed (%r); the sweep retries", run, len(finished), exc
                        )
        finally:
            if not self._jobs:
                self._idle.set()


async def sweep(r: Any, store: BucketStore, run: str, spec: RunSpec) -> int:
    """Finish what a cleaner left (a proxy that died, a bucket that was down): returns how many batches."""
    doomed = await r.hgetall(doomed_key(run))
    if not doomed:
        return 0
    finished = sorted(_s(b) for b in doomed)
    # persist() returns at once when the snapshot already reaches the largest seq.
    await settle_objects(r, store, run, spec, finished, max(int(v) for v in doomed.values()))
    log.info("run %r: swept %d settled batch objects", run, len(finished))
    return len(finished)
