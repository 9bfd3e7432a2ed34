"""The rollout queue: batches in the bucket, pointers in a Redis Stream, exact accounting (invariant 4).

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
   object and finds the idempotency record (``duplicate: true``, nothing enqueued). Objects written in
   format 2 (each group as claim-answer JSON, ``groups_json``) or format 1 (the batch's own msgpack fields,
   ``groups`` included) are still claimed and rebuilt.
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
   (their idle time is pushed past the timeout; ``on_trainer_registered`` and the first claim of an epoch).
3. ``ack`` (trainer, epoch-fenced, idempotent): ``XACK`` + ``XDEL``; ``acked_total`` counts first acks only.
   Every settle moves the state's seq on; the snapshot (``prompts.json``: prompts, each live batch's settled
   groups, the lifetime counters; see ``state/prompts.py``) must reach it, and a batch whose groups are all
   settled (recorded in ``queue:doomed``) has its object deleted only after that, so a rebuild neither
   enqueues it again nor loses count of it. The proxy's routes leave that bucket work to a background
   cleaner and answer after the script (``state/cleanup.py``).

Accounting (invariant 4), all in the run's ``counters`` hash and updated inside the same scripts::

    accepted_total == acked_total + dropped_stale_total + lost_total + XLEN(stream)
    XLEN(stream)   == queued (never claimed) + pending (claimed, unacked)

``lost_total`` stays 0 unless a batch object vanished from the bucket behind the proxy's back (logged).
The counters are lifetime counts: after a Redis wipe the rebuild continues them from the newest snapshot
(``_requeue``), so the identity holds over the run's whole life; groups settled after that snapshot was
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
ready (``notready``); the caller then runs :func:`ensure_ready`, which rebuilds the queue from the bucket's
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

Status helpers for ``GET /status`` (P2's route calls them): :func:`queue_status`,
:func:`bucketrl.proxy.state.prompts.prompts_inflight`, :func:`bucketrl.proxy.state.prompts.cursor`.

Runbook: ``redis-cli XINFO GROUPS brl:{run}:queue:stream`` (pending, lag), ``HGETALL brl:{run}:counters``;
``bucketrl proxy --rebuild`` re-enqueues every batch object left in ``runs/{run}/rollouts/``.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
from pydantic import TypeAdapter
from redis import exceptions as redis_exc

from bucketrl import errors
from bucketrl.proxy import keys
from bucketrl.proxy.rollout_body import content_digest
from bucketrl.proxy.state import cleanup, prompts, runs
from bucketrl.proxy.state.locks import fenced_or_restoring
from bucketrl.proxy.state.lua import Lua
from bucketrl.storage.base import BucketStore
from bucketrl.wire import (
    ClaimResponse,
    Completion,
    Delivery,
    QueueStatus,
    RolloutBatch,
    RolloutGroup,
    RunSpec,
    SamplingSpec,
    SubmitResponse,
    packed,
)

log = logging.getLogger("bucketrl.proxy.queue")

GROUP = prompts.STREAM_GROUP
# A retry comes within seconds to minutes (client backoff); a day bounds the records at a few per batch/s.
IDEMPOTENCY_TTL_S = 86_400
IDEMPOTENCY_KEY_RE = re.compile(r"^[\x21-\x7e]{1,200}$")  # visible ASCII, like an HTTP token
DELIVERY_ID_RE = re.compile(r"^b[0-9a-f]{32}:(0|[1-9][0-9]{0,5})$")
CLAIM_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# How long a claim's answer is kept for a replay of the same request id (a client retry after a lost answer
# comes within its backoff: seconds to minutes).
CLAIM_REPLAY_TTL_S = 600
# A batch's write lock (one attempt of a batch writes its object at a time): longer than any object PUT; how
# long a retry waits for an earlier attempt before answering 503.
SUBMIT_LOCK_TTL_MS = 120_000
SUBMIT_LOCK_WAIT_S = 20.0
# Retry-After (s) of a submit refused because the queue is at capacity.
RETRY_AFTER_S = 1.0
# A claim long-poll re-evaluates redeliveries at least this often while it blocks on new entries.
WAIT_SLICE_S = 1.0
# Serialises a validated group to the JSON a claim answers (the same serializer ClaimResponse uses).
_GROUP_JSON: TypeAdapter[RolloutGroup] = TypeAdapter(RolloutGroup)
COUNTER_FIELDS = (
    "accepted_total",
    "acked_total",
    "dropped_stale_total",
    "rejected_stale_total",
    "backpressure_total",
    "lost_total",
)


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


@dataclass(frozen=True)
class BatchSummary:
    """What a rebuild needs of a batch object, from either object format."""

    version: int
    worker_id: str
    prompt_ids: list[str]


def summarize(obj: dict[str, Any]) -> BatchSummary:
    if "prompt_ids" in obj and ("groups_msgpack" in obj or "groups_json" in obj):  # formats 3 and 2
        prompt_ids = [str(p) for p in obj["prompt_ids"]]
    else:  # format 1: the batch's own fields
        prompt_ids = [str(g.get("prompt_id")) for g in obj.get("groups", [])]
    return BatchSummary(int(obj["version"]), str(obj.get("worker_id", "")), prompt_ids)


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


# -- Lua (scripts/*.lua) ---------------------------------------------------------------------------------

_PRECHECK = Lua.load("queued_groups.lua", "submit_precheck.lua")

_ENQUEUE = Lua.load("queued_groups.lua", "queue_common.lua", "submit_enqueue.lua")

# KEYS: idem write_lock ; ARGV: token ttl_ms. Take the batch's write lock unless the batch is already accepted.
_BEGIN_WRITE = Lua.load("submit_begin_write.lua")

_UNLOCK = Lua.load("unlock.lua")

_CLAIM = Lua.load("queued_groups.lua", "queue_common.lua", "claim.lua")

_ACK = Lua.load("queued_groups.lua", "queue_common.lua", "ack.lua")

_RELEASE_PENDING = Lua.load("queued_groups.lua", "queue_common.lua", "claim_release_pending.lua")

_REQUEUE = Lua.load("queued_groups.lua", "queue_common.lua", "claim_requeue.lua")


# -- submit --------------------------------------------------------------------------------------------


def validate_batch(batch: RolloutBatch, spec: RunSpec, cursor: int, max_new_bound: int | None = None) -> None:
    """Semantic checks the schema cannot make (422 naming the field). ``cursor``: prompts issued so far.
    ``max_new_bound``: the largest ``sampling.max_new_tokens`` the run's spec has ever had (``runs.bound_of``;
    default the spec's current one)."""
    g_size, vocab, size = spec.group_size, spec.vocab_size, spec.dataset.size
    if len(batch.groups) > spec.queue_capacity_groups:
        raise errors.Invalid(
            f"groups: {len(batch.groups)} groups can never fit the queue (queue_capacity_groups "
            f"{spec.queue_capacity_groups}); submit smaller batches"
        )
    seen: set[str] = set()
    # A batch's completions are as long as its sampling allowed, but that sampling is the generator's own claim:
    # it may be what an older spec said (a batch in flight across a change), never more than any spec ever said.
    bound = max(spec.sampling.max_new_tokens, max_new_bound or 0)
    if batch.sampling is not None and batch.sampling.max_new_tokens > bound:
        raise errors.Invalid(
            f"sampling.max_new_tokens: {batch.sampling.max_new_tokens}, more than the run's spec has ever allowed "
            f"({bound})"
        )
    max_new = batch.sampling.max_new_tokens if batch.sampling is not None else bound
    # Token ids against vocab_size: one pass over all of them (numpy arrays when the body was packed), the
    # per-array walk below only to name the offender.
    arrays = [a for g in batch.groups for a in (g.prompt_token_ids, *(c.token_ids for c in g.completions))]
    arrays += [c.prompt_token_ids for g in batch.groups for c in g.completions if c.prompt_token_ids is not None]
    in_vocab = _all_below(arrays, vocab)
    for i, group in enumerate(batch.groups):
        where = f"groups[{i}]"
        _check_group_size(group, where, g_size, spec)
        parsed = prompts.parse_prompt_id(group.prompt_id)
        if parsed is None:
            raise errors.Invalid(f"{where}.prompt_id: {group.prompt_id[:60]!r} is not of the form '<pass>-<index>'")
        pass_, index = parsed
        if index != group.prompt_index:
            raise errors.Invalid(
                f"{where}.prompt_index: {group.prompt_index} != the index {index} of {group.prompt_id!r}"
            )
        if index >= size:
            raise errors.Invalid(f"{where}.prompt_id: index {index} is outside the dataset (size {size})")
        if pass_ * size + index >= cursor:
            raise errors.Invalid(f"{where}.prompt_id: {group.prompt_id!r} was never leased (lease prompts first)")
        if group.prompt_id in seen:
            raise errors.Invalid(f"{where}.prompt_id: {group.prompt_id!r} appears twice in this batch")
        seen.add(group.prompt_id)
        for c, comp in enumerate(group.completions):
            at = f"{where}.completions[{c}]"
            if comp.segments is None:
                if len(comp.token_ids) > max_new:
                    raise errors.Invalid(
                        f"{at}.token_ids: {len(comp.token_ids)} tokens, more than the sampling's max_new_tokens "
                        f"{max_new}"
                    )
            else:
                _check_trajectory(group, comp, at, max_new, spec)
        if in_vocab:  # the one pass above saw every token id below vocab_size
            continue
        _check_vocab(group.prompt_token_ids, vocab, f"{where}.prompt_token_ids")
        for c, comp in enumerate(group.completions):
            at = f"{where}.completions[{c}]"
            _check_vocab(comp.token_ids, vocab, f"{at}.token_ids", comp)
            if comp.prompt_token_ids is not None:
                _check_vocab(comp.prompt_token_ids, vocab, f"{at}.prompt_token_ids")


