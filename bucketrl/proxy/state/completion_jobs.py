"""Completion jobs in Redis: queued by an external trainer's gateway, leased by generators, answered once.

Per job ``brl:{run}:cjob:{request_id}`` (a hash, expiring ``ttl_s`` after the submit): ``state`` (queued,
leased, done), ``request`` (the :class:`~bucketrl.wire.CompletionJobRequest` JSON), ``version`` (0: the base
model), ``seq`` (queue order), ``lease_id``/``worker`` while leased, ``result`` once done. The run's
``cjobs:queued`` zset orders the jobs waiting for a generator and ``cjobs:leased`` holds each leased job's
expiry. Every change is one Lua script, so two generators never lease the same job and an expired lease is
offered again exactly once (first in line, before jobs never leased). The first result posted wins; a later
one (a generator whose lease expired, a retry) changes nothing.

Only jobs of published versions are leased: a job naming a version the trainer has not published yet waits in
the queue, and the version's announcement wakes the generators long-polling for jobs. Wake-ups go through
``notify.py`` (topics ``jobs``: queued; ``jobdone``: answered). A Redis wipe loses the jobs (an asker then
reads 404 and submits again); nothing of them is in the bucket.
"""

from __future__ import annotations

from typing import Any

from bucketrl import errors
from bucketrl.proxy import keys
from bucketrl.proxy.notify import Notifier, poll_until
from bucketrl.proxy.state import versions
from bucketrl.proxy.state.lua import Lua
from bucketrl.proxy.state.runs import latest_version
from bucketrl.wire import RunSpec
from bucketrl.wire.completion_jobs import (
    CompletionJobAccepted,
    CompletionJobLease,
    CompletionJobLeaseRequest,
    CompletionJobRequest,
    CompletionJobResult,
    LeasedCompletionJob,
)

_SUBMIT = Lua.load("cjob_submit.lua")
_LEASE = Lua.load("cjob_lease.lua")
_RESULT = Lua.load("cjob_result.lua")

# How many queued jobs one lease looks at (oldest first): a bound on the script's work per call.
LEASE_SCAN = 2048
# A long-polled lease re-checks at least this often: an expired lease frees a job with no announcement.
LEASE_SLICE_S = 1.0


def _job(run: str, request_id: str) -> str:
    return keys.run_key(run, keys.CJOB + request_id)


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


async def _check_version(r: Any, run: str, version: int | None) -> None:
    """A published version must still be downloadable (410 ``version_gone``); a future one is allowed."""
    if version is None or version > await latest_version(r, run):
        return
    await versions.live_record(r, run, version)


def check_request(spec: RunSpec, req: CompletionJobRequest) -> None:
    bad = [t for t in req.prompt_token_ids if not 0 <= t < spec.vocab_size]
    if bad:
        raise errors.Invalid(
            f"prompt_token_ids: {len(bad)} token id(s) outside the run's vocabulary [0, {spec.vocab_size}), "
            f"e.g. {bad[0]}",
            code="bad_token",
        )


async def submit(r: Any, run: str, spec: RunSpec, req: CompletionJobRequest) -> CompletionJobAccepted:
    """Queue the job; a retry with the same ``request_id`` (and the same request) answers its state."""
    check_request(spec, req)
    await _check_version(r, run, req.version)
    code, state = await _SUBMIT(
        r,
        [
            _job(run, req.request_id),
            keys.run_key(run, keys.CJOBS_QUEUED),
            keys.run_key(run, keys.CJOBS_SEQ),
            keys.run_key(run, keys.CJOBS_CHANNEL),
        ],
        [req.request_id, req.model_dump_json(), req.version or 0, repr(float(req.ttl_s))],
    )
    if int(code) < 0:
        raise errors.Conflict(
            f"request_id {req.request_id!r} names another completion job (a retry must send the same request)",
            code="request_id_reused",
        )
    return CompletionJobAccepted(request_id=req.request_id, state=_text(state))  # type: ignore[arg-type]


