"""Stage 1 of a group's life: a generator's batch is validated, written whole to the bucket, then enqueued.

See ``state/queue.py`` for the whole life and its invariants. The stages of :func:`submit`: read what the checks
need and take the batch's write lock in one round trip (:func:`_precheck`), the checks (:func:`_admit`: 422, 409
``stale``, 429), wait for an earlier attempt of the same batch still writing (:func:`_await_write_lock`), then write
the object and enqueue its groups in one script (:func:`_write_and_enqueue`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import msgpack

from bucketrl import errors
from bucketrl.proxy import keys
from bucketrl.proxy.rollout_body import content_digest
from bucketrl.proxy.state import runs
from bucketrl.proxy.state.lua import Lua
from bucketrl.proxy.state.queue import (
    BATCH_FORMAT,
    GROUP,
    IDEMPOTENCY_TTL_S,
    QueueKeys,
    SpecLoader,
    as_str,
    batch_id_for,
    batch_key,
    idempotency_id,
    not_ready,
)
from bucketrl.proxy.state.restore import ensure_ready
from bucketrl.proxy.state.validation import validate_batch
from bucketrl.storage.base import BucketStore
from bucketrl.wire import RolloutBatch, RunSpec, SubmitResponse, packed

log = logging.getLogger("bucketrl.proxy.queue")

_PRECHECK = Lua.load("queued_groups.lua", "submit_precheck.lua")

_ENQUEUE = Lua.load("queued_groups.lua", "queue_common.lua", "submit_enqueue.lua")

# KEYS: idem write_lock ; ARGV: token ttl_ms. Take the batch's write lock unless the batch is already accepted.
_BEGIN_WRITE = Lua.load("submit_begin_write.lua")

_UNLOCK = Lua.load("unlock.lua")

IDEMPOTENCY_KEY_RE = re.compile(r"^[\x21-\x7e]{1,200}$")  # visible ASCII, like an HTTP token
# A batch's write lock (one attempt of a batch writes its object at a time): longer than any object PUT; how
# long a retry waits for an earlier attempt before answering 503.
SUBMIT_LOCK_TTL_MS = 120_000
SUBMIT_LOCK_WAIT_S = 20.0
# Retry-After (s) of a submit refused because the queue is at capacity.
RETRY_AFTER_S = 1.0


def _admit(
    run: str,
    spec: RunSpec,
    batch: RolloutBatch,
    cursor: int,
    latest: int,
    queued: int,
    leased: Any,
    max_new_bound: int,
) -> None:
    """The checks before a batch is written (422, 409 ``stale``, 429), from the pre-check's readings."""
    validate_batch(batch, spec, cursor, max_new_bound)
    # A version lease still on record must be for the batch's version. One no longer on record (released,
    # or expired past its grace) is accepted: the staleness rule below is what protects training.
    if leased and int(leased) != batch.version:
        raise errors.Invalid(
            f"lease_id: lease {batch.lease_id!r} is for version {int(leased)}, the batch says version {batch.version}"
        )
    if batch.version > latest:
        raise errors.Invalid(f"version: {batch.version} is newer than the latest published version {latest}")
    if batch.version < latest - spec.max_staleness:
        raise _stale(run, batch.version, latest, spec)
    if queued + len(batch.groups) > spec.queue_capacity_groups:
        raise _full(run, queued, len(batch.groups), spec)


async def _unlock_if(locked: bool, r: Any, lock_key: str, token: str) -> None:
    if locked:
        await _UNLOCK(r, [lock_key], [token])


def validate_idempotency_key(key: str | None) -> str:
    if key is None or key == "":
        raise errors.Invalid("header Idempotency-Key: required (a unique id per batch; reuse it when retrying)")
    if not IDEMPOTENCY_KEY_RE.match(key):
        raise errors.Invalid("header Idempotency-Key: must be 1..200 visible ASCII characters")
    return key