def _check_group_size(group: RolloutGroup, where: str, g_size: int, spec: RunSpec) -> None:
    """G completions, or G episodes of at most ``episode.max_turns`` model turns each when episodes are split."""
    if group.completions[0].episode is None:
        if len(group.completions) != g_size:
            raise errors.Invalid(
                f"{where}.completions: {len(group.completions)} completions, the run's group_size is {g_size}"
            )
        return
    episodes = group.episodes()
    if len(episodes) != g_size:
        raise errors.Invalid(f"{where}.completions: {len(episodes)} episodes, the run's group_size is {g_size}")
    max_turns = spec.episode.max_turns
    for e, members in enumerate(episodes):
        turns = sum(group.completions[i].turns() for i in members)
        if turns > max_turns:
            raise errors.Invalid(
                f"{where}.completions[{members[0]}].segments: episode {e} has {turns} model turns over its "
                f"{len(members)} samples, more than episode.max_turns {max_turns}"
            )


def _check_trajectory(group: RolloutGroup, comp: Completion, at: str, max_new: int, spec: RunSpec) -> None:
    """A multi-turn completion against the run's limits: each model turn is one generation (max_new_tokens), the
    whole sample is one training sequence (episode.max_episode_tokens), the turns are bounded (max_turns)."""
    assert comp.segments is not None
    limits = spec.episode
    turns = comp.turns()
    if turns > limits.max_turns:
        raise errors.Invalid(f"{at}.segments: {turns} model turns, more than episode.max_turns {limits.max_turns}")
    for s, seg in enumerate(comp.segments):
        if seg.kind == "model" and len(seg.token_ids) > max_new:
            raise errors.Invalid(
                f"{at}.segments[{s}].token_ids: {len(seg.token_ids)} tokens in one model turn, more than the "
                f"sampling's max_new_tokens {max_new}"
            )
    total = len(group.prompt_of(comp)) + len(comp.token_ids)
    if total > limits.max_episode_tokens:
        raise errors.Invalid(
            f"{at}.segments: {total} tokens with the prompt, more than episode.max_episode_tokens "
            f"{limits.max_episode_tokens}"
        )


