"""A prompt lease: up to n prompts, reissues first, granted while admission control allows.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from typing import Any

from bucketrl import errors
from bucketrl.proxy import keys
from bucketrl.proxy.notify import Notifier
from bucketrl.proxy.state import snapshot
from bucketrl.proxy.state.lua import Lua
from bucketrl.proxy.state.prompts import STREAM_GROUP, PromptKeys, admission_limit, prompt_item
from bucketrl.proxy.state.restore import ensure_ready
from bucketrl.storage.base import BucketStore
from bucketrl.wire import PromptLease, RunSpec

# Retry-After (s) of a prompt lease refused by admission control: about one trainer step.
RETRY_AFTER_S = 1.0
# Retry-After (s) of a lease of a held (paused, over budget) run: a person or a spec change releases it.
HELD_RETRY_AFTER_S = 5.0
# A long-polled lease re-checks at least this often: a prompt lease expiring frees room with no announcement.
PACE_SLICE_S = 0.5
# Versions of slack the pace rule keeps by default (module docstring; BUCKETRL_PACE_SLACK_VERSIONS): measured
# in the demo, 0 dropped about 10 % of the accepted groups, 1 almost none.
PACE_SLACK_VERSIONS = 1

_LEASE = Lua.load("queued_groups.lua", "prompt_lease.lua")


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
    count_refusal: bool = True,
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
            r, store, run, spec, worker_id, n, ttl_s, version, slack,
            count_refusal=count_refusal, request_id=request_id, spec_digest=spec_digest,
        )  # fmt: skip
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
                    await record_refusal(r, run)
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


class Held(errors.Backpressure):
    """A prompt lease of a run held by the pool (paused, or its token budget spent): 429, never a failure."""

    def __init__(self, run: str, why: str, spec: RunSpec) -> None:
        if why == "paused":
            message = f"run {run!r}: generation is paused; POST /v1/runs/{run}/generation/resume to go on"
        elif why == "finished":
            message = f"run {run!r}: finished (its trainer reached max_steps); a trainer registering again resumes it"
        else:
            message = (
                f"run {run!r}: its budget of {spec.budget_tokens} generated tokens is spent; raise budget_tokens "
                "in its spec (PUT /v1/runs/{run}) to go on"
            )
        super().__init__(message, retry_after=HELD_RETRY_AFTER_S)
        self.why = why


class PacedOut(errors.Backpressure):
    """A prompt lease refused by admission control (429 ``backpressure``, like any other)."""

    def __init__(self, message: str, *, retry_after: float, newer_version_exists: bool) -> None:
        super().__init__(message, retry_after=retry_after)
        # Refused by the trainer's pace while a version newer than the caller's is published.
        self.newer_version_exists = newer_version_exists


async def record_refusal(r: Any, run: str) -> None:
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
                keys.run_key(run, keys.POOL),
            ],
            [
                *(repr(float(ttl_s)), n, spec_digest, worker_id, spec.dataset.size, limit, STREAM_GROUP),
                *(version or 0, spec.groups_per_step, spec.max_staleness, effective_slack(slack, spec)),
                request_id or "",
                "" if spec.budget_tokens is None else spec.budget_tokens,
            ],
        )
        if int(res[0]) == -3:
            raise Held(run, res[1].decode() if isinstance(res[1], bytes) else str(res[1]), spec)
        if int(res[0]) == -2:
            raise SpecChanged(f"run {run!r}: its spec changed; read it again")
        if int(res[0]) != -1:
            break
        # First touch of this run since Redis (re)started: restore from the bucket before handing anything out.
        await ensure_ready(r, store, run, spec)
    else:
        raise errors.Unavailable(f"run {run!r}: prompt state is being restored; retry")
    if int(res[0]) == 0:
        inflight, queued, paced, at, used, latest = (int(x) for x in res[1:7])
        if count_refusal:
            await record_refusal(r, run)
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
    pids = [p.decode() if isinstance(p, bytes) else p for p in res[5:]]
    if cursor > reserved:
        # Positions past the persisted high-water mark are about to leave: record them first.
        await snapshot.persist(r, store, run, spec, min_reserved=cursor, min_seq=seq)
    return PromptLease(prompts=[prompt_item(p) for p in pids], expires_at=expires_at)
