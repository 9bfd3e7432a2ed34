"""Workers push metrics (and heartbeat); viewers read the run status."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from bucketrl import errors
from bucketrl.proxy import body
from bucketrl.proxy.context import ProxyContext
from bucketrl.proxy.deps import CtxDep, GeneratorRole, RunDep, ViewerRole, WorkerRole
from bucketrl.proxy.errors import responses
from bucketrl.proxy.state import drains, leases, prompts, workers
from bucketrl.proxy.state import status as status_state
from bucketrl.wire import MetricsPush, PromptLease, RunStatus
from bucketrl.wire.metrics import DrainNotice, DrainRequest, MetricsRecord, Renewals, Renewed

router = APIRouter(prefix="/v1/runs/{run}", tags=["observability"])


@router.post(
    "/metrics",
    status_code=204,
    summary="Push a worker's metrics (flat {name: number}); doubles as its heartbeat.",
    description=(
        "The worker's role is its token's role. With an admin token (or the anonymous embedded mode) it is "
        "`generator` when the push reports `loaded_versions`, else `trainer`. A trainer's `step` becomes the run's "
        "trainer step. A push with `renew` also renews those version and prompt leases (as their renew routes "
        "do) and answers 200 with what it renewed. A drain pending for the worker is answered 200 with `drain` "
        "(its seconds left), with or without renewals."
    ),
    responses={
        204: {"description": "Recorded."},
        200: {"description": "Recorded, and the leases renewed.", "model": Renewed},
        **responses(401, 403, 404, 413, 422, 503),
    },
    openapi_extra=body.openapi_body(MetricsPush),
)
async def push_metrics(
    ctx: CtxDep,
    principal: WorkerRole,
    ref: RunDep,
    push: Annotated[MetricsPush, Depends(body.decoded(MetricsPush))],
) -> Response:
    role = principal.role
    if role == "admin":
        role = "generator" if push.loaded_versions is not None else "trainer"
    if push.renew is not None:  # refused (422) before anything is recorded
        prompts.validate_prompt_ids(push.renew.prompt_ids)
    await workers.record_push(ctx.redis, ref.run, role, push, ctx.settings.worker_ttl_s)
    drain = await drains.pending(ctx.redis, ref.run, push.worker_id)
    if push.renew is None and drain is None:
        return Response(status_code=204)
    out = Renewed() if push.renew is None else await _renew(ctx, ref.run, push.worker_id, push.renew)
    out.drain = drain
    return Response(out.model_dump_json(), 200, media_type=_JSON)


@router.post(
    "/workers/{worker_id}/drain",
    status_code=202,
    summary="Tell a worker it will be reclaimed in `notice_s` (a spot-notice watcher's call; docs/faults.md).",
    description=(
        "The worker learns of it from the answer to its next heartbeat: it stops taking prompts, submits what "
        "completes within the notice, releases every other prompt and version lease and exits 0 before the notice "
        "ends. Calling again never lengthens a notice. 404 for a worker that never pushed a heartbeat."
    ),
    responses={202: {"description": "Recorded."}, **responses(401, 403, 404, 413, 422, 503)},
    openapi_extra=body.openapi_body(DrainRequest),
)
async def drain_worker(
    ctx: CtxDep,
    principal: GeneratorRole,
    ref: RunDep,
    worker_id: str,
    req: Annotated[DrainRequest, Depends(body.decoded(DrainRequest))],
) -> DrainNotice:
    return await drains.request(ctx.redis, ref.run, worker_id, req.notice_s)


@router.get(
    "/workers/{worker_id}/drain",
    response_model=DrainNotice,
    summary="Long-poll: the drain pending for this worker as soon as there is one; 204 after `wait_s`.",
    description=(
        "Answers at once when a drain is pending, else waits up to `wait_s` (capped by the proxy's `max_wait_s`), "
        "woken by Redis pub/sub the moment a drain is requested: a worker learns of its notice in milliseconds, "
        "not at its next heartbeat."
    ),
    responses={204: {"description": "No drain within `wait_s`."}, **responses(401, 403, 404, 422, 503)},
)
async def wait_drain(
    ctx: CtxDep,
    _: WorkerRole,
    ref: RunDep,
    worker_id: str,
    wait_s: Annotated[float, Query(ge=0.0, le=3600.0, description="How long to wait for a drain.")] = 0.0,
) -> Response | DrainNotice:
    got = await drains.wait(ctx.redis, ctx.notifier, ref.run, worker_id, min(wait_s, ctx.settings.max_wait_s))
    return Response(status_code=204) if got is None else got


_JSON = "application/json"


async def _renew(ctx: ProxyContext, run: str, worker_id: str, renew: Renewals) -> Renewed:
    """The push's renewals, each as its own route does it (an expired one is reported, not raised)."""
    out = Renewed()
    for lease_id in dict.fromkeys(renew.version_leases):
        try:
            out.versions[lease_id] = await leases.renew(ctx.redis, run, lease_id, renew.version_ttl_s)
        except errors.Gone:
            out.versions[lease_id] = None
    if renew.prompt_ids:
        try:
            out.prompts = await prompts.renew(ctx.redis, run, worker_id, renew.prompt_ids, renew.prompt_ttl_s)
        except errors.Gone:
            out.prompts = PromptLease(prompts=[], expires_at=0.0)
    return out


@router.get(
    "/status",
    response_model=RunStatus,
    summary="Versions and their leases, queue, prompts in flight, workers, trainer epoch/step, recent metrics.",
    responses=responses(401, 403, 404, 422, 503),
)
async def get_status(ctx: CtxDep, _: ViewerRole, ref: RunDep) -> RunStatus:
    return await status_state.build(ctx, ref.run, ref.spec)


@router.get(
    "/metrics/recent",
    response_model=list[MetricsRecord],
    summary="The last `count` metric pushes of the run, oldest first (for dashboards).",
    responses=responses(401, 403, 404, 422, 503),
)
async def recent_metrics(
    ctx: CtxDep, _: ViewerRole, ref: RunDep, count: Annotated[int, Query(ge=1, le=5000)] = 200
) -> list[MetricsRecord]:
    return [MetricsRecord.model_validate(r) for r in await workers.recent_pushes(ctx.redis, ref.run, count)]