def _check_vocab(ids: list[int], vocab: int, where: str, comp: Completion | None = None) -> None:
    if _max(ids) < vocab:
        return
    j = next(j for j, t in enumerate(ids) if t >= vocab)
    token = ids[j]
    if comp is not None and comp.segments is not None:  # name the segment the token came from
        start = 0
        for s, seg in enumerate(comp.segments):
            if j < start + len(seg.token_ids):
                where, j = f"{where.rsplit('.', 1)[0]}.segments[{s}].token_ids", j - start
                break
            start += len(seg.token_ids)
    raise errors.Invalid(f"{where}[{j}]: token id {token} >= vocab_size {vocab}")


def _all_below(arrays: list[Any], bound: int) -> bool:
    """Every item of every list or numpy array (a packed field kept as one) is below ``bound``."""
    if all(hasattr(a, "max") for a in arrays):
        import numpy as np

        return int(np.concatenate(arrays).max()) < bound
    return max(_max(a) for a in arrays) < bound


def _max(values: Any) -> int:
    """The largest of a list or of a numpy array: each at C speed."""
    return int(values.max()) if hasattr(values, "max") else max(values)


def _first_at_least(values: Any, bound: int) -> int:
    return next(j for j, t in enumerate(values) if t >= bound)


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


async def _unlock_if(locked: Any, r: Any, lock_key: str, token: str) -> None:
    if int(locked):
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


