"""Staged adapter uploads (``bucketrl/proxy/staging.py``): a long-poll for new ones and each one's bytes as they
arrive. A ``relay`` token (a regional relay) or a ``generator`` token (a generator fetching from this proxy
itself) reads them, within its run scope; admin too."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import StreamingResponse

from bucketrl import errors
from bucketrl.proxy.deps import CtxDep, StagingReader
from bucketrl.proxy.errors import responses
from bucketrl.wire.adapters import StagingList
from bucketrl.wire.common import ID_PATTERN, MAX_WIRE_INT

router = APIRouter(prefix="/v1/staging", tags=["staging"])

TAR = "application/x-tar"


@router.get(
    "",
    response_model=StagingList,
    summary="Long-poll (relay or generator token): adapter uploads staged after `after`, as soon as one begins.",
    responses=responses(401, 403, 422, 503),
)
async def staged_uploads(
    ctx: CtxDep,
    principal: StagingReader,
    request: Request,
    after: Annotated[int, Query(ge=0, le=MAX_WIRE_INT, description="The `seq` of the last upload already seen.")] = 0,
    instance: Annotated[str, Query(max_length=64, description="The `instance` that `after` counts in.")] = "",
    wait_s: Annotated[float, Query(ge=0.0, le=3600.0, description="How long to wait for one.")] = 0.0,
    run: Annotated[str | None, Query(pattern=ID_PATTERN, description="Only this run's uploads (a generator).")] = None,
) -> StagingList:
    if ctx.staging is None:  # off (BUCKETRL_STAGING_MB=0): nothing is ever staged here
        return StagingList(instance="", seq=0)
    wait_s = min(wait_s, ctx.settings.max_wait_s)

    def visible(of: str) -> bool:
        return principal.may_run(of) and (run is None or of == run)

    return await ctx.staging.wait(after, instance, wait_s, visible, request.is_disconnected)


@router.get(
    "/{upload_id}",
    summary="A staged upload's bytes as they arrive (relay or generator token); complete only once committed.",
    description="The body ends short (the connection closes mid-body) when the publish fails: drop what was read.",
    response_class=StreamingResponse,
    responses={
        200: {"content": {TAR: {"schema": {"type": "string", "format": "binary"}}}, "description": "The bytes."},
        **responses(401, 403, 404, 422, 503),
    },
)
async def staged_bytes(
    ctx: CtxDep,
    principal: StagingReader,
    upload_id: Annotated[str, Path(pattern=r"^[0-9a-f]{32}$", description="A staged upload's `upload_id`.")],
) -> StreamingResponse:
    staged = ctx.staging.get(upload_id) if ctx.staging is not None else None
    if staged is None or not principal.may_run(staged.info.run):  # settled meanwhile: the relay fetches as before
        raise errors.NotFound(f"no upload {upload_id} is staged here", code="not_staged")
    headers = {"X-Content-SHA256": staged.info.sha256}
    return StreamingResponse(staged.chunks(), media_type=TAR, headers=headers)
