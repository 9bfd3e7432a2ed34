"""The prompt state's snapshot in the bucket (with the queue's counters), and its restore after a Redis wipe.

Persistence (a Redis wipe must not restart the dataset)
-------------------------------------------------------
``runs/{run}/prompts.json`` holds ``cursor``, ``reserved`` (a high-water mark >= every position handed out
so far), the ``open`` prompts and the live leases. A lease that moves the cursor past the persisted
``reserved`` mark rewrites the snapshot (reserving ``RESERVE_AHEAD`` more positions) BEFORE it answers, so
one bucket write covers many leases. Every ack or claim that settles groups persists it (the cleaner, in the
background), and before a fully settled batch object (the only other record of its prompts' completion)
is deleted. The snapshot also carries the queue's state, read atomically with the prompts: the lifetime
counters, each live batch's settled groups and the finished batches not deleted yet (``state/restore.py``
restores the counters and the queue from it). A rebuild (``restore``) therefore sets the
cursor to ``reserved``, treats ``open`` plus every position in ``[cursor, reserved)`` as to-be-reissued, and
drops from that the prompts of batches still in the bucket (they completed): nothing skipped, and at worst
a prompt completed after the last snapshot whose batch is still queued is not repeated either.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from redis import exceptions as redis_exc

from bucketrl import errors
from bucketrl.proxy import keys
from bucketrl.proxy.state.clock import redis_now
from bucketrl.proxy.state.lua import Lua
from bucketrl.proxy.state.prompts import PromptKeys, admission_limit, as_str, parse_prompt_id, redropped_key
from bucketrl.storage.base import BucketStore
from bucketrl.wire import RunSpec

log = logging.getLogger("bucketrl.proxy.prompts")

# How many positions past the cursor one snapshot write reserves (bounds bucket writes to 1 per this many).
RESERVE_AHEAD = 256
# How far a restore moves the state's seq past its snapshot's: far more than the changes (leases, submits) a wiped
# Redis can have made since its last snapshot was written (every settle writes one).
RESTORE_SEQ_STRIDE = 1_000_000
_LOCK_TTL_MS = 30_000
_LOCK_WAIT_S = 15.0

_SNAPSHOT = Lua.load("prompt_snapshot.lua")

_MARK_PERSISTED = Lua.load("prompt_mark_persisted.lua")

_UNLOCK = Lua.load("unlock.lua")


def snapshot_key(run: str) -> str:
    """The single snapshot object older proxies wrote (read when the run has no numbered one yet)."""
    return f"runs/{run}/prompts.json"


def snapshot_prefix(run: str) -> str:
    return f"runs/{run}/prompts/"


def numbered_snapshot_key(run: str, seq: int) -> str:
    """Each snapshot is its own object, named by its state seq: a slow writer's older snapshot landing late can
    never replace a newer one (a restore reads the highest seq), whatever happened to the writers' lock."""
    return f"{snapshot_prefix(run)}{seq:016d}.json"


def _numbered_snapshots(store: BucketStore, run: str) -> list[tuple[int, str]]:
    out = []
    for key in store.list_keys(snapshot_prefix(run)):
        name = key.rsplit("/", 1)[1]
        if name.endswith(".json") and name[:-5].isdigit():
            out.append((int(name[:-5]), key))
    return sorted(out)


async def persist(
    r: Any, store: BucketStore, run: str, spec: RunSpec, *, min_reserved: int = 0, min_seq: int = 0
) -> None:
    """Make ``runs/{run}/prompts.json`` cover at least cursor ``min_reserved`` and state ``min_seq``.

    One writer at a time per run (a Redis lock), and the written snapshot is read under the lock, so a
    slow writer can never overwrite a newer snapshot with an older one. Callers in one process first wait
    for a persist already in progress there: under load many acks want a snapshot at once, and the next one
    written covers them all (group commit) instead of each polling the Redis lock every few milliseconds.
    """
    deadline = time.monotonic() + _LOCK_WAIT_S
    running = persists_running(r)
    while (task := running.get(run)) is not None:
        try:  # the shield: a waiter that gives up never cancels the write others wait for
            reserved, seq = await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - time.monotonic()))
            if reserved >= min_reserved and seq >= min_seq:
                return  # that write covers this caller too
        except TimeoutError:
            raise errors.Unavailable(f"run {run!r}: timed out waiting to persist the prompt cursor") from None
        except Exception:
            pass  # that caller's failure is reported to it; this one tries itself
        finally:
            # Awaiting a finished task need not yield (Python >= 3.12), so its done callback may not have run:
            # forget it here, or this loop would spin on it forever without ever giving the loop a turn.
            if task.done() and running.get(run) is task:
                running.pop(run)
    task = asyncio.ensure_future(
        _persist(r, store, run, spec, min_reserved=min_reserved, min_seq=min_seq, deadline=deadline)
    )
    running[run] = task
    task.add_done_callback(lambda done: running.pop(run) if running.get(run) is done else None)
    await asyncio.shield(task)  # a caller that goes away (client disconnect) leaves the write to finish