async def state_of(r: Any, run: str, request_id: str) -> tuple[str, CompletionJobResult | None]:
    state, result = await r.hmget(_job(run, request_id), ["state", "result"])
    if state is None:
        raise errors.NotFound(
            f"run {run!r} has no completion job {request_id!r} (never submitted, or expired after its ttl_s)",
            code="unknown_job",
        )
    done = CompletionJobResult.model_validate_json(result) if result is not None else None
    return _text(state), done


async def wait_result(
    r: Any, notifier: Notifier | None, run: str, request_id: str, wait_s: float
) -> tuple[str, CompletionJobResult | None]:
    """The job's state and result, waiting up to ``wait_s`` for the result."""
    return await poll_until(
        notifier,
        run,
        ("jobdone",),
        wait_s,
        lambda: state_of(r, run, request_id),
        lambda x: x[1] is not None,
        recheck_s=LEASE_SLICE_S,
    )


async def _lease_once(r: Any, run: str, req: CompletionJobLeaseRequest) -> CompletionJobLease:
    flat = await _LEASE(
        r,
        [
            keys.run_key(run, keys.CJOBS_QUEUED),
            keys.run_key(run, keys.CJOBS_LEASED),
            keys.run_key(run, keys.STATE),
            keys.run_key(run, keys.CJOBS_SEQ),
        ],
        [
            repr(float(req.ttl_s)),
            req.max_jobs,
            req.worker_id,
            ",".join(map(str, req.loaded_versions)),
            "1" if req.base_model else "0",
            LEASE_SCAN,
            keys.run_key(run, keys.CJOB),
        ],
    )
    jobs = [
        LeasedCompletionJob(lease_id=_text(flat[i]), job=CompletionJobRequest.model_validate_json(flat[i + 1]))
        for i in range(0, len(flat), 2)
    ]
    return CompletionJobLease(jobs=jobs)


async def lease(
    r: Any, notifier: Notifier | None, run: str, req: CompletionJobLeaseRequest, wait_s: float
) -> CompletionJobLease:
    """Up to ``req.max_jobs`` jobs; with ``wait_s``, waits for a job to be queued, a version to be published
    or a lease to expire (no announcement: re-checked every :data:`LEASE_SLICE_S`)."""
    return await poll_until(
        notifier,
        run,
        ("jobs", "versions"),
        wait_s,
        lambda: _lease_once(r, run, req),
        lambda x: bool(x.jobs),
        recheck_s=LEASE_SLICE_S,
    )


def _check_result(job: CompletionJobRequest, res: CompletionJobResult) -> None:
    if res.version != job.version:
        raise errors.Invalid(f"result of version {res.version} for a job of version {job.version}", code="bad_result")
    if len(res.choices) != job.n:
        raise errors.Invalid(f"{len(res.choices)} choices for a job of n={job.n}", code="bad_result")
    for i, c in enumerate(res.choices):
        if len(c.token_ids) != len(c.logprobs) or len(c.token_ids) > job.max_tokens:
            raise errors.Invalid(
                f"choice {i}: {len(c.token_ids)} tokens, {len(c.logprobs)} logprobs (max_tokens {job.max_tokens})",
                code="bad_result",
            )


async def post_result(r: Any, run: str, res: CompletionJobResult) -> bool:
    """Answer the job; True if this result did, False if another answered it first (nothing changed)."""
    raw = await r.hget(_job(run, res.request_id), "request")
    if raw is None:
        await state_of(r, run, res.request_id)  # 404 unknown_job
    _check_result(CompletionJobRequest.model_validate_json(raw), res)
    got = await _RESULT(
        r,
        [
            _job(run, res.request_id),
            keys.run_key(run, keys.CJOBS_QUEUED),
            keys.run_key(run, keys.CJOBS_LEASED),
            keys.run_key(run, keys.CJOBS_DONE_CHANNEL),
        ],
        [res.request_id, res.model_dump_json()],
    )
    if int(got) < 0:
        await state_of(r, run, res.request_id)
    return int(got) == 1
