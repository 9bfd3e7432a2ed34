"""Workers push metrics (and heartbeat); viewers read the run status."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from bucketrl.proxy import body
from bucketrl.proxy.deps import CtxDep, RunDep, ViewerRole, WorkerRole
from bucketrl.proxy.errors import responses
from bucketrl.proxy.state import status as status_state
from bucketrl.proxy.state import workers
from bucketrl.wire import MetricsPush, RunStatus
from bucketrl.wire.metrics import MetricsRecord

router = APIRouter(prefix="/v1/runs/{run}", tags=["observability"])


@router.post(
    "/metrics",
    status_code=204,
    summary="Push a worker's metrics (flat {name: number}); doubles as its heartbeat.",
    description=(
        "The worker's role is its token's role. With an admin token (or the anonymous embedded mode) it is "
        "`generator` when the push reports `loaded_versions`, else `trainer`. A trainer's `step` becomes the run's "
        "trainer step."
    ),
    responses={204: {"description": "Recorded."}, **responses(401, 403, 404, 413, 422, 503)},
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
    await workers.record_push(ctx.redis, ref.run, role, push)
    return Response(status_code=204)


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