def _not_ready(run: str) -> errors.Unavailable:
    return errors.Unavailable(f"run {run!r}: its queue is being restored from the bucket; retry")


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
    """Validate, write the batch to the bucket, then enqueue its groups atomically (see module docstring).

    ``spec``: the run's spec, or a :data:`SpecLoader`; then the spec is the one the pre-check reads in its
    own round trip, and the loader is called only when that finds no spec (404 or a rebuild).
    ``groups_msgpack``: each group's msgpack as it arrived (``proxy/rollout_body.py``), stored as is; without
    it each group is packed here (``wire/packed.py``). ``digest``: ``rollout_body.content_digest`` of those
    (computed with the decoding, off the event loop for a large body)."""
    key = validate_idempotency_key(idempotency_key)
    k = QueueKeys.of(run)
    idem_id = idempotency_id(batch.worker_id, key)
    idem_key = k.idem(run, idem_id)
    lease_key = keys.run_key(run, keys.LEASE_INFO.format(id=batch.lease_id))
    spec_key = keys.run_key(run, keys.SPEC)
    # Each group's msgpack (packed arrays), stored as is: a claim splices it into its answer undecoded. The
    # batch's id comes from these bytes, so the pre-check can take the batch's write lock in its round trip.
    if groups_msgpack is None:
        groups_msgpack = [packed.packb(g) for g in batch.groups]
    batch_id = batch_id_for(idem_id, digest or content_digest(batch, groups_msgpack))
    # One attempt at a time writes (and, when refused, deletes) this batch's object: a retry arriving while
    # an earlier attempt of the same batch is still writing waits for it, so a refused attempt can never
    # delete the object another attempt has just enqueued (issue 10 item 8).
    lock_key, token = keys.run_key(run, f"queue:writing:{batch_id}"), secrets.token_hex(8)
    for _ in range(3):
        seen, latest, cursor, queued, leased, ready, raw_spec, locked, bound = await _PRECHECK(
            r,
            [idem_key, k.state, k.p.cursor, k.stream, lease_key, k.meta, k.p.meta, spec_key, lock_key],
            [GROUP, token, SUBMIT_LOCK_TTL_MS],
        )
        if not isinstance(spec, RunSpec):
            if not raw_spec:  # unknown run (the loader answers 404), or a wiped Redis (it rebuilds): check again
                spec = await spec()
                continue
            spec = runs.parse_spec(bytes(raw_spec))
        if int(ready) == 2:
            break
        await ensure_ready(r, store, run, spec)  # first touch since Redis (re)started
    else:
        raise _not_ready(run)
    assert isinstance(spec, RunSpec)
    if seen:
        return SubmitResponse.model_validate_json(seen).model_copy(update={"duplicate": True})
    try:
        _admit(run, spec, batch, int(cursor), int(latest), int(queued), leased, runs.bound_of(spec, bound))
    except errors.Stale:
        await r.hincrby(k.counters, "rejected_stale_total", len(batch.groups))
        await _unlock_if(locked, r, lock_key, token)
        raise
    except errors.Backpressure:
        pipe = r.pipeline(transaction=False)
        pipe.hincrby(k.counters, "backpressure_total", 1)
        pipe.hincrby(k.counters, "submit_backpressure_total", 1)
        await pipe.execute()
        await _unlock_if(locked, r, lock_key, token)
        raise
    except BaseException:
        await _unlock_if(locked, r, lock_key, token)
        raise
    n = len(batch.groups)
    obj = {
        "format": 3,
        "batch_id": batch_id,
        "idem": idem_id,
        "run": run,
        "accepted_at": time.time(),
        "worker_id": batch.worker_id,
        "lease_id": batch.lease_id,
        "version": batch.version,
        "prompt_ids": [g.prompt_id for g in batch.groups],
        "groups_msgpack": groups_msgpack,
        # What the groups were sampled with: recorded now, so a later change of the run's spec cannot change it.
        "sampling": (batch.sampling or spec.sampling).model_dump(mode="json"),
    }
    obj_bytes = msgpack.packb(obj, use_bin_type=True)
    deadline = time.monotonic() + SUBMIT_LOCK_WAIT_S
    while not int(locked):  # another attempt of this batch is writing: wait for it (or its answer)
        await asyncio.sleep(0.05)
        got = await _BEGIN_WRITE(r, [idem_key, lock_key], [token, SUBMIT_LOCK_TTL_MS])
        if _s(got[0]) == "duplicate":
            return SubmitResponse.model_validate_json(got[1]).model_copy(update={"duplicate": True})
        if _s(got[0]) == "ok":
            break
        if time.monotonic() > deadline:
            raise errors.Unavailable(f"run {run!r}: an earlier attempt of this batch is still being written; retry")
    answer = SubmitResponse(batch_id=batch_id, accepted_groups=n)
    released = False  # the enqueue script releases the lock when the object stays
    try:
        await asyncio.to_thread(store.put_bytes, batch_key(run, batch_id), obj_bytes)
        res = await _ENQUEUE(
            r,
            [k_ for k_ in (idem_key, k.state, k.stream, k.counters, k.entry, k.remaining)]
            + [k.p.open, k.p.inflight, k.p.owner, k.p.meta, k.meta, k.bseq, lock_key],
            [
                batch_id,
                GROUP,
                batch.version,
                spec.max_staleness,
                spec.queue_capacity_groups,
                batch.worker_id,
                IDEMPOTENCY_TTL_S,
                answer.model_dump_json(),
                n,
                token,
                *(g.prompt_id for g in batch.groups),
            ],
        )
        status = _s(res[0])
        released = status in ("ok", "duplicate")
        if status == "ok":
            return answer
        if status == "duplicate":  # a concurrent retry with the same key won
            first = SubmitResponse.model_validate_json(res[1])
            if first.batch_id != batch_id:  # same key, other content: ours is an orphan (and stays refused)
                await asyncio.to_thread(store.delete, [batch_key(run, batch_id)])
            return first.model_copy(update={"duplicate": True})
        if status == "notready":  # Redis was wiped between the checks and the commit
            raise _not_ready(run)
        # Refused after the write (latest moved or the queue filled meanwhile): the object must not stay.
        await _delete_if_held(r, store, run, batch_id, lock_key, token)
    finally:
        if not released:
            await _UNLOCK(r, [lock_key], [token])
    if status == "stale":
        raise _stale(run, batch.version, int(res[1]), spec)
    if status == "full":
        raise _full(run, int(res[1]), n, spec)
    raise errors.Invalid(f"version: {batch.version} is newer than the latest published version {int(res[1])}")


async def _delete_if_held(r: Any, store: BucketStore, run: str, batch_id: str, lock_key: str, token: str) -> None:
    """Delete a refused attempt's object, unless its write lock expired meanwhile (then another attempt of the
    batch may own the object now: leaving an orphan is the lesser harm)."""
    held = await r.get(lock_key)
    if held is not None and _s(held) == token:
        await asyncio.to_thread(store.delete, [batch_key(run, batch_id)])
    else:
        log.warning("run %r: batch %s: write lock expired before its refused object could be deleted", run, batch_id)


# -- claim ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredGroup:
    """One group as its batch object holds it: the msgpack that arrived (format 3) or the claim-answer JSON of
    format 2. A claim sends it on in the answer's own encoding undecoded; only the other encoding converts."""

    data: bytes
    is_json: bool = False

    def model(self) -> RolloutGroup:
        if self.is_json:
            return RolloutGroup.model_validate_json(self.data)
        return RolloutGroup.model_validate(msgpack.unpackb(self.data, raw=False))

    def as_json(self) -> bytes:
        return self.data if self.is_json else _GROUP_JSON.dump_json(self.model())

    def as_msgpack(self) -> bytes:
        return packed.packb(self.model()) if self.is_json else self.data


