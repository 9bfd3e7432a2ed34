"""Stage 3 of a group's life: a trained delivery is acked (or, lost, settled): the stream forgets it, the
batch counts down, and a finished batch's object goes once the snapshot covers it (``state/cleanup.py``).

See ``state/queue.py`` for the whole life and the accounting these settles keep.
"""

from __future__ import annotations

from typing import Any

from bucketrl.proxy.state import cleanup
from bucketrl.proxy.state.locks import fenced_or_restoring
from bucketrl.proxy.state.lua import Lua
from bucketrl.proxy.state.queue import GROUP, QueueKeys, SpecLoader, as_str, not_ready, validate_delivery_ids
from bucketrl.proxy.state.restore import ensure_ready
from bucketrl.storage.base import BucketStore
from bucketrl.wire import RunSpec

_ACK = Lua.load("queued_groups.lua", "queue_common.lua", "ack.lua")


async def ack(
    r: Any,
    store: BucketStore,
    run: str,
    spec: RunSpec | SpecLoader,
    *,
    epoch: int,
    delivery_ids: list[str],
    cleaner: cleanup.BatchCleaner | None = None,
) -> int:
    """Acknowledge deliveries (trained). Idempotent: returns how many were acked by THIS call.

    The script fences ``epoch`` itself; ``spec`` (or a :data:`SpecLoader`) is needed only to restore a
    wiped queue or to persist prompts, so a loader is called only then. ``cleaner``: as for ``claim.claim``."""
    validate_delivery_ids(delivery_ids)
    if not delivery_ids:
        return 0
    ids = list(dict.fromkeys(delivery_ids))
    return await settle(r, store, run, spec, ids, epoch=epoch, counter="acked_total", cleaner=cleaner)


async def settle(
    r: Any,
    store: BucketStore,
    run: str,
    spec: RunSpec | SpecLoader,
    ids: list[str],
    *,
    epoch: int,
    counter: str,
    cleaner: cleanup.BatchCleaner | None = None,
) -> int:
    """Settle deliveries in one script (fenced by ``epoch``; 0 = internal), counted in ``counter``: how many
    this call settled."""
    k = QueueKeys.of(run)
    for _ in range(3):
        res = await _ACK(
            r,
            [
                *(k.stream, k.state, k.counters, k.entry, k.remaining, k.attempts, k.settled),
                *(k.p.meta, k.meta, k.bseq, k.doomed, k.owner, k.redropped, k.rebuilt, k.trained_by),
            ],
            [GROUP, epoch, counter, *ids],
        )
        if as_str(res[0]) != "notready":
            break
        spec = await spec_of(spec)
        await ensure_ready(r, store, run, spec)
    else:
        raise not_ready(run)
    if as_str(res[0]) == "fenced":
        raise await fenced_or_restoring(r, run, epoch, int(res[1]), "(ack)")
    await settle_objects(r, store, run, spec, res[3], int(res[2]), cleaner)
    return int(res[1])


async def spec_of(spec: RunSpec | SpecLoader) -> RunSpec:
    return spec if isinstance(spec, RunSpec) else await spec()


async def settle_objects(
    r: Any,
    store: BucketStore,
    run: str,
    spec: RunSpec | SpecLoader,
    finished: list[Any],
    persist_seq: int,
    cleaner: cleanup.BatchCleaner | None,
) -> None:
    """The bucket side of a script's settles (``state/cleanup.py``): in the background with a cleaner."""
    done = [as_str(b) for b in finished]
    if cleaner is not None:
        cleaner.submit(run, spec, done, persist_seq)
    else:
        await cleanup.settle_objects(r, store, run, spec, done, persist_seq)