def persists_running(r: Any) -> dict[str, asyncio.Future[tuple[int, int]]]:
    """Run -> the persist in progress in this process over the Redis client ``r``: kept on the client (as its
    ``bucketrl_mux`` is), so each app has its own and none outlives it."""
    running: dict[str, asyncio.Future[tuple[int, int]]] | None = getattr(r, "bucketrl_persists", None)
    if running is None:
        running = {}
        r.bucketrl_persists = running
    return running


async def _persist(
    r: Any, store: BucketStore, run: str, spec: RunSpec, *, min_reserved: int, min_seq: int, deadline: float
) -> tuple[int, int]:
    """Returns the (reserved, seq) that prompts.json is known to cover now ((0, 0): not known)."""
    k = PromptKeys.of(run)
    token = secrets.token_hex(8)
    while True:
        meta = await r.hmget(k.meta, "persisted_reserved", "persisted_seq")
        if int(meta[0] or 0) >= min_reserved and int(meta[1] or 0) >= min_seq:
            return int(meta[0] or 0), int(meta[1] or 0)
        if await r.set(k.lock, token, nx=True, px=_LOCK_TTL_MS):
            break
        if time.monotonic() > deadline:
            raise errors.Unavailable(f"run {run!r}: timed out waiting to persist the prompt cursor")
        await asyncio.sleep(0.005)
    try:
        snap = await _SNAPSHOT(
            r,
            [k.cursor, k.inflight, k.owner, k.open, k.meta, k.queue_meta, k.counters, *_queue_keys(run), k.usage],
            [],
        )
        if not snap:
            raise errors.Unavailable(f"run {run!r}: prompt state is not in Redis (being restored); retry")
        cur, seq, reserved, open_ids, leased, owners, counters, remaining, settled, doomed, redropped, usage = snap
        cur, seq = int(cur), int(seq)
        new_reserved = max(int(reserved), cur + max(RESERVE_AHEAD, admission_limit(spec)))
        leases = {as_str(leased[i]): [float(leased[i + 1]), as_str(owners[i // 2])] for i in range(0, len(leased), 2)}
        snapshot = {
            "format": 1,
            "run": run,
            "dataset_size": spec.dataset.size,
            "cursor": cur,
            "reserved": new_reserved,
            "seq": seq,
            "open": sorted((as_str(p) for p in open_ids), key=_position_key(spec.dataset.size)),
            "leases": leases,
            "written_at": time.time(),
            "queue": _queue_section(counters, remaining, settled, doomed, redropped, usage),
        }
        body = json.dumps(snapshot, separators=(",", ":")).encode()
        await asyncio.to_thread(store.put_bytes, numbered_snapshot_key(run, seq), body)
        marked = await _MARK_PERSISTED(r, [k.meta, k.lock], [new_reserved, seq, token])
        await asyncio.to_thread(_prune_snapshots, store, run, seq)
        return (new_reserved, seq) if int(marked) else (0, 0)
    finally:
        await _UNLOCK(r, [k.lock], [token])


def _prune_snapshots(store: BucketStore, run: str, seq: int) -> None:
    """Delete the snapshots older than ``seq`` (now in the bucket), and the legacy single object."""
    try:
        old = [key for s, key in _numbered_snapshots(store, run) if s < seq]
        store.delete([*old, snapshot_key(run)])
    except errors.BucketRLError as exc:  # the next persist prunes them; a restore reads the newest anyway
        log.warning("run %r: pruning old prompt snapshots failed: %s", run, exc.message)


def _queue_keys(run: str) -> tuple[str, str, str, str]:
    """The queue's remaining / settled / doomed / redropped hashes (named here: state/queue.py builds on this
    module)."""
    k = keys.run_key
    return k(run, "queue:remaining"), k(run, "queue:settled"), k(run, "queue:doomed"), redropped_key(run)


def _queue_section(
    counters: list[Any],
    remaining: list[Any],
    settled: list[Any],
    doomed: list[Any],
    redropped: list[Any],
    usage: list[Any],
) -> dict[str, Any]:
    """The queue's part of a snapshot, read atomically with the prompts: the run's lifetime counters, each live
    batch's unsettled count and settled groups, the finished batches whose objects are not deleted yet, and the
    rebuilt deliveries dropped as stale that an ack may still move to acked.
    A rebuild restores the counters from it and re-enqueues exactly the groups it shows unsettled."""
    pairs = {as_str(remaining[i]): int(remaining[i + 1]) for i in range(0, len(remaining), 2)}
    done = {as_str(settled[i]): as_str(settled[i + 1]) for i in range(0, len(settled), 2)}
    return {
        "counters": {as_str(counters[i]): int(counters[i + 1]) for i in range(0, len(counters), 2)},
        # The run's cost so far (worker seconds by class, dollars): a rebuild continues it, as the counters.
        "cost_usage": {as_str(usage[i]): float(usage[i + 1]) for i in range(0, len(usage), 2)},
        "live": {
            b: {"remaining": n, "settled": sorted({int(g) for g in done.get(b, "").split(",") if g})}
            for b, n in sorted(pairs.items())
        },
        "doomed": sorted(as_str(b) for b in doomed),
        "redropped": sorted(as_str(d) for d in redropped),
    }


def _position_key(size: int) -> Callable[[str], int]:
    def key(pid: str) -> int:
        parsed = parse_prompt_id(pid)
        return parsed[0] * size + parsed[1] if parsed else -1

    return key


async def is_ready(r: Any, run: str) -> bool:
    """True once this Redis holds the run's prompt state (restored from the bucket, or started fresh)."""
    return bool(await r.hexists(PromptKeys.of(run).meta, "ready"))


def read_snapshot(store: BucketStore, run: str) -> bytes | None:
    """The run's newest snapshot (None when it has none). Blocking: call in a thread."""
    for _ in range(5):
        numbered = _numbered_snapshots(store, run)
        if not numbered:
            break
        try:
            return store.get_bytes(numbered[-1][1])
        except errors.NotFound:
            continue  # pruned by a writer of a newer one meanwhile: list again
    try:
        return store.get_bytes(snapshot_key(run))
    except errors.NotFound:
        return None


async def restore(r: Any, run: str, spec: RunSpec, completed: set[str], raw: bytes | None) -> int | None:
    """Make the prompt state ready: from the snapshot ``raw`` if the bucket has one (after Redis lost it), else fresh.

    ``completed``: prompt ids of rollout batches still in the bucket (accepted, so completed). Every other
    prompt that may have been handed out and is not known complete is issued again, in dataset order.
    Returns the restored cursor, or None when another caller made the state ready first. Idempotent.
    """
    k = PromptKeys.of(run)
    async with r.pipeline(transaction=True) as pipe:
        try:
            await pipe.watch(k.meta, k.cursor)
            if await pipe.hexists(k.meta, "ready"):
                return None
            if await pipe.exists(k.cursor) or raw is None:
                # Redis has a cursor without the flag (state from before the flag existed), or nothing to
                # restore (a new run): what Redis holds is the truth.
                pipe.multi()
                pipe.hset(k.meta, "ready", 1)
                await pipe.execute()
                return None if raw is None else 0
            snap = json.loads(raw)
            now = await redis_now(pipe)  # (immediate while watching: not queued)
            pipe.multi()
            _restore_commands(pipe, k, snap, spec, completed, now)
            await pipe.execute()
            return int(snap["reserved"])
        except redis_exc.WatchError:
            return None


def _restore_commands(
    pipe: Any, k: PromptKeys, snap: dict[str, Any], spec: RunSpec, completed: set[str], now: float
) -> None:
    size = spec.dataset.size
    if int(snap.get("dataset_size", size)) != size:
        raise errors.Conflict(f"prompts.json was written for dataset size {snap['dataset_size']}, the run has {size}")
    snap_cursor, reserved = int(snap["cursor"]), int(snap["reserved"])
    open_ids = [p for p in snap.get("open", []) if parse_prompt_id(p) is not None]
    # Positions handed out after the snapshot was written, at most up to the reserved mark.
    open_ids += [f"{pos // size}-{pos % size}" for pos in range(snap_cursor, reserved)]
    leases = {p: v for p, v in snap.get("leases", {}).items() if float(v[0]) > now}
    pipe.delete(k.inflight, k.owner, k.reissue, k.open)
    pipe.set(k.cursor, reserved)
    # The rebuilt state's seq jumps far past the snapshot's: a persist that read the state before the wipe may land
    # its snapshot (numbered with the old, higher seq) after this restore read the older one; the rebuilt state's
    # snapshots must still be numbered above it, or a restore would read that stale one and its writer's prune
    # would delete the rebuilt state's.
    pipe.hset(
        k.meta,
        mapping={
            "seq": int(snap.get("seq", 0)) + RESTORE_SEQ_STRIDE,
            "persisted_seq": 0,
            "persisted_reserved": reserved,
            "ready": 1,
        },
    )
    seen: set[str] = set()
    for pid in open_ids:
        if pid in completed or pid in seen:
            continue
        seen.add(pid)
        pipe.sadd(k.open, pid)
        if pid in leases:
            pipe.zadd(k.inflight, {pid: float(leases[pid][0])})
            pipe.hset(k.owner, pid, str(leases[pid][1]))
        else:
            pipe.rpush(k.reissue, pid)
