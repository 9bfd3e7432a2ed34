"""The rollout queue: batches in the bucket, pointers in a Redis Stream, exact accounting (invariant 4).

This module holds what every stage shares (keys, ids, the object format); each stage of a group's life is a
module of its own: ``submit.py``, ``claim.py`` (claim, give back), ``ack.py`` (ack, settle), ``restore.py``
(rebuild after a Redis wipe), ``accounting.py`` (status, counters). The scripts are ``scripts/*.lua``.

Life of a group
---------------
1. ``submit``: a generator posts a batch of complete groups with an ``Idempotency-Key``. It is validated
   (422 naming the field; 409 ``stale`` when ``version < latest - max_staleness``; 429 when the queue is
   full), then written WHOLE to the bucket as ``runs/{run}/rollouts/{batch_id}`` (msgpack) and only then
   made visible in Redis by one Lua script: one stream entry per group ``{d: "{batch_id}:{g}", v, w}``, the
   batch's remaining-group count, ``accepted_total``, the completion of its prompts and the idempotency
   record. The object (format 3) holds the batch's header fields, its ``prompt_ids`` and each group as
   msgpack with packed numeric arrays (``groups_msgpack``: the bytes a msgpack body carried, untouched; a JSON
   body's groups packed once), so a claim sends groups on without decoding them (a msgpack claim splices
   the bytes; a JSON claim, from an older trainer, converts) and nothing is stored twice. ``batch_id`` is a
   hash of (worker_id, Idempotency-Key, content): a retry after a lost answer or a 503 rewrites the same
   object and finds the idempotency record (``duplicate: true``, nothing enqueued). Formats 1-2 (written by
   development builds before the packed wire, never shipped) are refused by name (:class:`UnsupportedBatchObject`).
2. ``claim`` (trainer, epoch-fenced): one Lua script hands out, oldest first, (a) pending entries idle
   for ``redelivery_timeout_s`` (``XAUTOCLAIM``) that the current epoch does not hold (``queue:owner``:
   delivery -> the epoch it was handed to; the live trainer keeps trained groups unacked until its
   checkpoint, so they are never handed back to it), then (b) new ones (``XREADGROUP``). A claim with a
   ``request_id`` records its answer (``queue:claimreq:{epoch}:{id}``, ``CLAIM_REPLAY_TTL_S``): a replay
   after a lost answer gets the same deliveries. ``release`` gives deliveries back untrained. A group whose version
   is below ``latest - max_staleness`` at that moment, or below the claim's optional ``min_version`` (the
   trainer's floor, see ``ClaimRequest``), is dropped (``XACK`` + ``XDEL``) and counted in
   ``dropped_stale_total``: never silently. The long-poll waits with ``XREAD BLOCK`` from the stream's last
   id, so a submit wakes a waiting trainer at once. Each delivery carries one group and the stable
   ``delivery_id = "{batch_id}:{g}"`` (stable across a Redis rebuild, so a checkpoint's ids stay valid).
   When a new trainer epoch registers, every pending delivery becomes re-claimable at once
   (their idle time is pushed past the timeout; ``claim.on_trainer_registered`` and the first claim of an epoch).
3. ``ack`` (trainer, epoch-fenced, idempotent): ``XACK`` + ``XDEL``; ``acked_total`` counts first acks only.
   Every settle moves the state's seq on; the snapshot (``prompts.json``: prompts, each live batch's settled
   groups, the lifetime counters; see ``state/snapshot.py``) must reach it, and a batch whose groups are all
   settled (recorded in ``queue:doomed``) has its object deleted only after that, so a rebuild neither
   enqueues it again nor loses count of it. The proxy's routes leave that bucket work to a background
   cleaner and answer after the script (``state/cleanup.py``).

Accounting (invariant 4), all in the run's ``counters`` hash and updated inside the same scripts::

    accepted_total == acked_total + dropped_stale_total + lost_total + XLEN(stream)
    XLEN(stream)   == queued (never claimed) + pending (claimed, unacked)

``lost_total`` stays 0 unless a batch object vanished from the bucket behind the proxy's back (logged).
The counters are lifetime counts: after a Redis wipe the rebuild continues them from the newest snapshot
(``restore.py``), so the identity holds over the run's whole life; groups settled after that snapshot was
written come back as queued (the trainer holds the ones it trained: ``trainer/ledger.py``). Those entries are
marked re-queued (``queue:rebuilt``): only the trainer's ledger knows whether its lineage trained one, so a claim
with ``hold_rebuilt`` (the trainer's) never drops a marked entry below the floor: it hands it over flagged
``rebuilt_stale``, pending like any delivery (a trainer that dies holding it passes it on to the next epoch, a
replayed claim answers it again). The trainer acks it with its next checkpoint (trained before the wipe: counted
acked, exactly once) or gives it back (``release`` clears the mark; the next claim drops and counts it stale). A
claim without ``hold_rebuilt`` (an older trainer) drops it, records it in ``queue:redropped`` and lists it in
``dropped_rebuilt``; a later ack of it moves it from ``dropped_stale_total`` to ``acked_total``.

Readiness (a wiped Redis must not look like an empty queue)
------------------------------------------------------------
``queue:meta`` and ``prompts:meta`` carry a ``ready`` flag. Every script refuses to act on a run that is not
ready (``notready``); the caller then runs ``restore.ensure_ready``, which rebuilds the queue from the bucket's
batch objects and the prompt cursor from ``prompts.json`` and sets the flags in the same transactions. So
a claim, submit or lease that reaches a freshly wiped Redis before the proxy core's rebuild can neither
start an empty queue (and hide the batches) nor restart the dataset at prompt 0.

Redis keys (``brl:{run}:`` prefix): ``queue:stream`` (+ group ``trainer``), ``queue:entry`` (delivery id ->
stream id), ``queue:attempts`` (delivery id -> deliveries so far), ``queue:remaining`` (batch -> unsettled
groups), ``queue:settled`` (batch -> "g,g," settled so far), ``queue:owner`` (delivery -> the epoch holding it),
``queue:claimreq:{epoch}:{request_id}`` (a claim's delivery ids, for its replay; ``!`` before a flagged one),
``queue:rebuilt`` (deliveries a rebuild re-queued, until settled or given back), ``queue:redropped`` (rebuilt
deliveries dropped as stale, an ack may still count acked; in the snapshot), ``queue:meta`` (epoch seen
by the queue), ``queue:doomed`` (finished batch -> the seq the snapshot must reach before its object goes),
``idem:{hash of worker_id, key}`` (JSON SubmitResponse, TTL ``IDEMPOTENCY_TTL_S``), ``counters``.

``GET /status`` reads the queue's part from ``accounting.py`` (``state/status.py`` calls it).

Runbook: ``redis-cli XINFO GROUPS brl:{run}:queue:stream`` (pending, lag), ``HGETALL brl:{run}:counters``;
``bucketrl proxy --rebuild`` re-enqueues every batch object left in ``runs/{run}/rollouts/``.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bucketrl import errors
from bucketrl.proxy import keys
from bucketrl.proxy.state import cleanup, prompts
from bucketrl.wire import RunSpec

GROUP = prompts.STREAM_GROUP
# A retry comes within seconds to minutes (client backoff); a day bounds the records at a few per batch/s.
IDEMPOTENCY_TTL_S = 86_400
DELIVERY_ID_RE = re.compile(r"^b[0-9a-f]{32}:(0|[1-9][0-9]{0,5})$")
# Gives the run's spec when a queue call needs it after all (a route's ``resolve_run``: 404 for an unknown
# run, a rebuild of a wiped Redis first). Hot routes pass one instead of reading the spec up front.
SpecLoader = Callable[[], Awaitable[RunSpec]]


@dataclass(frozen=True)
class QueueKeys:
    stream: str
    state: str
    counters: str
    entry: str
    attempts: str
    remaining: str
    settled: str
    meta: str
    bseq: str
    doomed: str
    owner: str
    redropped: str
    rebuilt: str
    trained_by: str  # groups acked per worker id (the generators' share of the run's training; not persisted)
    p: prompts.PromptKeys = field(repr=False)

    @classmethod
    @functools.lru_cache(maxsize=4096)  # frozen, and built on every request: once per run is enough
    def of(cls, run: str) -> QueueKeys:
        k = keys.run_key
        return cls(
            stream=k(run, keys.QUEUE_STREAM),
            state=k(run, keys.STATE),
            counters=k(run, keys.COUNTERS),
            entry=k(run, "queue:entry"),
            attempts=k(run, "queue:attempts"),
            remaining=k(run, "queue:remaining"),
            settled=k(run, "queue:settled"),
            meta=k(run, "queue:meta"),
            bseq=k(run, "queue:seq"),
            doomed=cleanup.doomed_key(run),
            owner=k(run, "queue:owner"),
            redropped=prompts.redropped_key(run),
            rebuilt=k(run, "queue:rebuilt"),
            trained_by=k(run, "queue:trained_by"),
            p=prompts.PromptKeys.of(run),
        )

    def idem(self, run: str, idem_id: str) -> str:
        return keys.run_key(run, f"{keys.IDEMPOTENCY}:{idem_id}")

    def claim_request(self, run: str, epoch: int, request_id: str | None) -> str:
        return keys.run_key(run, f"queue:claimreq:{epoch}:{request_id or '-'}")


batch_key = cleanup.batch_key
marker_key = cleanup.marker_key


def idempotency_id(worker_id: str, idempotency_key: str) -> str:
    """Names the idempotency record of (worker, Idempotency-Key)."""
    return hashlib.sha256(f"{worker_id}\0{idempotency_key}".encode()).hexdigest()[:32]


def batch_id_for(idem_id: str, content: bytes) -> str:
    """Deterministic: a retry (same key, same batch) always names the same bucket object; a key reused for
    other content (a client bug) names another object, so it can never overwrite the enqueued one."""
    return "b" + hashlib.sha256(idem_id.encode() + b"\0" + hashlib.sha256(content).digest()).hexdigest()[:32]


def as_str(v: bytes | str) -> str:
    """A Redis reply item as text (the proxy's client answers bytes)."""
    return v.decode() if isinstance(v, bytes) else v


def not_ready(run: str) -> errors.Unavailable:
    return errors.Unavailable(f"run {run!r}: its queue is being restored from the bucket; retry")


def validate_delivery_ids(ids: list[str], field: str = "delivery_ids") -> None:
    for i, d in enumerate(ids):
        if not DELIVERY_ID_RE.match(d):
            raise errors.Invalid(f"{field}[{i}]: {d[:80]!r} is not a delivery id from a claim")


BATCH_FORMAT = 3


class UnsupportedBatchObject(errors.Conflict):
    """A batch object this proxy cannot read: formats 1 and 2 (before the packed wire, 3277daf) were never
    shipped, so nothing should hold one; refused by name rather than misread."""


def check_format(run: str, batch_id: str, obj_format: Any) -> None:
    if obj_format != BATCH_FORMAT:
        raise UnsupportedBatchObject(
            f"run {run!r}: batch object {batch_key(run, batch_id)} is format {obj_format!r}; this proxy reads "
            f"format {BATCH_FORMAT} only (formats 1-2 were written by development builds before the packed wire): "
            "claim it with the proxy that wrote it, or delete the object"
        )
