"""Evaluation during training over HTTP (rules in ``bucketrl.proxy.state.evals``).

``POST /v1/runs/{run}/eval/lease``   eval prompts of one of the caller's loaded versions (generators)
``POST /v1/runs/{run}/eval/submit``  per-prompt rewards and lengths; each prompt counted once (generators)
``GET  /v1/runs/{run}/eval``         every evaluated version's results, oldest first (viewers, the trainer)
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from bucketrl.proxy import body
from bucketrl.proxy.deps import CtxDep, GeneratorRole, RunDep, ViewerRole
from bucketrl.proxy.errors import responses
from bucketrl.proxy.state import evals
from bucketrl.wire import EvalLease, EvalLeaseRequest, EvalSubmit, EvalSubmitResponse, EvalVersionResult

router = APIRouter(prefix="/v1/runs/{run}/eval", tags=["eval"])


@router.post(
    "/lease",
    response_model=EvalLease,
    summary="Eval prompts of the oldest of the caller's loaded versions still being evaluated (empty: none).",
    responses=responses(401, 403, 404, 413, 422, 503),
    openapi_extra=body.openapi_body(EvalLeaseRequest),
)
async def lease(
    ctx: CtxDep,
    _: GeneratorRole,
    ref: RunDep,
    req: Annotated[EvalLeaseRequest, Depends(body.decoded(EvalLeaseRequest))],
) -> EvalLease:
    return await evals.lease(
        ctx.redis,
        ctx.store,
        ref.run,
        ref.spec,
        req.versions,
        req.n,
        req.ttl_s,
        worker_id=req.worker_id,
        request_id=req.request_id,
    )


@router.post(
    "/submit",
    response_model=EvalSubmitResponse,
    summary="Per-prompt eval results; a prompt already counted is a duplicate (adds nothing).",
    responses=responses(401, 403, 404, 413, 422, 503),
    openapi_extra=body.openapi_body(EvalSubmit),
)
async def submit(
    ctx: CtxDep,
    _: GeneratorRole,
    ref: RunDep,
    req: Annotated[EvalSubmit, Depends(body.decoded(EvalSubmit))],
) -> EvalSubmitResponse:
    return await evals.submit(ctx.redis, ctx.store, ref.run, ref.spec, req.results)


@router.get(
    "",
    response_model=list[EvalVersionResult],
    summary="Every evaluated version's results (mean reward, pass@1, pass@k, length, unscorable), oldest first.",
    responses=responses(401, 403, 404, 422, 503),
)
async def results(ctx: CtxDep, _: ViewerRole, ref: RunDep) -> list[EvalVersionResult]:
    return await evals.results(ctx.redis, ctx.store, ref.run)