@dataclass(frozen=True)
class ClaimedGroup:
    """One delivery, its group as submit stored it (sent on as is: no decoding, no re-encoding)."""

    delivery_id: str
    version: int
    worker_id: str
    batch_id: str
    attempt: int
    group: StoredGroup
    sampling: SamplingSpec | None = None
    rebuilt_stale: bool = False  # handed over below the floor (a claim with hold_rebuilt): never trained

    def delivery(self) -> Delivery:
        return self._envelope([self.group.model()])

    def _envelope(self, groups: list[RolloutGroup]) -> Delivery:
        return Delivery.model_construct(
            delivery_id=self.delivery_id,
            version=self.version,
            groups=groups,
            worker_id=self.worker_id,
            batch_id=self.batch_id,
            attempt=self.attempt,
            sampling=self.sampling,
            rebuilt_stale=self.rebuilt_stale,
        )

    def delivery_json(self) -> bytes:
        """``self.delivery().model_dump_json()``, byte for byte, without decoding a stored JSON group: the
        envelope is the model's own serialisation with an empty ``groups``, into which the group is spliced
        (a bare ``"groups":[]`` can only be that key: quotes inside JSON strings are escaped)."""
        envelope = self._envelope([]).model_dump_json()
        before, sep, after = envelope.encode().partition(b'"groups":[]')
        assert sep, envelope
        return b"".join((before, b'"groups":[', self.group.as_json(), b"]", after))

    def delivery_msgpack(self) -> bytes:
        """The msgpack of the delivery (numeric arrays packed): the envelope's fields, then ``groups`` holding
        the stored group's bytes (a msgpack array is its header followed by its items' bytes)."""
        fields = self._envelope([]).model_dump(mode="json")
        del fields["groups"]
        p = msgpack.Packer(use_bin_type=True)
        parts = [p.pack_map_header(len(fields) + 1)]
        for key, value in fields.items():
            parts += [p.pack(key), p.pack(value)]
        parts += [p.pack("groups"), p.pack_array_header(1), self.group.as_msgpack()]
        return b"".join(parts)


# A claim answers msgpack (packed arrays) to a client that accepts it, JSON otherwise.
MSGPACK = "application/msgpack"


@dataclass
class ClaimOutcome:
    claimed: list[ClaimedGroup]
    dropped: int = 0
    lost: int = 0
    dropped_rebuilt: list[str] = field(default_factory=list)  # re-queued by a rebuild, dropped as stale

    @property
    def deliveries(self) -> list[Delivery]:
        """The deliveries as models (decodes every group: for callers in Python; the route sends the bytes)."""
        return [c.delivery() for c in self.claimed]

    def _envelope(self) -> ClaimResponse:
        return ClaimResponse(deliveries=[], dropped_stale=self.dropped, dropped_rebuilt=self.dropped_rebuilt)

    def response_json(self) -> bytes:
        """The :class:`ClaimResponse` JSON of this outcome, byte-identical to ``ClaimResponse(deliveries=
        self.deliveries, dropped_stale=self.dropped).model_dump_json()``."""
        envelope = self._envelope().model_dump_json().encode()
        before, sep, after = envelope.partition(b'"deliveries":[]')
        assert sep, envelope
        inner = b",".join(c.delivery_json() for c in self.claimed)
        return b"".join((before, b'"deliveries":[', inner, b"]", after))

    def response_msgpack(self) -> bytes:
        """The :class:`ClaimResponse` as msgpack, its groups spliced in as stored (packed arrays):
        ``ClaimResponse.model_validate(msgpack.unpackb(...))`` reads back what ``deliveries`` gives."""
        fields = self._envelope().model_dump(mode="json")
        del fields["deliveries"]
        p = msgpack.Packer(use_bin_type=True)
        parts = [p.pack_map_header(len(fields) + 1), p.pack("deliveries"), p.pack_array_header(len(self.claimed))]
        parts += [c.delivery_msgpack() for c in self.claimed]
        for key, value in fields.items():
            parts += [p.pack(key), p.pack(value)]
        return b"".join(parts)


async def claim(
    r: Any,
    store: BucketStore,
    run: str,
    spec: RunSpec,
    *,
    epoch: int,
    consumer: str,
    max_groups: int,
    wait_s: float,
    redelivery_timeout_s: float,
    min_version: int | None = None,
    train_version: int | None = None,
    sync_every: int = 1,
    cleaner: cleanup.BatchCleaner | None = None,
    request_id: str | None = None,
    release: list[str] | None = None,
    hold_rebuilt: bool = False,
) -> ClaimOutcome:
    """Up to ``max_groups`` deliveries; waits up to ``wait_s`` for the first one (long-poll).

    A group older than ``latest - max_staleness`` or than ``min_version`` (the trainer's own floor: the version
    its policy will have when it trains on this claim, minus max_staleness) is dropped and counted.
    ``train_version`` (that version) and ``sync_every`` record the trainer's pace for admission control.
    ``cleaner``: settle the bucket objects of batches this finishes in the background (the proxy's routes);
    without one they are settled before this returns. ``hold_rebuilt``: a group a rebuild re-queued that is
    below the floor is handed over flagged ``rebuilt_stale`` instead of dropped (``ClaimRequest.hold_rebuilt``).
    """
    k = QueueKeys.of(run)
    deadline = time.monotonic() + wait_s
    idle_ms = max(1, int(redelivery_timeout_s * 1000))
    total = ClaimOutcome([])
    if request_id is not None and not CLAIM_REQUEST_ID_RE.match(request_id):
        raise errors.Invalid("request_id: must be 1..64 characters of [A-Za-z0-9_.-]")
    release_ids = list(dict.fromkeys(release or []))
    validate_delivery_ids(release_ids, "release")
    while True:
        res = await _CLAIM(
            r,
            [
                *(k.stream, k.state, k.counters, k.entry, k.remaining, k.attempts, k.settled),
                *(k.meta, k.p.meta, k.bseq, k.doomed, k.p.pace, k.p.channel, k.owner),
                k.claim_request(run, epoch, request_id),
                k.redropped,
                k.rebuilt,
            ],
            [
                *(GROUP, consumer, max_groups, epoch, idle_ms, spec.max_staleness, min_version or 0),
                *(train_version or 0, sync_every, spec.groups_per_step, request_id or "", CLAIM_REPLAY_TTL_S),
                "1" if hold_rebuilt else "0",
                *release_ids,
            ],
        )
        release_ids = []  # given back by the first pass
        if _s(res[0]) == "notready":
            await ensure_ready(r, store, run, spec)
            continue
        if _s(res[0]) == "fenced":
            raise await fenced_or_restoring(r, run, epoch, int(res[1]), "(claim)")
        dropped, last, entries = int(res[1]), _s(res[2]), res[3]
        total.dropped += dropped
        total.dropped_rebuilt += [_s(d) for d in res[6]]
        await _settle_objects(r, store, run, spec, res[4], int(res[5]), cleaner)
        if entries:
            got = await _deliveries(r, store, run, spec, entries, idle_ms, cleaner)
            total.claimed.extend(got.claimed)
            total.lost += got.lost
            if total.claimed:
                return total
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return total
        # Block until an entry newer than the stream's last id exists (a submit), or a slice passes
        # (pending deliveries may have timed out meanwhile).
        await r.xread({k.stream: last}, count=1, block=max(1, int(min(remaining, _slice_s(r)) * 1000)))


