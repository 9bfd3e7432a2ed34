"""The generator pool: one lease for generators serving several runs, and per-run pause of generation.

``POST /v1/pool/lease``                    prompts of the run fair share picks (``state/pool.py``)
``GET  /v1/pool``                          every run the caller's token reaches: share, tokens, hold
``POST /v1/runs/{run}/generation/pause``   pool and per-run leases skip the run (429, never a failure)
``POST /v1/runs/{run}/generation/resume``  it takes its share again, from the pool's current position

The pool lease names no run in its path, so ``deps.run_scope`` cannot check it: it checks the token's scope
itself, on every run it would serve (an explicitly named run out of scope is 403, as on a ``{run}`` route).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Annotated

from fastapi import APIRouter, Depends

from bucketrl import errors
from bucketrl.proxy import body, keys, rebuild
from bucketrl.proxy.auth import Principal
from bucketrl.proxy.context import ProxyContext
from bucketrl.proxy.deps import CtxDep, GeneratorRole, RunDep, TrainerRole, ViewerRole, resolve_run
from bucketrl.proxy.errors import responses
from bucketrl.proxy.routes.prompts import lease_cached, spec_of
from bucketrl.proxy.state import pool, prompt_lease, runs
from bucketrl.wire import PromptLeaseRequest, RunSpec
from bucketrl.wire.pool import PoolLease, PoolLeaseRequest, PoolStatus, RunPoolStatus

router = APIRouter(tags=["pool"])

# How long a pool lease's request id remembers the run its first attempt picked (s).
REQUEST_TTL_S = 600


@router.post(
    "/v1/pool/lease",
    response_model=PoolLease,
    summary="Lease prompts of the run that weighted fair share picks among those the caller may serve.",
    description=(
        "The runs are tried in the order of (tokens generated + tokens in flight) / share, fewest first; the "
        "first whose own admission control grants answers, as its `POST /v1/runs/{run}/prompts/lease` would. "
        "Paused runs and runs whose budget_tokens is spent are skipped. 429 when no run grants (after `wait_s` "
        "of long-polling), listing why each was passed over."
    ),
    responses=responses(401, 403, 404, 413, 422, 429, 503),
    openapi_extra=body.openapi_body(PoolLeaseRequest),
)
async def pool_lease(
    ctx: CtxDep,
    principal: GeneratorRole,
    req: Annotated[PoolLeaseRequest, Depends(body.decoded(PoolLeaseRequest))],
) -> PoolLease:
    candidates = await _candidates(ctx, principal, req)
    if req.request_id is not None:
        first = await ctx.redis.get(_request_key(req))
        picked = first.decode() if isinstance(first, bytes) else first
        candidates = [c for c in candidates if c[0] == picked] or candidates
    t0 = time.monotonic()
    deadline = t0 + min(req.wait_s, ctx.settings.max_wait_s)
    while True:
        with contextlib.ExitStack() as stack:
            # Registered BEFORE the attempt (as a per-run long-poll does): no announcement is lost.
            notifier = ctx.notifier
            events = (
                []
                if notifier is None
                else [stack.enter_context(notifier.waiter(run, "pipeline", "versions")) for run, _ in candidates]
            )
            got, passed = await _try_once(ctx, candidates, req)
            if got is not None:
                got.waited_s = time.monotonic() - t0
                return got
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                # Each run refused by its admission control counts one refusal per pool request (as a per-run
                # long-poll counts once), not one per retry of the wait.
                for run in [run for run, reason in passed.items() if reason == "admission control"]:
                    await prompt_lease.record_refusal(ctx.redis, run)
                why = "; ".join(f"{run}: {reason}" for run, reason in passed.items()) or "no run to serve"
                raise errors.Backpressure(f"no run of the pool grants a lease now ({why})", retry_after=1.0)
            await _wait_any(events, min(remaining, prompt_lease.PACE_SLICE_S))


async def _wait_any(events: list[asyncio.Event], timeout: float) -> None:
    if not events:
        await asyncio.sleep(timeout)
        return
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def _request_key(req: PoolLeaseRequest) -> str:
    return keys.POOL_REQUEST.format(worker=req.worker_id, request_id=req.request_id)


async def _candidates(ctx: ProxyContext, principal: Principal, req: PoolLeaseRequest) -> list[tuple[str, RunSpec]]:
    """The runs the caller may be given: named ones (each must exist and be in scope), or every run in scope.
    Their specs are read in one round trip, fresh (a raised budget or a new share counts from the next lease)."""
    if req.runs is not None:
        names = list(dict.fromkeys(req.runs))
        outside = [run for run in names if not principal.may_run(run)]
        if outside:
            scope = "|".join(principal.runs or ())
            raise errors.Forbidden(f"this {principal.role} token is limited to runs {scope!r}; {outside} are not")
    else:
        names = [run for run in await runs.list_runs(ctx.redis) if principal.may_run(run)]
    if not names:
        return []
    raw = await ctx.redis.mget([keys.run_key(run, keys.SPEC) for run in names])
    out: list[tuple[str, RunSpec]] = []
    for run, spec_raw in zip(names, raw, strict=True):
        if spec_raw is not None:
            out.append((run, runs.parse_spec(spec_raw if isinstance(spec_raw, bytes) else spec_raw.encode())))
        elif req.runs is not None:  # named: 404 unknown_run (or restored from the bucket after a wipe)
            out.append((run, (await resolve_run(ctx, run)).spec))
    return [(run, spec) for run, spec in out if req.base_model in (None, spec.base_model)]


async def _try_once(
    ctx: ProxyContext, candidates: list[tuple[str, RunSpec]], req: PoolLeaseRequest
) -> tuple[PoolLease | None, dict[str, str]]:
    """One pass: the fair-share order, then a lease of each run in it until one grants."""
    if not candidates:
        return None, {}
    picked = await pool.pick(ctx.redis, candidates)
    passed = {run: hold for run, hold in picked.holds.items() if hold != "ok"}
    refused: list[str] = []  # by their own admission control or a hold: out of the competition (state/pool.py)
    for run in picked.order:
        lease_req = PromptLeaseRequest(
            worker_id=req.worker_id, n=req.n, ttl_s=req.ttl_s, version=req.versions.get(run), request_id=req.request_id
        )
        try:
            got = await lease_cached(ctx, await spec_of(ctx, run), lease_req, count_refusal=False)
        except prompt_lease.Held as exc:
            passed[run] = exc.why
            refused.append(run)
            continue
        except prompt_lease.PacedOut:
            passed[run] = "admission control"
            refused.append(run)
            continue
        except (errors.Unavailable, errors.NotFound) as exc:  # restoring, or removed since the pick: the next run
            passed[run] = exc.code
            continue
        await pool.record_pass(ctx.redis, run, picked.now, refused)
        if req.request_id is not None:
            await ctx.redis.set(_request_key(req), run, ex=REQUEST_TTL_S)
        return PoolLease(run=run, prompts=got.prompts, expires_at=got.expires_at, passed_over=passed), passed
    await pool.record_pass(ctx.redis, None, picked.now, refused)
    return None, passed


@router.get(
    "/v1/pool",
    response_model=PoolStatus,
    summary="Every run the caller's token reaches: its share, the tokens it got, and whether it is held.",
    responses=responses(401, 403, 503),
)
async def pool_status(ctx: CtxDep, principal: ViewerRole) -> PoolStatus:
    listed = []
    for run in await runs.list_runs(ctx.redis):
        spec = await runs.get_spec(ctx.redis, run) if principal.may_run(run) else None
        if spec is not None:
            listed.append(await pool.full_status(ctx.redis, run, spec, ctx.settings.worker_ttl_s))
    total = sum(s.tokens_generated for s in listed)
    fraction = {s.run: (s.tokens_generated / total if total else 0.0) for s in listed}
    recent = sum(s.tokens_recent for s in listed)
    return PoolStatus(
        runs=listed,
        token_fraction=fraction,
        recent_fraction={s.run: (s.tokens_recent / recent if recent else 0.0) for s in listed},
        recent_window_s=pool.RECENT_WINDOW_S,
    )


@router.post(
    "/v1/runs/{run}/generation/pause",
    response_model=RunPoolStatus,
    summary="Pause the run's generation: pool leases skip it, its own prompt leases answer 429. Idempotent.",
    description="Prompts already leased are still submitted and accounted; nothing is failed or dropped.",
    responses=responses(401, 403, 404, 422, 503),
)
async def pause(ctx: CtxDep, _: TrainerRole, ref: RunDep) -> RunPoolStatus:
    # The bucket's marker first: a rebuild after a Redis wipe finds the run paused (rebuild.scan_run).
    await asyncio.to_thread(ctx.store.put_bytes, rebuild.paused_marker_key(ref.run), b"")
    await pool.set_hold(ctx.redis, ref.run, "paused")
    return await pool.run_status(ctx.redis, ref.run, ref.spec)


@router.post(
    "/v1/runs/{run}/generation/finish",
    response_model=RunPoolStatus,
    summary="The run's trainer is done: pool leases skip it (hold `finished`) until a trainer registers again.",
    description=(
        "Sent by `bucketrl trainer` when it reaches max_steps, so the run's share goes to the other runs at once "
        "instead of after its queue has filled up. Prompts already leased are still accepted. A pause is not "
        "overridden; resume lifts either. Idempotent."
    ),
    responses=responses(401, 403, 404, 422, 503),
)
async def finish(ctx: CtxDep, _: TrainerRole, ref: RunDep) -> RunPoolStatus:
    if await pool.finish(ctx.redis, ref.run):
        # After Redis, unlike a pause: a wipe in between only leaves the run competing until its queue fills.
        await asyncio.to_thread(ctx.store.put_bytes, rebuild.paused_marker_key(ref.run), b"finished")
    return await pool.run_status(ctx.redis, ref.run, ref.spec)


@router.post(
    "/v1/runs/{run}/generation/resume",
    response_model=RunPoolStatus,
    summary="Resume the run's generation; it takes its share of the pool from now on (no catch-up). Idempotent.",
    responses=responses(401, 403, 404, 422, 503),
)
async def resume(ctx: CtxDep, _: TrainerRole, ref: RunDep) -> RunPoolStatus:
    await asyncio.to_thread(ctx.store.delete, [rebuild.paused_marker_key(ref.run)])
    await pool.set_hold(ctx.redis, ref.run, "ok")
    return await pool.run_status(ctx.redis, ref.run, ref.spec)
