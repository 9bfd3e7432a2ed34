"""After a Redis wipe: the queue and the prompt cursor rebuilt from the bucket (:func:`ensure_ready`).

See ``state/queue.py`` (readiness) and ``state/snapshot.py`` (the snapshot the counters continue from).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
from redis import exceptions as redis_exc

from bucketrl import errors
from bucketrl.proxy.state import snapshot
from bucketrl.proxy.state.queue import GROUP, IDEMPOTENCY_TTL_S, QueueKeys, batch_key, check_format, marker_key
from bucketrl.storage.base import BucketStore
from bucketrl.wire import RunSpec, SubmitResponse

log = logging.getLogger("bucketrl.proxy.queue")

# (accepted_at, batch id, the object, the group indices its marker lists as settled), oldest first
Loaded = list[tuple[float, str, dict[str, Any], set[int]]]


@dataclass(frozen=True)
class BatchSummary:
    """What a rebuild needs of a batch object."""

    version: int
    worker_id: str
    prompt_ids: list[str]


def summarize(obj: dict[str, Any]) -> BatchSummary:
    return BatchSummary(int(obj["version"]), str(obj.get("worker_id", "")), [str(p) for p in obj["prompt_ids"]])


async def ensure_ready(r: Any, store: BucketStore, run: str, spec: RunSpec) -> dict[str, int]:
    """Make this Redis hold the run's queue and prompt state, rebuilding both from the bucket if it lost them.

    Called by the proxy core's rebuild (``proxy/rebuild.py``) and lazily by the first queue or prompt call of a
    run that is not ``ready`` (a wiped Redis, or a new run): the groups of the bucket's batch objects that the
    newest snapshot does not show settled are enqueued again, the lifetime counters continue from it
    (:func:`_requeue`), and the idempotency records are restored; then the prompt cursor comes back from the
    same snapshot (see ``state/snapshot.py``). A ``ready`` flag, set in the same transaction, makes it
    idempotent and safe for several replicas at once. Returns what was restored.
    """
    k = QueueKeys.of(run)
    out = {"batches": 0, "groups": 0, "prompt_cursor": 0}
    q_ready, p_ready = await r.hexists(k.meta, "ready"), await r.hexists(k.p.meta, "ready")
    if q_ready and p_ready:
        return out
    raw = await asyncio.to_thread(snapshot.read_snapshot, store, run)
    snap = json.loads(raw) if raw else None
    loaded = await _load_settled_batches(store, run)
    completed = {p for _, _, obj, _ in loaded for p in summarize(obj).prompt_ids}
    if not q_ready:
        out.update(await _requeue(r, run, k, loaded, snap.get("queue") if isinstance(snap, dict) else None))
    if not p_ready:
        out["prompt_cursor"] = await snapshot.restore(r, run, spec, completed, raw) or 0
    if out["groups"] or out["prompt_cursor"]:
        log.warning("run %r: rebuilt from the bucket: %s", run, out)
    return out


def _load_batch(store: BucketStore, run: str, batch_id: str) -> dict[str, Any] | None:
    try:
        obj: dict[str, Any] = msgpack.unpackb(store.get_bytes(batch_key(run, batch_id)), raw=False)
    except errors.NotFound:
        return None
    check_format(run, batch_id, obj.get("format"))
    return obj


async def _load_settled_batches(store: BucketStore, run: str) -> Loaded:
    """Every batch object of the run, oldest first, with the group indices its marker lists as settled."""
    listed = await asyncio.to_thread(store.list_keys, f"runs/{run}/rollouts/")
    names = {key.rsplit("/", 1)[1] for key in listed}
    loaded: Loaded = []
    for b in sorted(n for n in names if not n.endswith(".done")):
        obj = await asyncio.to_thread(_load_batch, store, run, b)
        if obj is None:
            continue
        settled: set[int] = set()
        if f"{b}.done" in names:
            try:
                marker = json.loads(await asyncio.to_thread(store.get_bytes, marker_key(run, b)))
                settled = {int(x) for x in marker.get("settled", [])}
            except errors.NotFound:
                pass
        loaded.append((float(obj.get("accepted_at", 0.0)), b, obj, settled))
    loaded.sort()
    return loaded


async def _requeue(r: Any, run: str, k: QueueKeys, loaded: Loaded, snap: dict[str, Any] | None) -> dict[str, int]:
    """Enqueue the live groups of the bucket's batch objects; restore the lifetime counters.

    ``snap``: the queue section of the newest snapshot (``prompts.json``; None when it has none, or was written
    by an older proxy). With one, the counters continue from it and a batch it shows live is re-enqueued minus
    the groups it shows settled; a batch it shows finished is only deleted (``queue:doomed``); a batch it does
    not know was accepted after it (its groups count as accepted now); a batch it shows live whose object is
    gone is counted lost. So ``accepted = acked + dropped + lost + queued + pending`` holds over the run's whole
    life. Groups settled after the snapshot was written come back (the trainer holds repeats: its ledger).
    Without one, markers name the settled groups and the counters start from the rebuild.
    """
    async with r.pipeline(transaction=True) as pipe:
        try:
            await pipe.watch(k.meta, k.stream)
            if await pipe.hexists(k.meta, "ready"):
                return {"batches": 0, "groups": 0}  # another caller (replica) did it meanwhile
            # Counters this Redis kept (only its queue keys were lost) are the truth; after a wipe only the
            # refusal counters (which need no ready state) can be there, and the snapshot's add to them.
            restored_counters = await pipe.hexists(k.counters, "accepted_total")
            if await pipe.exists(k.stream):
                # A stream without the flag: Redis kept its queue (state from before the flag existed).
                pipe.multi()
                pipe.hset(k.meta, "ready", 1)
                await pipe.execute()
                return {"batches": 0, "groups": 0}
            pipe.multi()
            pipe.xgroup_create(k.stream, GROUP, id="0", mkstream=True)
            done = _enqueue_live(pipe, run, k, loaded, snap)
            _restore_counters(pipe, k, snap, restored_counters, done, _count_lost(run, loaded, snap))
            if done.entry_map:
                pipe.hset(k.entry, mapping=done.entry_map)
                # each of them may have been trained already: a claim with hold_rebuilt hands it over even when
                # below the floor (the trainer's ledger decides: ack or release), never drops it unasked
                pipe.hset(k.rebuilt, mapping=dict.fromkeys(done.entry_map, 1))
            pipe.hset(k.meta, "ready", 1)
            await pipe.execute()
        except redis_exc.WatchError:
            return {"batches": 0, "groups": 0}
    return {"batches": done.batches, "groups": done.groups}


@dataclass
class _Requeued:
    batches: int = 0
    groups: int = 0
    accepted: int = 0  # groups the snapshot's counters do not count as accepted yet
    tokens: int = 0  # their generated tokens (batch objects older than the pool carry none: 0)
    entry_map: dict[str, str] = field(default_factory=dict)  # delivery id -> its new stream id


def _enqueue_live(pipe: Any, run: str, k: QueueKeys, loaded: Loaded, snap: dict[str, Any] | None) -> _Requeued:
    """Queue (in the transaction ``pipe``) each batch's groups the snapshot (or, without one, its marker) does not
    show settled, with its idempotency record."""
    out = _Requeued()
    live_s: dict[str, Any] = snap.get("live", {}) if snap else {}
    doomed_s = set(snap.get("doomed", [])) if snap else set()
    # Explicit stream ids (accept order), so the delivery-id map is written in the same transaction.
    base_ms = int(time.time() * 1000)
    for _, b, obj, marked in loaded:
        summary = summarize(obj)
        n_groups = len(summary.prompt_ids)
        if b in doomed_s:  # settled before the snapshot; its deletion had not happened
            pipe.hset(k.doomed, b, 0)
            continue
        settled = set(marked) if snap is None else {int(g) for g in live_s.get(b, {}).get("settled", [])}
        live = [g for g in range(n_groups) if g not in settled]
        if not live:
            continue
        if snap is None or b not in live_s:  # not in the snapshot's counters yet
            out.accepted += len(live)
            group_tokens = obj.get("group_tokens") or []
            out.tokens += sum(int(group_tokens[g]) for g in live if g < len(group_tokens))
        for g in live:
            d, sid = f"{b}:{g}", f"{base_ms}-{len(out.entry_map)}"
            # "r": re-queued by a rebuild (the trainer may have trained it: see the claim's drop)
            pipe.xadd(k.stream, {"d": d, "v": summary.version, "w": summary.worker_id, "r": 1}, id=sid)
            out.entry_map[d] = sid
        pipe.hset(k.remaining, b, len(live))
        if settled:
            pipe.hset(k.settled, b, "".join(f"{g}," for g in sorted(settled)))
        if obj.get("idem"):
            answer = SubmitResponse(batch_id=b, accepted_groups=n_groups)
            pipe.set(k.idem(run, str(obj["idem"])), answer.model_dump_json(), ex=IDEMPOTENCY_TTL_S)
        out.batches += 1
        out.groups += len(live)
    return out


def _count_lost(run: str, loaded: Loaded, snap: dict[str, Any] | None) -> int:
    """The groups of batches the snapshot shows live whose objects are not in the bucket (logged)."""
    present = {b for _, b, _, _ in loaded}
    live_s: dict[str, Any] = snap.get("live", {}) if snap else {}
    missing = {b: int(v.get("remaining", 0)) for b, v in live_s.items() if b not in present}
    if not missing:
        return 0
    lost = sum(missing.values())
    log.error(
        "run %r: the snapshot lists %d live batches (%d groups) that are not in the bucket; counted as lost: %s",
        run,
        len(missing),
        lost,
        sorted(missing)[:5],
    )
    return lost


def _restore_counters(
    pipe: Any, k: QueueKeys, snap: dict[str, Any] | None, restored_counters: bool, done: _Requeued, lost: int
) -> None:
    """The lifetime counters continue from the snapshot's (unless this Redis kept its own), plus what the rebuild
    found accepted or lost since."""
    if snap is not None and not restored_counters:
        for name, value in snap.get("counters", {}).items():
            pipe.hincrby(k.counters, name, int(value))
        for name, usage in snap.get("cost_usage", {}).items():  # added to what was accrued since the wipe
            pipe.hincrbyfloat(k.p.usage, name, float(usage))
        if redropped := snap.get("redropped"):
            pipe.hset(k.redropped, mapping=dict.fromkeys(redropped, 1))
    pipe.hincrby(k.counters, "accepted_total", done.accepted)
    pipe.hincrby(k.counters, "tokens_generated_total", done.tokens)
    pipe.hincrby(k.counters, "lost_total", lost)