def _slice_s(r: Any) -> float:
    """How long one blocking read may last: under the client's socket timeout, or it would look like an outage."""
    timeout = getattr(getattr(r, "connection_pool", None), "connection_kwargs", {}).get("socket_timeout")
    return min(WAIT_SLICE_S, float(timeout) / 2) if timeout else WAIT_SLICE_S


async def _deliveries(
    r: Any,
    store: BucketStore,
    run: str,
    spec: RunSpec,
    entries: list[Any],
    idle_ms: int,
    cleaner: cleanup.BatchCleaner | None = None,
) -> ClaimOutcome:
    """Turn claimed stream entries into deliveries by reading their batch objects from the bucket."""
    parsed = [(_s(e[0]), _s(e[1]), int(e[2]), _s(e[3]), int(e[4]), bool(int(e[5]))) for e in entries]
    batch_ids = sorted({d.rsplit(":", 1)[0] for _, d, *_ in parsed})
    try:
        # One thread hop for all the reads (a hop costs more CPU than reading a local object).
        loaded = await asyncio.to_thread(lambda: [_load_groups(store, run, b) for b in batch_ids])
    except BaseException:
        # Claimed in Redis but not handed out: make them re-claimable now instead of after the timeout.
        k = QueueKeys.of(run)
        await _REQUEUE(r, [k.stream, k.owner], [GROUP, idle_ms, *(x for sid, d, *_ in parsed for x in (sid, d))])
        raise
    batches = dict(zip(batch_ids, loaded, strict=True))
    out = ClaimOutcome([])
    lost: list[str] = []
    for _sid, d, version, worker, attempt, below in parsed:
        b, g = d.rsplit(":", 1)
        stored = batches[b]
        if stored is None or int(g) >= len(stored.groups):
            lost.append(d)
            continue
        group = stored.groups[int(g)]
        out.claimed.append(ClaimedGroup(d, version, worker, b, attempt, group, stored.sampling, rebuilt_stale=below))
    if lost:
        log.error(
            "run %r: %d claimed groups have no batch object in the bucket; counted as lost: %s",
            run,
            len(lost),
            lost[:5],
        )
        out.lost = await _settle(r, store, run, spec, lost, epoch=0, counter="lost_total", cleaner=cleaner)
    return out


def _load_batch(store: BucketStore, run: str, batch_id: str) -> dict[str, Any] | None:
    try:
        return msgpack.unpackb(store.get_bytes(batch_key(run, batch_id)), raw=False)
    except errors.NotFound:
        return None


@dataclass(frozen=True)
class StoredGroups:
    groups: list[StoredGroup]
    sampling: SamplingSpec | None  # None in objects written before batches recorded it


def _load_groups(store: BucketStore, run: str, batch_id: str) -> StoredGroups | None:
    """Each group of a batch object as stored, and its sampling (None when the object is gone).

    Format 3 objects carry ``groups_msgpack``, format 2 ``groups_json``; only that key is decoded, the rest
    skipped unread. A format 1 object (the batch's own fields) is decoded and validated as before."""
    try:
        raw = store.get_bytes(batch_key(run, batch_id))
    except errors.NotFound:
        return None
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(raw), 1))
    unpacker.feed(raw)
    stored: list[StoredGroup] | None = None
    groups: list[Any] = []
    sampling: SamplingSpec | None = None
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        if key == "groups_msgpack":
            stored = [StoredGroup(g) for g in unpacker.unpack()]
        elif key == "groups_json":
            stored = [StoredGroup(g, is_json=True) for g in unpacker.unpack()]
        elif key == "groups" and stored is None:
            groups = unpacker.unpack()
        elif key == "sampling":  # None in a format-1 object (the batch's own fields) that had none
            raw_sampling = unpacker.unpack()
            sampling = None if raw_sampling is None else SamplingSpec.model_validate(raw_sampling)
        else:
            unpacker.skip()
    if stored is None:
        stored = [StoredGroup(packed.packb(RolloutGroup.model_validate(g))) for g in groups]
    return StoredGroups(stored, sampling)