def _stale(run: str, version: int, latest: int, spec: RunSpec) -> errors.Stale:
    return errors.Stale(
        f"run {run!r}: version {version} is older than latest {latest} - max_staleness {spec.max_staleness}; "
        "lease the latest version and generate again",
    )


def _full(run: str, queued: int, n: int, spec: RunSpec) -> errors.Backpressure:
    return errors.Backpressure(
        f"run {run!r}: the queue holds {queued} groups; {n} more would pass queue_capacity_groups "
        f"{spec.queue_capacity_groups}. Retry after the trainer claimed some.",
        retry_after=RETRY_AFTER_S,
    )


async def submit(
    r: Any,
    store: BucketStore,
    run: str,
    spec: RunSpec | SpecLoader,
    batch: RolloutBatch,
    idempotency_key: str | None,
    groups_msgpack: list[bytes] | None = None,
    digest: bytes | None = None,
) -> SubmitResponse:
    """Validate, write the batch to the bucket, then enqueue its groups atomically (see ``state/queue.py``).

    ``spec``: the run's spec, or a :data:`SpecLoader`; then the spec is the one the pre-check reads in its
    own round trip, and the loader is called only when that finds no spec (404 or a rebuild).
    ``groups_msgpack``: each group's msgpack as it arrived (``proxy/rollout_body.py``), stored as is; without
    it each group is packed here (``wire/packed.py``). ``digest``: ``rollout_body.content_digest`` of those
    (computed with the decoding, off the event loop for a large body)."""
    attempt = _attempt(run, batch, validate_idempotency_key(idempotency_key), groups_msgpack, digest)
    spec, got = await _precheck(r, store, attempt, spec)
    if got.seen:
        return _duplicate(got.seen)
    await _admit_or_unlock(r, attempt, spec, got)
    obj_bytes = _batch_object(attempt, spec)
    if not got.locked:  # another attempt of this batch is writing: wait for it (or its answer)
        first = await _await_write_lock(r, attempt)
        if first is not None:
            return first
    return await _write_and_enqueue(r, store, attempt, spec, obj_bytes)


@dataclass(frozen=True)
class _Attempt:
    """One attempt at submitting a batch, and the names it has in Redis and the bucket."""

    run: str
    k: QueueKeys
    batch: RolloutBatch
    idem_id: str
    idem_key: str
    # Each group's msgpack (packed arrays), stored as is: a claim splices it into its answer undecoded.
    groups_msgpack: list[bytes]
    batch_id: str
    # One attempt at a time writes (and, when refused, deletes) this batch's object: a retry arriving while
    # an earlier attempt of the same batch is still writing waits for it, so a refused attempt can never
    # delete the object another attempt has just enqueued (issue 10 item 8).
    lock_key: str
    token: str


def _attempt(
    run: str, batch: RolloutBatch, key: str, groups_msgpack: list[bytes] | None, digest: bytes | None
) -> _Attempt:
    idem_id = idempotency_id(batch.worker_id, key)
    if groups_msgpack is None:
        groups_msgpack = [packed.packb(g) for g in batch.groups]
    # The batch's id comes from these bytes, so the pre-check can take the batch's write lock in its round trip.
    batch_id = batch_id_for(idem_id, digest or content_digest(batch, groups_msgpack))
    k = QueueKeys.of(run)
    lock_key = keys.run_key(run, f"queue:writing:{batch_id}")
    return _Attempt(
        run, k, batch, idem_id, k.idem(run, idem_id), groups_msgpack, batch_id, lock_key, secrets.token_hex(8)
    )


@dataclass(frozen=True)
class _Readings:
    """What the pre-check read, in one round trip."""

    seen: Any  # the idempotency record's answer ('' when the batch is new)
    latest: int
    cursor: int
    queued: int
    leased: Any  # the version of the batch's version lease ('' when not on record)
    locked: bool  # this attempt holds the batch's write lock
    bound: Any  # the largest max_new_tokens the run's spec has had ('' when not recorded)


