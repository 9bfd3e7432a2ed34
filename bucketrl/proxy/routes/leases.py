"""Version leases: a generator holds one on each adapter version it serves, so GC never deletes it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Response

from bucketrl import errors
from bucketrl.proxy import body
from bucketrl.proxy.deps import CtxDep, GeneratorRole, RunDep, RunId, resolve_run
from bucketrl.proxy.errors import responses
from bucketrl.proxy.state import leases
from bucketrl.wire import VersionLease, VersionLeaseRequest
from bucketrl.wire.leases import LeaseRenewRequest

router = APIRouter(prefix="/v1/runs/{run}/leases", tags=["leases"])

LeaseIdPath = Annotated[str, Path(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="The lease_id a lease returned.")]


@router.post(
    "",
    response_model=VersionLease,
    summary="Lease a version (default: the latest) for ttl_s; a leased version is never garbage-collected.",
    description="404 `no_version` before the first publish or for a future version; 410 `version_gone` once GC'd.",
    responses=responses(401, 403, 404, 410, 413, 422, 503),
    openapi_extra=body.openapi_body(VersionLeaseRequest),
)
async def create_lease(
    ctx: CtxDep,
    _: GeneratorRole,
    run: RunId,
    req: Annotated[VersionLeaseRequest, Depends(body.decoded(VersionLeaseRequest))],
) -> VersionLease:
    # The run is looked up only when the lease is refused (a hot route: one Redis round trip less): an
    # unknown run has no versions, so it is always refused first, then answered 404 unknown_run here; a
    # wiped Redis is rebuilt by resolve_run and the lease tried again.
    try:
        return await leases.create(ctx.redis, run, req.worker_id, req.version, req.ttl_s, req.request_id)
    except (errors.NotFound, errors.Gone):
        await resolve_run(ctx, run)
    return await leases.create(ctx.redis, run, req.worker_id, req.version, req.ttl_s, req.request_id)


@router.post(
    "/{lease_id}/renew",
    response_model=VersionLease,
    summary="Extend a live lease by ttl_s from now. 410 `lease_expired` once it expired (its version may be gone).",
    responses=responses(401, 403, 404, 410, 413, 422, 503),
    openapi_extra=body.openapi_body(LeaseRenewRequest),
)
async def renew_lease(
    ctx: CtxDep,
    _: GeneratorRole,
    ref: RunDep,
    lease_id: LeaseIdPath,
    req: Annotated[LeaseRenewRequest, Depends(body.decoded(LeaseRenewRequest))],
) -> VersionLease:
    return await leases.renew(ctx.redis, ref.run, lease_id, req.ttl_s)


@router.delete(
    "/{lease_id}",
    status_code=204,
    summary="Release a lease now. 410 `lease_expired` if it had already expired.",
    responses={204: {"description": "Released."}, **responses(401, 403, 404, 410, 422, 503)},
)
async def release_lease(ctx: CtxDep, _: GeneratorRole, run: RunId, lease_id: LeaseIdPath) -> Response:
    try:
        await leases.release(ctx.redis, run, lease_id)
    except errors.Gone:
        await resolve_run(ctx, run)  # an unknown run is 404, not 410 (see create_lease)
        raise
    return Response(status_code=204)
