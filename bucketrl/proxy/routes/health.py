"""Liveness, readiness and the Prometheus exposition (no auth: probes and scrapers carry no token)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from bucketrl import errors
from bucketrl.proxy import identity
from bucketrl.proxy.deps import CtxDep
from bucketrl.proxy.errors import responses

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    redis: str
    bucket: str


@router.get("/healthz", response_model=Health, summary="Liveness: the process serves HTTP.")
async def healthz() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Readiness,
    summary="Readiness: Redis answers PING, the bucket is reachable and writable and is this deployment's.",
    responses={503: {"model": Readiness, "description": "Redis or the bucket is unreachable."}},
)
async def readyz(ctx: CtxDep) -> JSONResponse:
    redis_state, bucket_state = "ok", "ok"
    try:
        await ctx.redis.ping()
    except Exception as exc:  # any failure means "not ready"; the reason is in the body
        redis_state = f"unavailable: {type(exc).__name__}"
    state = ctx.identity if ctx.identity.refused else await identity.check(ctx)
    if state.refused:
        # No write probe into a bucket that is not this deployment's (it may be an empty stand-in that the
        # operator is about to replace with the real one).
        bucket_state = f"refused: {str(state.problem)[:300]}"
    else:
        try:
            await asyncio.to_thread(ctx.store.check)
        except errors.BucketRLError as exc:
            bucket_state = f"unavailable: {exc.message[:200]}"
        else:
            if not state.ok:
                bucket_state = f"unavailable: {str(state.problem)[:200]}"
    ok = redis_state == "ok" and bucket_state == "ok"
    body = Readiness(status="ok" if ok else "unavailable", redis=redis_state, bucket=bucket_state)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


@router.get(
    "/metrics",
    summary="Prometheus exposition of this replica (Redis-derived gauges refreshed at scrape).",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, **responses(503)},
)
async def metrics(ctx: CtxDep) -> Response:
    await ctx.telemetry.refresh(ctx)
    return Response(ctx.telemetry.exposition(), media_type=CONTENT_TYPE_LATEST)
