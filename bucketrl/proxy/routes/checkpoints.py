"""Checkpoints: epoch-fenced atomic write, the latest one, and the bytes of one step (trainer only)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import StreamingResponse

from bucketrl import errors
from bucketrl.proxy import body
from bucketrl.proxy.deps import CtxDep, EpochDep, RunDep, TrainerRole
from bucketrl.proxy.errors import responses
from bucketrl.proxy.routes.adapters import TAR, Sha256Dep
from bucketrl.proxy.state import checkpoints
from bucketrl.storage import dirs
from bucketrl.wire import CheckpointInfo
from bucketrl.wire.common import MAX_WIRE_INT

router = APIRouter(prefix="/v1/runs/{run}/checkpoints", tags=["checkpoints"])

StepPath = Annotated[int, Path(ge=0, le=MAX_WIRE_INT, description="Optimizer step of the checkpoint.")]


@router.get(
    "/latest",
    response_model=CheckpointInfo,
    summary="The newest committed checkpoint (404 `no_checkpoint` when there is none).",
    responses=responses(401, 403, 404, 422, 503),
)
async def latest(ctx: CtxDep, _: TrainerRole, ref: RunDep) -> CheckpointInfo:
    info = await checkpoints.latest(ctx.redis, ref.run)
    if info is None:
        raise errors.NotFound(f"run {ref.run!r} has no checkpoint yet", code="no_checkpoint")
    return info


@router.put(
    "/{step:int}",
    response_model=CheckpointInfo,
    summary="Write the checkpoint of a step (epoch-fenced, sha256-checked, atomic).",
    description=(
        "Body: the checkpoint directory as an uncompressed tar. Stored under `runs/{run}/checkpoints/step-{k}/`, "
        "manifest last; recorded in Redis atomically with the epoch check (409 `fenced` for an old epoch). The same "
        "bytes again answer 200 without rewriting."
    ),
    responses=responses(401, 403, 404, 409, 413, 422, 503),
    openapi_extra=body.openapi_tar_body("The checkpoint directory as an uncompressed tar."),
)
async def put_checkpoint(
    ctx: CtxDep, _: TrainerRole, ref: RunDep, step: StepPath, sha: Sha256Dep, epoch: EpochDep, request: Request
) -> CheckpointInfo:
    chunks = body.stream_limited(request, ctx.settings.max_checkpoint_bytes, "checkpoint tar")
    return await checkpoints.put(ctx, ref.run, step, epoch, sha, chunks)


@router.get(
    "/{step:int}",
    summary="The checkpoint tar of a step (streamed; `X-Content-SHA256` header).",
    response_class=StreamingResponse,
    responses={
        200: {"content": {TAR: {"schema": {"type": "string", "format": "binary"}}}, "description": "The tar."},
        **responses(401, 403, 404, 422, 503),
    },
)
async def download(ctx: CtxDep, _: TrainerRole, ref: RunDep, step: StepPath) -> StreamingResponse:
    info = await checkpoints.get_info(ctx.redis, ref.run, step)
    if info is None:
        raise errors.NotFound(f"run {ref.run!r} has no checkpoint at step {step}", code="unknown_checkpoint")
    chunks = await asyncio.to_thread(dirs.iter_bundle, ctx.store, checkpoints.checkpoint_prefix(ref.run, step))
    headers = {"X-Content-SHA256": info.sha256, "Content-Length": str(info.bytes)}
    if ctx.meter is not None:
        ctx.meter.served(ref.run, info.bytes)
    return StreamingResponse(chunks, media_type=TAR, headers=headers)
