"""Prompt leases: a persisted cursor over the dataset, reissue-first redelivery, admission control.

What a generator sees
---------------------
``POST /v1/runs/{run}/prompts/lease {"worker_id", "n", "ttl_s"}`` hands out up to ``n`` prompts as
``prompt_id = "{pass}-{index}"`` (``index`` in ``0..dataset.size-1``; ``pass`` counts trips over the
dataset). A prompt is *completed* when a rollout group for it is accepted (202, see ``state/queue.py``).
A lease that expires or is released before completion puts the prompt back on the *reissue list*, and
reissues are handed out before any never-issued position (docs/design.md invariant 5: no prompt is skipped, and a
completed one is never issued again within its pass).

Admission control (the pacing rule)
-----------------------------------
The trainer eats ``groups_per_step`` groups per optimizer step and, at most, publishes one version per
step, so a group generated now at version v is trained ``W / groups_per_step`` steps later, where W is
the work already ahead of it: groups queued (not yet claimed) plus prompts leased and still being
generated (each becomes one group). For that group to be trained within ``max_staleness`` versions::

    W = queued_groups + inflight_prompts  <=  limit = min(queue_capacity_groups,
                                                          groups_per_step * max(1, max_staleness))

So a lease is granted only while ``W < limit`` (partially: ``min(n, limit - W)`` prompts), and answered
429 + ``Retry-After`` otherwise: generation is paced at the trainer's speed instead of piling up groups
that would be dropped as stale at claim. Claimed-but-unacked groups do NOT count: the trainer acks only
after a checkpoint (TEAM.md ack protocol) and they are already being trained.

That limit alone leaves two things out, and the demo dropped 10-15 % of its groups as stale for them: the
trainer claims one step ahead (those groups are no longer queued but not trained yet), and the generator
samples with the version it has loaded, which may lag ``latest``. So the trainer's claims also record its
pace (``brl:{run}:queue:pace``): ``at``, the version of the step the next queued group joins, ``room``, how
many more groups that step takes, and ``sync``, steps per published version. A lease carries the caller's
``version`` g, and its groups at positions ``W .. W+n-1`` are trained with at most ``at + ceil(j / sync)``
where j counts the steps after that one. They must be within ``max_staleness`` of g, less a slack of
``PACE_SLACK_VERSIONS`` (1)::

    W + granted  <=  room + (max_staleness - (at - g) - slack) * sync * groups_per_step

(and never 0 while the pipeline is empty, so a run cannot stall). Before the trainer's first claim, or with
a trainer that sends no ``train_version``, only ``limit`` applies. Why the slack: positions are not FIFO in
lease order. A generator leases its next prompts while it samples the current ones, so another generator's
later lease is often submitted first and pushes these groups back a step; and a batch may be sampled with a
version older than the one it announced (weight sync takes a few hundred ms). Measured in the demo
(``bench/demo_reward.py``): slack 0 still dropped about 10 % of accepted groups, slack 1 0-2 %, with the
same wall time. The slack costs one step of queued work, which matters when max_staleness is small (with 2,
only the step being filled takes new work): ``BUCKETRL_PACE_SLACK_VERSIONS=0`` trades that back. The slack
used is ``min(slack, max_staleness)`` (:func:`effective_slack`): strict on-policy runs (max_staleness 0) have
none, and there a lease for a version older than the one the next step trains with is never granted (not
even into an empty pipeline): its groups could only be dropped. The generator asks again once it has fetched
the version the trainer is about to publish (a long-polled lease is answered 429 Retry-After 0 as soon as a
newer version than the caller's is published).

A lease with ``wait_s`` long-polls: instead of a 429 at once it waits for the run's ``pipeline``
announcement (a claim took groups, the pace changed, prompts were released; ``notify.py``) or a new version
and tries again, so a generator gets its prompts the moment the trainer makes room.

Redis state (all changes in single Lua scripts, so concurrent proxies cannot interleave)
---------------------------------------------------------------------------------------
``brl:{run}:prompts:cursor``    next never-issued global position g (pass = g // size, index = g % size)
``brl:{run}:prompts:inflight``  zset prompt_id -> lease expiry (unix s)
``brl:{run}:prompts:owner``     hash prompt_id -> worker_id holding the lease
``brl:{run}:prompts:reissue``   list of prompt ids to issue again (expired / released), issued first
``brl:{run}:prompts:open``      set of issued, not yet completed prompt ids (inflight ∪ reissue ∪ expired)
``brl:{run}:prompts:meta``      hash seq (bumped on every change), persisted_seq, persisted_reserved, ready

Persistence (a Redis wipe must not restart the dataset)
-------------------------------------------------------
``runs/{run}/prompts.json`` holds ``cursor``, ``reserved`` (a high-water mark >= every position handed out
so far), the ``open`` prompts and the live leases. A lease that moves the cursor past the persisted
``reserved`` mark rewrites the snapshot (reserving ``RESERVE_AHEAD`` more positions) BEFORE it answers, so
one bucket write covers many leases. Every ack or claim that settles groups persists it (the cleaner, in the
background), and before a fully settled batch object (the only other record of its prompts' completion)
is deleted. The snapshot also carries the queue's state, read atomically with the prompts: the lifetime
counters, each live batch's settled groups and the finished batches not deleted yet (``state/queue.py``
restores the counters and the queue from it). A rebuild (``restore``) therefore sets the
cursor to ``reserved``, treats ``open`` plus every position in ``[cursor, reserved)`` as to-be-reissued, and
drops from that the prompts of batches still in the bucket (they completed): nothing skipped, and at worst
a prompt completed after the last snapshot whose batch is still queued is not repeated either.

Runbook: ``redis-cli ZRANGE brl:{run}:prompts:inflight 0 -1 WITHSCORES`` lists leases;
``LRANGE brl:{run}:prompts:reissue 0 -1`` what will be reissued next; ``GET brl:{run}:prompts:cursor``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import re
import secrets
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis import exceptions as redis_exc

from bucketrl import errors
from bucketrl.proxy import keys
from bucketrl.proxy.state.clock import redis_now
from bucketrl.proxy.state.lua import Lua
from bucketrl.storage.base import BucketStore
from bucketrl.wire import PromptLease, PromptLeaseItem, RunSpec

if TYPE_CHECKING:
    from bucketrl.proxy.notify import Notifier

log = logging.getLogger("bucketrl.proxy.prompts")

# The Redis consumer group of the rollout stream (shared with state/queue.py, which builds on this module).
STREAM_GROUP = "trainer"
# How many positions past the cursor one snapshot write reserves (bounds bucket writes to 1 per this many).
RESERVE_AHEAD = 256
PROMPT_ID_RE = re.compile(r"^(0|[1-9][0-9]{0,11})-(0|[1-9][0-9]{0,11})$")
# Retry-After (s) of a prompt lease refused by admission control: about one trainer step.
RETRY_AFTER_S = 1.0
# A long-polled lease re-checks at least this often: a prompt lease expiring frees room with no announcement.
PACE_SLICE_S = 0.5
# Versions of slack the pace rule keeps by default (module docstring; BUCKETRL_PACE_SLACK_VERSIONS): measured
# in the demo, 0 dropped about 10 % of the accepted groups, 1 almost none.
PACE_SLACK_VERSIONS = 1
# How far a restore moves the state's seq past its snapshot's: far more than the changes (leases, submits) a wiped
# Redis can have made since its last snapshot was written (every settle writes one).
RESTORE_SEQ_STRIDE = 1_000_000
_LOCK_TTL_MS = 30_000
_LOCK_WAIT_S = 15.0


@dataclass(frozen=True)
class PromptKeys:
    cursor: str
    inflight: str
    owner: str
    reissue: str
    open: str
    meta: str
    lock: str
    stream: str
    counters: str
    queue_meta: str
    state: str
    pace: str
    channel: str

    @classmethod
    @functools.lru_cache(maxsize=4096)  # frozen, and built on every request: once per run is enough
    def of(cls, run: str) -> PromptKeys:
        k = keys.run_key
        return cls(
            cursor=k(run, keys.PROMPT_CURSOR),
            inflight=k(run, keys.PROMPT_INFLIGHT),
            owner=k(run, "prompts:owner"),
            reissue=k(run, keys.PROMPT_REISSUE),
            open=k(run, "prompts:open"),
            meta=k(run, "prompts:meta"),
            lock=k(run, "prompts:persist-lock"),
            stream=k(run, keys.QUEUE_STREAM),
            counters=k(run, keys.COUNTERS),
            queue_meta=k(run, "queue:meta"),
            state=k(run, keys.STATE),
            pace=k(run, "queue:pace"),
            channel=k(run, keys.PIPELINE_CHANNEL),
        )


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


def admission_limit(spec: RunSpec) -> int:
    """Most queued groups + in-flight prompts the pipeline may hold (see the module docstring)."""
    return max(1, min(spec.queue_capacity_groups, spec.groups_per_step * max(1, spec.max_staleness)))


def parse_prompt_id(prompt_id: str) -> tuple[int, int] | None:
    """``"3-17"`` -> ``(3, 17)`` (pass, index); None when malformed."""
    m = PROMPT_ID_RE.match(prompt_id)
    return (int(m.group(1)), int(m.group(2))) if m else None


def prompt_item(prompt_id: str) -> PromptLeaseItem:
    parsed = parse_prompt_id(prompt_id)
    assert parsed is not None, prompt_id
    return PromptLeaseItem(prompt_id=prompt_id, index=parsed[1], pass_=parsed[0])


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


_LEASE = Lua.load("queued_groups.lua", "prompt_lease.lua")

_RENEW = Lua.load("prompt_renew.lua")

_RELEASE = Lua.load("prompt_release.lua")

_SNAPSHOT = Lua.load("prompt_snapshot.lua")

_MARK_PERSISTED = Lua.load("prompt_mark_persisted.lua")

_UNLOCK = Lua.load("unlock.lua")


def effective_slack(slack: int, spec: RunSpec) -> int:
    """The slack rule: ``min(slack, max_staleness)`` versions.

    The slack absorbs groups pushed back a step by out-of-order submission, which is harmless while they stay
    within max_staleness. With max_staleness 0 (strict on-policy) a group pushed into the next step is stale
    whatever the slack, and any slack > 0 makes every lease "too stale" by the rule, so only the
    empty-pipeline guard would grant (one lease per step, for one generator). With no slack, leases for the
    version the step being filled trains with are granted up to exactly that step's remaining room, so the
    groups in flight are the ones that step trains on: bench/on_policy_waste.py measures the waste (< 5 %).
    """
    return min(slack, spec.max_staleness)


async def lease(
    r: Any,
    store: BucketStore,
    run: str,
    spec: RunSpec,
    worker_id: str,
    n: int,
    ttl_s: float,
    *,
    version: int | None = None,
    wait_s: float = 0.0,
    notifier: Notifier | None = None,
    slack: int = PACE_SLACK_VERSIONS,
    request_id: str | None = None,
    spec_digest: str = "",
) -> PromptLease:
    """Lease up to ``n`` prompts (fewer when admission control allows fewer). 429 when none may be.

    ``spec_digest``: :func:`spec_digest` of ``spec`` when the caller took it from a cache instead of reading it
    in this request: :class:`SpecChanged` (nothing done) when the run's stored spec is no longer that one.

    ``request_id``: a replay of a lease that handed prompts out answers those (the ones the worker still holds).

    ``version``: the policy version the caller samples with (None: the latest). ``wait_s`` > 0 long-polls: a
    refused lease waits for the run's ``pipeline`` or ``versions`` announcements (or a lease expiry, checked
    every ``PACE_SLICE_S``) and tries again until ``wait_s`` passes; the 429 after a wait says Retry-After 0.
    """
    if wait_s <= 0 or notifier is None:
        return await _lease_once(
            r, store, run, spec, worker_id, n, ttl_s, version, slack, request_id=request_id, spec_digest=spec_digest
        )
    t0 = time.monotonic()
    deadline = t0 + wait_s
    while True:
        # Registered BEFORE the attempt: an announcement between the refusal and the wait is not lost.
        with notifier.waiter(run, "pipeline", "versions") as event:
            try:
                got = await _lease_once(
                    r,
                    store,
                    run,
                    spec,
                    worker_id,
                    n,
                    ttl_s,
                    version,
                    slack,
                    count_refusal=False,
                    request_id=request_id,
                    spec_digest=spec_digest,
                )
                got.waited_s = time.monotonic() - t0
                return got
            except PacedOut as exc:
                remaining = deadline - time.monotonic()
                # Paced out with a newer version published: waiting cannot help (the trainer's pace only moves
                # further from the caller's version); asking again with the newer version can.
                if remaining <= 0 or exc.newer_version_exists:
                    await _count_refusal(r, run)
                    exc.retry_after = 0.0
                    raise
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), min(remaining, PACE_SLICE_S))


class SpecChanged(errors.Unavailable):
    """The run's stored spec is not the one a cached-spec lease was computed from (changed, or the run gone):
    nothing was done; the caller reads the spec again and retries. A 503 (retryable) if it ever got out."""


def spec_digest(spec: RunSpec) -> str:
    """The digest a lease's script compares with the stored spec's (stored as ``model_dump_json``)."""
    return hashlib.sha1(spec.model_dump_json().encode()).hexdigest()  # an identity, not a security check


class PacedOut(errors.Backpressure):
    """A prompt lease refused by admission control (429 ``backpressure``, like any other)."""

    def __init__(self, message: str, *, retry_after: float, newer_version_exists: bool) -> None:
        super().__init__(message, retry_after=retry_after)
        # Refused by the trainer's pace while a version newer than the caller's is published.
        self.newer_version_exists = newer_version_exists


async def _count_refusal(r: Any, run: str) -> None:
    """One refused lease request in the run's counters (a long-poll's retries count once)."""
    pipe = r.pipeline(transaction=False)
    pipe.hincrby(PromptKeys.of(run).counters, "backpressure_total", 1)
    pipe.hincrby(PromptKeys.of(run).counters, "prompts_backpressure_total", 1)
    await pipe.execute()


async def _lease_once(
    r: Any,
    store: BucketStore,
    run: str,
    spec: RunSpec,
    worker_id: str,
    n: int,
    ttl_s: float,
    version: int | None,
    slack: int,
    *,
    count_refusal: bool = True,
    request_id: str | None = None,
    spec_digest: str = "",
) -> PromptLease:
    k = PromptKeys.of(run)
    limit = admission_limit(spec)
    for _ in range(3):
        res = await _LEASE(
            r,
            [
                *(k.cursor, k.inflight, k.owner, k.reissue, k.open, k.meta),
                *(k.stream, k.counters, k.queue_meta, k.state, k.pace),
                keys.run_key(run, f"prompts:leasereq:{worker_id}:{request_id or '-'}"),
                keys.run_key(run, keys.SPEC),
            ],
            [
                *(repr(float(ttl_s)), n, spec_digest, worker_id, spec.dataset.size, limit, STREAM_GROUP),
                *(version or 0, spec.groups_per_step, spec.max_staleness, effective_slack(slack, spec)),
                request_id or "",
            ],
        )
        if int(res[0]) == -2:
            raise SpecChanged(f"run {run!r}: its spec changed; read it again")
        if int(res[0]) != -1:
            break
        # First touch of this run since Redis (re)started: restore from the bucket before handing anything out.
        from bucketrl.proxy.state import queue

        await queue.ensure_ready(r, store, run, spec)
    else:
        raise errors.Unavailable(f"run {run!r}: prompt state is being restored; retry")
    if int(res[0]) == 0:
        inflight, queued, paced, at, used, latest = (int(x) for x in res[1:7])
        if count_refusal:
            await _count_refusal(r, run)
        if paced:
            message = (
                f"run {run!r}: {queued} queued groups + {inflight} in-flight prompts are ahead; a group sampled with "
                f"v{used} now would be trained after them, past v{at} + (the trainer's pace), more than "
                f"max_staleness={spec.max_staleness} versions later. Retry after the trainer consumed a step, or "
                "with a newer version."
            )
        else:
            message = (
                f"run {run!r}: the pipeline holds {queued} queued groups + {inflight} in-flight prompts, at the "
                f"admission limit {limit} = min(queue_capacity_groups, groups_per_step * max(1, max_staleness)); "
                "more would be trained too stale. Retry after the trainer consumed a step."
            )
        raise PacedOut(message, retry_after=RETRY_AFTER_S, newer_version_exists=bool(paced) and latest > used)
    seq, cursor, reserved, expires_at = int(res[1]), int(res[2]), int(res[3]), float(res[4])
    pids = [_s(p) for p in res[5:]]
    if cursor > reserved:
        # Positions past the persisted high-water mark are about to leave: record them first.
        await persist(r, store, run, spec, min_reserved=cursor, min_seq=seq)
    return PromptLease(prompts=[prompt_item(p) for p in pids], expires_at=expires_at)


async def renew(r: Any, run: str, worker_id: str, prompt_ids: list[str], ttl_s: float) -> PromptLease:
    """Extend the leases this worker still holds; the answer lists those renewed. 410 if none was."""
    k = PromptKeys.of(run)
    res = await _RENEW(r, [k.inflight, k.owner], [repr(float(ttl_s)), worker_id, *prompt_ids])
    expires_at, renewed = float(res[0]), [_s(p) for p in res[1:]]
    if prompt_ids and not renewed:
        raise errors.Gone(
            f"run {run!r}: worker {worker_id!r} holds none of these prompt leases any more "
            "(expired and reissued, completed, or never leased by it)"
        )
    return PromptLease(prompts=[prompt_item(p) for p in renewed], expires_at=expires_at)


async def release(r: Any, run: str, worker_id: str, prompt_ids: list[str]) -> int:
    """Give prompts back (issued again first); returns how many this worker held."""
    k = PromptKeys.of(run)
    return int(await _RELEASE(r, [k.inflight, k.owner, k.reissue, k.open, k.meta, k.channel], [worker_id, *prompt_ids]))


async def cursor(r: Any, run: str) -> int:
    raw = await r.get(PromptKeys.of(run).cursor)
    return int(raw) if raw else 0


async def prompts_inflight(r: Any, run: str, now: float | None = None) -> int:
    """Prompts under a live lease (for ``RunStatus.prompts_inflight``)."""
    now = await redis_now(r) if now is None else now
    return int(await r.zcount(PromptKeys.of(run).inflight, f"({now!r}", "+inf"))


def validate_prompt_ids(prompt_ids: list[str], field: str = "prompt_ids") -> None:
    for i, pid in enumerate(prompt_ids):
        if parse_prompt_id(pid) is None:
            raise errors.Invalid(f"{field}[{i}]: {pid[:60]!r} is not a prompt id of the form '<pass>-<index>'")


# -- persistence ------------------------------------------------------------------------------------


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
    running = _RUNNING.setdefault(r, {})
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


# (Redis client, run) -> the persist in progress in this process; weak on the client (apps come and go).
_RUNNING: weakref.WeakKeyDictionary[Any, dict[str, asyncio.Future[tuple[int, int]]]] = weakref.WeakKeyDictionary()


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
            r, [k.cursor, k.inflight, k.owner, k.open, k.meta, k.queue_meta, k.counters, *_queue_keys(run)], []
        )
        if not snap:
            raise errors.Unavailable(f"run {run!r}: prompt state is not in Redis (being restored); retry")
        cur, seq, reserved, open_ids, leased, owners, counters, remaining, settled, doomed, redropped = snap
        cur, seq = int(cur), int(seq)
        new_reserved = max(int(reserved), cur + max(RESERVE_AHEAD, admission_limit(spec)))
        leases = {_s(leased[i]): [float(leased[i + 1]), _s(owners[i // 2])] for i in range(0, len(leased), 2)}
        snapshot = {
            "format": 1,
            "run": run,
            "dataset_size": spec.dataset.size,
            "cursor": cur,
            "reserved": new_reserved,
            "seq": seq,
            "open": sorted((_s(p) for p in open_ids), key=_position_key(spec.dataset.size)),
            "leases": leases,
            "written_at": time.time(),
            "queue": _queue_section(counters, remaining, settled, doomed, redropped),
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


def redropped_key(run: str) -> str:
    """Redis hash: re-queued (rebuilt) deliveries dropped as stale, which a trainer that trained them may still
    ack (the ack then counts them acked instead of dropped; ``state/queue.py``)."""
    return keys.run_key(run, "queue:redropped")


def _queue_keys(run: str) -> tuple[str, str, str, str]:
    """The queue's remaining / settled / doomed / redropped hashes (named here: state/queue.py builds on this
    module)."""
    k = keys.run_key
    return k(run, "queue:remaining"), k(run, "queue:settled"), k(run, "queue:doomed"), redropped_key(run)


def _queue_section(
    counters: list[Any], remaining: list[Any], settled: list[Any], doomed: list[Any], redropped: list[Any]
) -> dict[str, Any]:
    """The queue's part of a snapshot, read atomically with the prompts: the run's lifetime counters, each live
    batch's unsettled count and settled groups, the finished batches whose objects are not deleted yet, and the
    rebuilt deliveries dropped as stale that an ack may still move to acked.
    A rebuild restores the counters from it and re-enqueues exactly the groups it shows unsettled."""
    pairs = {_s(remaining[i]): int(remaining[i + 1]) for i in range(0, len(remaining), 2)}
    done = {_s(settled[i]): _s(settled[i + 1]) for i in range(0, len(settled), 2)}
    return {
        "counters": {_s(counters[i]): int(counters[i + 1]) for i in range(0, len(counters), 2)},
        "live": {
            b: {"remaining": n, "settled": sorted({int(g) for g in done.get(b, "").split(",") if g})}
            for b, n in sorted(pairs.items())
        },
        "doomed": sorted(_s(b) for b in doomed),
        "redropped": sorted(_s(d) for d in redropped),
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
