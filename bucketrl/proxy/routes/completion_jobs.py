"""Completion jobs over HTTP (rules in ``bucketrl.proxy.state.completion_jobs``).

``POST /v1/runs/{run}/completion-jobs``                      queue a job (trainer); a retry is the same job
``GET  /v1/runs/{run}/completion-jobs/{request_id}``         its result (200), long-polled; 202 while pending
``POST /v1/runs/{run}/completion-jobs/lease``                jobs for a generator, long-polled
``POST /v1/runs/{run}/completion-jobs/{request_id}/result``  the generator's answer; the first one wins
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import JSONResponse

from bucketrl import errors
from bucketrl.proxy import body
from bucketrl.proxy.deps import CtxDep, GeneratorRole, RunDep, TrainerRole
from bucketrl.proxy.errors import responses
from bucketrl.proxy.state import completion_jobs as jobs
from bucketrl.wire.completion_jobs import (
    CompletionJobAccepted,
    CompletionJobLease,
    CompletionJobLeaseRequest,
    CompletionJobRequest,
    CompletionJobResult,
)

router = APIRouter(prefix="/v1/runs/{run}/completion-jobs", tags=["completion-jobs"])

RequestIdPath = Annotated[str, Path(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="The job's request_id.")]


@router.post(
    "",
    response_model=CompletionJobAccepted,
    summary="Queue a completion job pinned to a version (None: the base model); a retry is the same job.",
    description=(
        "A version not published yet is accepted: the job waits for it. 409 `request_id_reused` when the id names "
        "another request; 410 `version_gone` for a garbage-collected version; 422 for a token outside the vocabulary."
    ),
    responses=responses(401, 403, 404, 409, 410, 413, 422, 503),
    openapi_extra=body.openapi_body(CompletionJobRequest),
)
async def submit(
    ctx: CtxDep,
    _: TrainerRole,
    ref: RunDep,
    req: Annotated[CompletionJobRequest, Depends(body.decoded(CompletionJobRequest))],
) -> CompletionJobAccepted:
    return await jobs.submit(ctx.redis, ref.run, ref.spec, req)


@router.post(
    "/lease",
    response_model=CompletionJobLease,
    summary="Queued jobs of published versions for a generator (its loaded versions first); long-polls wait_s.",
    description="An unanswered job whose lease expired (ttl_s) is offered again before any other.",
    responses=responses(401, 403, 404, 413, 422, 503),
    openapi_extra=body.openapi_body(CompletionJobLeaseRequest),
)
async def lease(
    ctx: CtxDep,
    _: GeneratorRole,
    ref: RunDep,
    req: Annotated[CompletionJobLeaseRequest, Depends(body.decoded(CompletionJobLeaseRequest))],
) -> CompletionJobLease:
    return await jobs.lease(ctx.redis, ctx.notifier, ref.run, req, min(req.wait_s, ctx.settings.max_wait_s))


@router.get(
    "/{request_id}",
    response_model=CompletionJobResult,
    summary="The job's result (200) as soon as it is answered, waiting up to wait_s; 202 with its state if not.",
    responses={
        202: {"model": CompletionJobAccepted, "description": "Not answered yet (queued or leased)."},
        **responses(401, 403, 404, 422, 503),
    },
)
async def result(
    ctx: CtxDep,
    _: TrainerRole,
    ref: RunDep,
    request_id: RequestIdPath,
    wait_s: Annotated[float, Query(ge=0.0, le=3600.0, description="How long to wait for the result.")] = 0.0,
) -> CompletionJobResult | JSONResponse:
    state, done = await jobs.wait_result(
        ctx.redis, ctx.notifier, ref.run, request_id, min(wait_s, ctx.settings.max_wait_s)
    )
    if done is not None:
        return done
    pending = CompletionJobAccepted(request_id=request_id, state=state)  # type: ignore[arg-type]
    return JSONResponse(pending.model_dump(mode="json"), status_code=202)


@router.post(
    "/{request_id}/result",
    response_model=CompletionJobAccepted,
    summary="Answer a job; the first result wins, a later one is answered 200 and changes nothing.",
    responses=responses(401, 403, 404, 413, 422, 503),
    openapi_extra=body.openapi_body(CompletionJobResult),
)
async def post_result(
    ctx: CtxDep,
    _: GeneratorRole,
    ref: RunDep,
    request_id: RequestIdPath,
    res: Annotated[CompletionJobResult, Depends(body.decoded(CompletionJobResult))],
) -> CompletionJobAccepted:
    if res.request_id != request_id:
        raise errors.Invalid(f"body request_id {res.request_id!r} is not the path's {request_id!r}")
    await jobs.post_result(ctx.redis, ref.run, res)
    return CompletionJobAccepted(request_id=request_id, state="done")