# -- ack -----------------------------------------------------------------------------------------------


def validate_delivery_ids(ids: list[str], field: str = "delivery_ids") -> None:
    for i, d in enumerate(ids):
        if not DELIVERY_ID_RE.match(d):
            raise errors.Invalid(f"{field}[{i}]: {d[:80]!r} is not a delivery id from a claim")


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
    wiped queue or to persist prompts, so a loader is called only then. ``cleaner``: as for :func:`claim`."""
    validate_delivery_ids(delivery_ids)
    if not delivery_ids:
        return 0
    ids = list(dict.fromkeys(delivery_ids))
    return await _settle(r, store, run, spec, ids, epoch=epoch, counter="acked_total", cleaner=cleaner)


async def _settle(
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
    k = QueueKeys.of(run)
    for _ in range(3):
        res = await _ACK(
            r,
            [
                *(k.stream, k.state, k.counters, k.entry, k.remaining, k.attempts, k.settled),
                *(k.p.meta, k.meta, k.bseq, k.doomed, k.owner, k.redropped, k.rebuilt),
            ],
            [GROUP, epoch, counter, *ids],
        )
        if _s(res[0]) != "notready":
            break
        spec = await _spec_of(spec)
        await ensure_ready(r, store, run, spec)
    else:
        raise _not_ready(run)
    if _s(res[0]) == "fenced":
        raise await fenced_or_restoring(r, run, epoch, int(res[1]), "(ack)")
    await _settle_objects(r, store, run, spec, res[3], int(res[2]), cleaner)
    return int(res[1])


async def _spec_of(spec: RunSpec | SpecLoader) -> RunSpec:
    return spec if isinstance(spec, RunSpec) else await spec()


async def _settle_objects(
    r: Any,
    store: BucketStore,
    run: str,
    spec: RunSpec | SpecLoader,
    finished: list[Any],
    persist_seq: int,
    cleaner: cleanup.BatchCleaner | None,
) -> None:
    """The bucket side of a script's settles (``state/cleanup.py``): in the background with a cleaner."""
    done = [_s(b) for b in finished]
    if cleaner is not None:
        cleaner.submit(run, spec, done, persist_seq)
    else:
        await cleanup.settle_objects(r, store, run, spec, done, persist_seq)


# -- trainer epochs, status, rebuild -------------------------------------------------------------------


async def on_trainer_registered(r: Any, run: str, epoch: int, redelivery_timeout_s: float) -> bool:
    """A new trainer epoch: every pending (claimed, unacked) delivery becomes re-claimable now."""
    k = QueueKeys.of(run)
    idle_ms = max(1, int(redelivery_timeout_s * 1000))
    return bool(await _RELEASE_PENDING(r, [k.stream, k.meta], [GROUP, epoch, idle_ms]))


async def queue_status(r: Any, run: str, spec: RunSpec) -> QueueStatus:
    """The queue part of ``GET /v1/runs/{run}/status``: depth, pending, and the invariant-4 counters.

    ``groups`` = queued, not yet claimed; ``pending`` = claimed, not yet acked.
    """
    k = QueueKeys.of(run)
    pipe = r.pipeline(transaction=True)
    pipe.exists(k.stream)
    pipe.xlen(k.stream)
    pipe.hmget(k.counters, *COUNTER_FIELDS)
    exists, length, counts = await pipe.execute()
    pending = 0
    if exists:
        pending = int((await r.xpending(k.stream, GROUP))["pending"])
    c = {f: int(v or 0) for f, v in zip(COUNTER_FIELDS, counts, strict=True)}
    return QueueStatus(
        groups=int(length) - pending,
        capacity=spec.queue_capacity_groups,
        pending=pending,
        accepted_total=c["accepted_total"],
        acked_total=c["acked_total"],
        dropped_stale_total=c["dropped_stale_total"],
        rejected_stale_total=c["rejected_stale_total"],
        backpressure_total=c["backpressure_total"],
        lost_total=c["lost_total"],
    )


async def counters(r: Any, run: str) -> dict[str, int]:
    raw = await r.hgetall(QueueKeys.of(run).counters)
    return {_s(f): int(v) for f, v in raw.items()}


async def ensure_ready(r: Any, store: BucketStore, run: str, spec: RunSpec) -> dict[str, int]:
    """Make this Redis hold the run's queue and prompt state, rebuilding both from the bucket if it lost them.

    Called by the proxy core's rebuild (``REBUILD_HOOKS``) and lazily by the first queue or prompt call of a
    run that is not ``ready`` (a wiped Redis, or a new run): the groups of the bucket's batch objects that the
    newest snapshot does not show settled are enqueued again, the lifetime counters continue from it
    (:func:`_requeue`), and the idempotency records are restored; then the prompt cursor comes back from the
    same snapshot (see ``state/prompts.py``). A ``ready`` flag, set in the same transaction, makes it
    idempotent and safe for several replicas at once. Returns what was restored.
    """
    k = QueueKeys.of(run)
    out = {"batches": 0, "groups": 0, "prompt_cursor": 0}
    q_ready, p_ready = await r.hexists(k.meta, "ready"), await r.hexists(k.p.meta, "ready")
    if q_ready and p_ready:
        return out
    raw = await asyncio.to_thread(prompts.read_snapshot, store, run)
    snap = json.loads(raw) if raw else None
    loaded = await _load_settled_batches(store, run)
    completed = {p for _, _, obj, _ in loaded for p in summarize(obj).prompt_ids}
    if not q_ready:
        out.update(await _requeue(r, run, k, loaded, snap.get("queue") if isinstance(snap, dict) else None))
    if not p_ready:
        out["prompt_cursor"] = await prompts.restore(r, run, spec, completed, raw) or 0
    if out["groups"] or out["prompt_cursor"]:
        log.warning("run %r: rebuilt from the bucket: %s", run, out)
    return out