async def _precheck(r: Any, store: BucketStore, a: _Attempt, spec: RunSpec | SpecLoader) -> tuple[RunSpec, _Readings]:
    """What the checks need, the run's spec (when the caller passed a loader) and the batch's write lock (taken
    when the batch is new and the run ready), in one round trip; a run not ready is restored first."""
    k = a.k
    lease_key = keys.run_key(a.run, keys.LEASE_INFO.format(id=a.batch.lease_id))
    spec_key = keys.run_key(a.run, keys.SPEC)
    for _ in range(3):
        seen, latest, cursor, queued, leased, ready, raw_spec, locked, bound = await _PRECHECK(
            r,
            [a.idem_key, k.state, k.p.cursor, k.stream, lease_key, k.meta, k.p.meta, spec_key, a.lock_key],
            [GROUP, a.token, SUBMIT_LOCK_TTL_MS],
        )
        if not isinstance(spec, RunSpec):
            if not raw_spec:  # unknown run (the loader answers 404), or a wiped Redis (it rebuilds): check again
                spec = await spec()
                continue
            spec = runs.parse_spec(bytes(raw_spec))
        if int(ready) == 2:
            return spec, _Readings(seen, int(latest), int(cursor), int(queued), leased, bool(int(locked)), bound)
        await ensure_ready(r, store, a.run, spec)  # first touch since Redis (re)started
    raise not_ready(a.run)


async def _admit_or_unlock(r: Any, a: _Attempt, spec: RunSpec, got: _Readings) -> None:
    """:func:`_admit`; a refused batch gives its write lock back, its refusal counted."""
    try:
        _admit(a.run, spec, a.batch, got.cursor, got.latest, got.queued, got.leased, runs.bound_of(spec, got.bound))
    except errors.Stale:
        await r.hincrby(a.k.counters, "rejected_stale_total", len(a.batch.groups))
        await _unlock_if(got.locked, r, a.lock_key, a.token)
        raise
    except errors.Backpressure:
        pipe = r.pipeline(transaction=False)
        pipe.hincrby(a.k.counters, "backpressure_total", 1)
        pipe.hincrby(a.k.counters, "submit_backpressure_total", 1)
        await pipe.execute()
        await _unlock_if(got.locked, r, a.lock_key, a.token)
        raise
    except BaseException:
        await _unlock_if(got.locked, r, a.lock_key, a.token)
        raise


def _batch_object(a: _Attempt, spec: RunSpec) -> bytes:
    """The batch object (format 3, ``state/queue.py``)."""
    batch = a.batch
    obj = {
        "format": BATCH_FORMAT,
        "batch_id": a.batch_id,
        "idem": a.idem_id,
        "run": a.run,
        "accepted_at": time.time(),
        "worker_id": batch.worker_id,
        "lease_id": batch.lease_id,
        "version": batch.version,
        "prompt_ids": [g.prompt_id for g in batch.groups],
        # Each group's generated tokens: a rebuild adds those of groups the snapshot's counters do not know yet.
        "group_tokens": [sum(c.model_tokens() for c in g.completions) for g in batch.groups],
        "groups_msgpack": a.groups_msgpack,
        # What the groups were sampled with: recorded now, so a later change of the run's spec cannot change it.
        "sampling": (batch.sampling or spec.sampling).model_dump(mode="json"),
    }
    return msgpack.packb(obj, use_bin_type=True)


async def _await_write_lock(r: Any, a: _Attempt) -> SubmitResponse | None:
    """Wait for an earlier attempt of this batch to finish writing, then take the lock (None), or answer what
    that attempt's enqueue recorded (a duplicate)."""
    deadline = time.monotonic() + SUBMIT_LOCK_WAIT_S
    while True:
        await asyncio.sleep(0.05)
        got = await _BEGIN_WRITE(r, [a.idem_key, a.lock_key], [a.token, SUBMIT_LOCK_TTL_MS])
        if as_str(got[0]) == "duplicate":
            return _duplicate(got[1])
        if as_str(got[0]) == "ok":
            return None
        if time.monotonic() > deadline:
            raise errors.Unavailable(f"run {a.run!r}: an earlier attempt of this batch is still being written; retry")


