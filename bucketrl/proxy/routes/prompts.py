"""Prompt leases over HTTP (generators); the run's dataset routes are mounted here too.

``POST /v1/runs/{run}/prompts/lease``    lease up to n prompts; 429 + Retry-After under admission control
``POST /v1/runs/{run}/prompts/renew``    extend the caller's leases (the answer lists those renewed; 410 if none)
``POST /v1/runs/{run}/prompts/release``  give prompts back (issued again first); 204
``PUT/GET /v1/runs/{run}/dataset``       see ``routes/dataset.py``

The rules (reissue first, pacing, persistence of the cursor) are in ``bucketrl.proxy.state.prompt_lease``
(and ``.prompts``, ``.snapshot``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Response

from bucketrl.proxy import body
from bucketrl.proxy.context import ProxyContext
from bucketrl.proxy.deps import CtxDep, GeneratorRole, RunDep, RunId, RunRef, resolve_run
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
    spec: Annotated[CachedSpec, Depends(cached_spec)],
    req: Annotated[PromptLeaseRequest, Depends(body.decoded(PromptLeaseRequest))],
) -> PromptLease:
    return await lease_cached(ctx, spec, req)


async def lease_prompts(
    ctx: ProxyContext, ref: RunRef, req: PromptLeaseRequest, spec_digest: str = "", count_refusal: bool = True
) -> PromptLease:
    """The lease's work. ``spec_digest``: ``ref.spec`` came from :class:`LeaseSpecs`, checked against the
    stored spec by the lease's own script (``prompt_lease.SpecChanged`` if it is no longer that spec)."""
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
        count_refusal=count_refusal,
    )


class LeaseSpecs:
    """The specs of runs this app leased prompts for, with their digests (one per app, on ``ctx.extras``): the
    next lease of the run takes its spec from here and the lease's own script checks the digest against the
    stored spec, one Redis round trip instead of two. Bounded: only runs that exist get in, and it starts over
    past :attr:`MAX` of them."""

    MAX = 1024

    def __init__(self) -> None:
        self.known: dict[str, tuple[RunRef, str]] = {}

    @staticmethod
    def of(ctx: ProxyContext) -> LeaseSpecs:
        specs = ctx.extras.get("lease_specs")
        if not isinstance(specs, LeaseSpecs):
            specs = ctx.extras["lease_specs"] = LeaseSpecs()
        return specs

    async def read(self, ctx: ProxyContext, run: str) -> tuple[RunRef, str]:
        self.known.pop(run, None)
        ref = await resolve_run(ctx, run)  # 404 unknown_run, a wiped Redis rebuilt, as RunDep does
        if len(self.known) >= self.MAX:
            self.known.clear()
        self.known[run] = ref, prompt_lease.spec_digest(ref.spec)
        return self.known[run]


@dataclass(frozen=True)
class CachedSpec:
    ref: RunRef
    digest: str
    cached: bool  # from LeaseSpecs (False: read from Redis in this request)


async def spec_of(ctx: ProxyContext, run: str) -> CachedSpec:
    """The run's spec from :class:`LeaseSpecs`, or read (404 unknown_run) when this app does not know it."""
    specs = LeaseSpecs.of(ctx)
    known = specs.known.get(run)
    if known is not None:
        return CachedSpec(*known, cached=True)
    return CachedSpec(*await specs.read(ctx, run), cached=False)


async def cached_spec(ctx: CtxDep, run: RunId) -> CachedSpec:
    """Dependency: :func:`spec_of` (before the body, as ``RunDep``: an unknown run is 404 whatever the body)."""
    return await spec_of(ctx, run)


async def lease_cached(
    ctx: ProxyContext, spec: CachedSpec, req: PromptLeaseRequest, count_refusal: bool = True
) -> PromptLease:
    """:func:`lease_prompts` with a spec from :func:`spec_of`, read again when the stored one changed.
    ``count_refusal`` False: a 429 is not counted (a pool lease counts its own, once per request)."""
    run = spec.ref.run
    try:
        return await lease_prompts(ctx, spec.ref, req, spec.digest, count_refusal)
    except prompt_lease.SpecChanged:
        if not spec.cached:  # read in this very request and already another one: leave it unchecked this once
            return await lease_prompts(ctx, await resolve_run(ctx, run), req, "", count_refusal)
    # Another spec was stored since this app cached it (or the run is gone): read it as RunDep does.
    ref, digest = await LeaseSpecs.of(ctx).read(ctx, run)
    return await lease_prompts(ctx, ref, req, digest, count_refusal)


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
