"""Prompt leases over HTTP (generators); the run's dataset routes are mounted here too.

``POST /v1/runs/{run}/prompts/lease``    lease up to n prompts; 429 + Retry-After under admission control
``POST /v1/runs/{run}/prompts/renew``    extend the caller's leases (the answer lists those renewed; 410 if none)
``POST /v1/runs/{run}/prompts/release``  give prompts back (issued again first); 204
``PUT/GET /v1/runs/{run}/dataset``       see ``routes/dataset.py``

The rules (reissue first, pacing, persistence of the cursor) are in ``bucketrl.proxy.state.prompt_lease``
(and ``.prompts``, ``.snapshot``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response

from bucketrl.proxy import body
from bucketrl.proxy.context import ProxyContext
from bucketrl.proxy.deps import CtxDep, GeneratorRole, RunDep, RunRef
from bucketrl.proxy.errors import responses
from bucketrl.proxy.routes import dataset
from bucketrl.proxy.state import prompt_lease, prompts
from bucketrl.wire import PromptLease, PromptLeaseRequest, PromptReleaseRequest

_prompts = APIRouter(prefix="/v1/runs/{run}/prompts", tags=["prompts"])


@_prompts.post(
    "/lease",
    response_model=PromptLease,
    summary="Lease up to n prompts (fewer when admission control allows fewer); reissued prompts come first.",
    description=(
        "`prompt_id` = `{pass}-{index}`. Admission control: granted only while queued groups + prompts in flight < "
        "min(queue_capacity_groups, groups_per_step * max(1, max_staleness)) and, once the trainer has claimed, only "
        "as many as it will train within max_staleness of the caller's `version` at its pace; otherwise 429 "
        "`backpressure` with Retry-After (after `wait_s` of long-polling: Retry-After 0). A prompt completes when "
        "a group for it is accepted; an expired or released lease is issued again before any new prompt."
    ),
    responses=responses(401, 403, 404, 413, 422, 429, 503),
    openapi_extra=body.openapi_body(PromptLeaseRequest),
)
async def lease(
    ctx: CtxDep,
    _: GeneratorRole,
    ref: RunDep,
    req: Annotated[PromptLeaseRequest, Depends(body.decoded(PromptLeaseRequest))],
) -> PromptLease:
    return await lease_prompts(ctx, ref, req)


async def lease_prompts(ctx: ProxyContext, ref: RunRef, req: PromptLeaseRequest, spec_digest: str = "") -> PromptLease:
    """The lease route's work. ``spec_digest``: ``ref.spec`` came from a cache (``lean.py``), checked against
    the stored spec by the lease's own script (``prompt_lease.SpecChanged`` if it is no longer that spec)."""
    return await prompt_lease.lease(
        ctx.redis,
        ctx.store,
        ref.run,
        ref.spec,
        req.worker_id,
        req.n,
        req.ttl_s,
        version=req.version,
        wait_s=min(req.wait_s, ctx.settings.max_wait_s),
        notifier=ctx.notifier,
        slack=ctx.settings.pace_slack_versions,
        request_id=req.request_id,
        spec_digest=spec_digest,
    )


@_prompts.post(
    "/renew",
    response_model=PromptLease,
    summary="Extend the caller's prompt leases by ttl_s; the answer lists the ones renewed (410 if none was).",
    responses=responses(401, 403, 404, 410, 413, 422, 503),
    openapi_extra=body.openapi_body(PromptReleaseRequest),
)
async def renew(
    ctx: CtxDep,
    _: GeneratorRole,
    ref: RunDep,
    req: Annotated[PromptReleaseRequest, Depends(body.decoded(PromptReleaseRequest))],
) -> PromptLease:
    prompts.validate_prompt_ids(req.prompt_ids)
    return await prompts.renew(ctx.redis, ref.run, req.worker_id, req.prompt_ids, req.ttl_s)


@_prompts.post(
    "/release",
    status_code=204,
    summary="Give prompt leases back before they expire (graceful shutdown); they are issued again first.",
    responses={
        204: {"description": "Released (ids the caller did not hold are ignored)."},
        **responses(401, 403, 404, 413, 422, 503),
    },
    openapi_extra=body.openapi_body(PromptReleaseRequest),
)
async def release(
    ctx: CtxDep,
    _: GeneratorRole,
    ref: RunDep,
    req: Annotated[PromptReleaseRequest, Depends(body.decoded(PromptReleaseRequest))],
) -> Response:
    prompts.validate_prompt_ids(req.prompt_ids)
    await prompts.release(ctx.redis, ref.run, req.worker_id, req.prompt_ids)
    return Response(status_code=204)


# routes/__init__.py lists one module per area; the dataset routes ride along with the prompts they feed.
router = APIRouter()
router.include_router(_prompts)
router.include_router(dataset.router)
