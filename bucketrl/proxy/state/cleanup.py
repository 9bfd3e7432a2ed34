"""Settling batch objects in the bucket once Redis has settled their groups (acked, dropped or lost).

When the last group of a batch is settled, its object ``runs/{run}/rollouts/{batch_id}`` must go, or a
rebuild after a Redis wipe would enqueue it again; before it goes, ``prompts.json`` must show its prompts
completed (the object was their only other record; see ``state/prompts.py``). A batch settled only in part
gets a ``{batch_id}.done`` marker listing its settled groups, for the same rebuild.

The ack and claim scripts record every batch they finish in ``queue:doomed`` (batch -> the prompt-state seq
the snapshot must reach first), in the same atomic step that settles it. The bucket work then happens off
the request path: :class:`BatchCleaner` (one per app) persists the snapshot once for everything waiting,
deletes the objects in one thread hop, writes the markers, and removes the batches from ``queue:doomed``. An
ack or claim therefore answers after its Redis script alone. A proxy that dies before its cleaner finished
leaves the batches in ``queue:doomed``; the maintenance loop's :func:`sweep` finishes them (any replica).

Order is kept: one task per app works through the submissions in order, so a marker never overwrites a
newer one and a finished batch's object and marker go together.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bucketrl.proxy import keys
from bucketrl.proxy.state import prompts
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


def _apply(store: BucketStore, run: str, finished: list[str], markers: dict[str, list[int]]) -> None:
    """The bucket side, in one thread hop: delete finished objects (and their markers), write the markers."""
    if finished:
        store.delete([key for b in finished for key in (batch_key(run, b), marker_key(run, b))])
    for b, indices in markers.items():
        store.put_bytes(marker_key(run, b), json.dumps({"batch_id": b, "settled": indices}).encode())


async def settle_objects(
    r: Any,
    store: BucketStore,
    run: str,
    spec: SpecSource,
    finished: list[str],
    partial: dict[str, str],
    persist_seq: int,
) -> None:
    """Persist prompts when needed, delete finished objects, write markers, forget the doomed entries.

    ``partial``: batch -> its settled groups as the scripts keep them (``"g,g,"``); ``persist_seq``: the
    prompt-state seq prompts.json must reach first (0: the newest snapshot already does)."""
    if finished and persist_seq > 0:
        await prompts.persist(r, store, run, await _spec_of(spec), min_seq=persist_seq)
    markers = {b: sorted({int(x) for x in done.split(",") if x}) for b, done in partial.items() if b not in finished}
    if finished or markers:
        await asyncio.to_thread(_apply, store, run, finished, markers)
    if finished:
        await r.hdel(doomed_key(run), *finished)


def pairs(flat: list[Any]) -> dict[str, str]:
    """The scripts' flat ``[batch, "g,g,", ...]`` as a dict (later entries win)."""
    return {_s(flat[i]): _s(flat[i + 1]) for i in range(0, len(flat), 2)}


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


@dataclass
class _Job:
    run: str
    spec: SpecSource
    finished: list[str]
    partial: dict[str, str]
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

    def submit(
        self, run: str, spec: SpecSource, finished: list[str], partial: dict[str, str], persist_seq: int
    ) -> None:
        if not finished and not partial:
            return
        self._jobs.append(_Job(run, spec, finished, partial, persist_seq))
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
                    partial: dict[str, str] = {}
                    for j in mine:
                        partial.update(j.partial)
                    try:
                        await settle_objects(
                            self._r, self._store, run, mine[0].spec, finished, partial, max(j.persist_seq for j in mine)
                        )
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        # Finished batches stay in queue:doomed for the maintenance sweep; a lost marker
                        # only matters to a rebuild after a Redis wipe, and the next settle rewrites it.
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
    await settle_objects(r, store, run, spec, finished, {}, max(int(v) for v in doomed.values()))
    log.info("run %r: swept %d settled batch objects", run, len(finished))
    return len(finished)