async def _write_and_enqueue(
    r: Any, store: BucketStore, a: _Attempt, spec: RunSpec, obj_bytes: bytes
) -> SubmitResponse:
    """Write the object, then make its groups visible in one script (which checks staleness and room again)."""
    batch, k, n = a.batch, a.k, len(a.batch.groups)
    answer = SubmitResponse(batch_id=a.batch_id, accepted_groups=n)
    released = False  # the enqueue script releases the lock when the object stays
    try:
        await asyncio.to_thread(store.put_bytes, batch_key(a.run, a.batch_id), obj_bytes)
        res = await _ENQUEUE(
            r,
            [
                *(a.idem_key, k.state, k.stream, k.counters, k.entry, k.remaining, k.p.open, k.p.inflight),
                *(k.p.owner, k.p.meta, k.meta, k.bseq, a.lock_key, keys.run_key(a.run, keys.TOKENS_RECENT)),
                k.trained_by,
            ],
            [
                *(a.batch_id, GROUP, batch.version, spec.max_staleness, spec.queue_capacity_groups, batch.worker_id),
                *(IDEMPOTENCY_TTL_S, answer.model_dump_json(), n, a.token, generated_tokens(batch)),
                *(g.prompt_id for g in batch.groups),
            ],
        )
        status = as_str(res[0])
        released = status in ("ok", "duplicate")
        if status == "ok":
            return answer.model_copy(update={"trained_total": int(res[3]), "worker_trained_total": int(res[4])})
        if status == "duplicate":  # a concurrent retry with the same key won
            first = SubmitResponse.model_validate_json(res[1])
            if first.batch_id != a.batch_id:  # same key, other content: ours is an orphan (and stays refused)
                await asyncio.to_thread(store.delete, [batch_key(a.run, a.batch_id)])
            return first.model_copy(update={"duplicate": True})
        if status == "notready":  # Redis was wiped between the checks and the commit
            raise not_ready(a.run)
        # Refused after the write (latest moved or the queue filled meanwhile): the object must not stay.
        await _delete_if_held(r, store, a.run, a.batch_id, a.lock_key, a.token)
    finally:
        if not released:
            await _UNLOCK(r, [a.lock_key], [a.token])
    if status == "stale":
        raise _stale(a.run, batch.version, int(res[1]), spec)
    if status == "full":
        raise _full(a.run, int(res[1]), n, spec)
    if status == "repeated":
        done = ", ".join(as_str(p) for p in res[1:])
        raise errors.Repeated(
            f"run {a.run!r}: prompt(s) {done} were already completed by another accepted batch (their leases were "
            "lost: expired, or a Redis wipe); this batch is refused whole so no prompt is trained twice"
        )
    raise errors.Invalid(f"version: {batch.version} is newer than the latest published version {int(res[1])}")


def generated_tokens(batch: RolloutBatch) -> int:
    """The tokens the model generated for a batch (multi-turn: model segments only; environment tokens were not
    generated): what a run's ``tokens_generated_total`` and budget count."""
    return sum(c.model_tokens() for g in batch.groups for c in g.completions)


def _duplicate(seen: Any) -> SubmitResponse:
    """The first attempt's answer, flagged ``duplicate``."""
    return SubmitResponse.model_validate_json(seen).model_copy(update={"duplicate": True})


async def _delete_if_held(r: Any, store: BucketStore, run: str, batch_id: str, lock_key: str, token: str) -> None:
    """Delete a refused attempt's object, unless its write lock expired meanwhile (then another attempt of the
    batch may own the object now: leaving an orphan is the lesser harm)."""
    held = await r.get(lock_key)
    if held is not None and as_str(held) == token:
        await asyncio.to_thread(store.delete, [batch_key(run, batch_id)])
    else:
        log.warning("run %r: batch %s: write lock expired before its refused object could be deleted", run, batch_id)