async def _load_settled_batches(store: BucketStore, run: str) -> list[tuple[float, str, dict[str, Any], set[int]]]:
    """Every batch object of the run, oldest first, with the group indices its marker lists as settled."""
    listed = await asyncio.to_thread(store.list_keys, f"runs/{run}/rollouts/")
    names = {key.rsplit("/", 1)[1] for key in listed}
    loaded: list[tuple[float, str, dict[str, Any], set[int]]] = []
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


async def _requeue(
    r: Any,
    run: str,
    k: QueueKeys,
    loaded: list[tuple[float, str, dict[str, Any], set[int]]],
    snap: dict[str, Any] | None,
) -> dict[str, int]:
    """Enqueue the live groups of the bucket's batch objects; restore the lifetime counters.

    ``snap``: the queue section of the newest snapshot (``prompts.json``; None when it has none, or was written
    by an older proxy). With one, the counters continue from it and a batch it shows live is re-enqueued minus
    the groups it shows settled; a batch it shows finished is only deleted (``queue:doomed``); a batch it does
    not know was accepted after it (its groups count as accepted now); a batch it shows live whose object is
    gone is counted lost. So ``accepted = acked + dropped + lost + queued + pending`` holds over the run's whole
    life. Groups settled after the snapshot was written come back (the trainer holds repeats: its ledger).
    Without one, markers name the settled groups and the counters start from the rebuild.
    """
    out = {"batches": 0, "groups": 0}
    live_s: dict[str, Any] = snap.get("live", {}) if snap else {}
    doomed_s = set(snap.get("doomed", [])) if snap else set()
    accepted = lost = 0
    # Explicit stream ids (accept order), so the delivery-id map is written in the same transaction.
    base_ms = int(time.time() * 1000)
    seq = 0
    async with r.pipeline(transaction=True) as pipe:
        try:
            await pipe.watch(k.meta, k.stream)
            if await pipe.hexists(k.meta, "ready"):
                return out  # another caller (replica) did it meanwhile
            # Counters this Redis kept (only its queue keys were lost) are the truth; after a wipe only the
            # refusal counters (which need no ready state) can be there, and the snapshot's add to them.
            restored_counters = await pipe.hexists(k.counters, "accepted_total")
            if await pipe.exists(k.stream):
                # A stream without the flag: Redis kept its queue (state from before the flag existed).
                pipe.multi()
                pipe.hset(k.meta, "ready", 1)
                await pipe.execute()
                return out
            pipe.multi()
            pipe.xgroup_create(k.stream, GROUP, id="0", mkstream=True)
            entry_map: dict[str, str] = {}
            present = set()
            for _, b, obj, marked in loaded:
                present.add(b)
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
                    accepted += len(live)
                for g in live:
                    d, sid = f"{b}:{g}", f"{base_ms}-{seq}"
                    seq += 1
                    # "r": re-queued by a rebuild (the trainer may have trained it: see the claim's drop)
                    pipe.xadd(k.stream, {"d": d, "v": summary.version, "w": summary.worker_id, "r": 1}, id=sid)
                    entry_map[d] = sid
                pipe.hset(k.remaining, b, len(live))
                if settled:
                    pipe.hset(k.settled, b, "".join(f"{g}," for g in sorted(settled)))
                if obj.get("idem"):
                    answer = SubmitResponse(batch_id=b, accepted_groups=n_groups)
                    pipe.set(k.idem(run, str(obj["idem"])), answer.model_dump_json(), ex=IDEMPOTENCY_TTL_S)
                out["batches"] += 1
                out["groups"] += len(live)
            missing = {b: int(v.get("remaining", 0)) for b, v in live_s.items() if b not in present}
            if missing:
                lost = sum(missing.values())
                log.error(
                    "run %r: the snapshot lists %d live batches (%d groups) that are not in the bucket; counted "
                    "as lost: %s",
                    run,
                    len(missing),
                    lost,
                    sorted(missing)[:5],
                )
            if snap is not None and not restored_counters:
                for name, value in snap.get("counters", {}).items():
                    pipe.hincrby(k.counters, name, int(value))
                if redropped := snap.get("redropped"):
                    pipe.hset(k.redropped, mapping=dict.fromkeys(redropped, 1))
            pipe.hincrby(k.counters, "accepted_total", accepted)
            pipe.hincrby(k.counters, "lost_total", lost)
            if entry_map:
                pipe.hset(k.entry, mapping=entry_map)
                # each of them may have been trained already: a claim with hold_rebuilt hands it over even when
                # below the floor (the trainer's ledger decides: ack or release), never drops it unasked
                pipe.hset(k.rebuilt, mapping=dict.fromkeys(entry_map, 1))
            pipe.hset(k.meta, "ready", 1)
            await pipe.execute()
        except redis_exc.WatchError:
            return {"batches": 0, "groups": 0}
    return out
