"""Adapter versions: publish (trainer, fenced), long-poll for the latest, download the bytes."""

from __future__ import annotations

import asyncio
import re
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from fastapi.responses import StreamingResponse

from bucketrl import errors
from bucketrl.proxy import body, keys, staging
from bucketrl.proxy.deps import CtxDep, EpochDep, GeneratorRole, RunDep, TrainerRole, ViewerRole
from bucketrl.proxy.errors import responses
from bucketrl.proxy.state import runs, versions
from bucketrl.storage import dirs
from bucketrl.wire import AdapterVersionInfo
from bucketrl.wire.common import MAX_WIRE_INT

router = APIRouter(prefix="/v1/runs/{run}/adapters", tags=["adapters"])

TAR = "application/x-tar"
_SHA = re.compile(r"^[0-9a-f]{64}$")

VersionPath = Annotated[int, Path(ge=1, le=MAX_WIRE_INT, description="Adapter version (1, 2, 3, ...).")]


def check_sha_header(value: str | None) -> str:
    if value is None:
        raise errors.Invalid("header X-Content-SHA256 is required: the sha256 (hex) of the request body")
    sha = value.strip().lower()
    if not _SHA.match(sha):
        raise errors.Invalid(f"header X-Content-SHA256 must be 64 hex digits, got {value[:80]!r}")
    return sha


async def sha256_header(
    x_content_sha256: Annotated[
        str | None, Header(alias="X-Content-SHA256", description="sha256 (hex) of the request body (required).")
    ] = None,
) -> str:
    # A dependency that raises (not a required Header parameter, whose error FastAPI only collects): listed
    # before EpochDep, a missing or malformed header is 422 before a stale epoch could answer 409 `fenced`.
    return check_sha_header(x_content_sha256)


Sha256Dep = Annotated[str, Depends(sha256_header)]


@router.get(
    "/latest",
    response_model=AdapterVersionInfo,
    summary="Long-poll: the latest version as soon as one newer than `after` exists; 204 after `wait_s`.",
    description="Woken by Redis pub/sub the moment a version commits (milliseconds), not by polling.",
    responses={
        204: {"description": "Nothing newer than `after` within `wait_s`."},
        **responses(401, 403, 404, 422, 503),
    },
)
async def latest(
    ctx: CtxDep,
    _: ViewerRole,
    ref: RunDep,
    after: Annotated[int, Query(ge=0, le=MAX_WIRE_INT, description="Answer only with a version > after.")] = 0,
    wait_s: Annotated[float, Query(ge=0.0, le=3600.0, description="How long to wait for one.")] = 0.0,
) -> Response | AdapterVersionInfo:
    info = await versions.wait_newer(ctx, ref.run, after, min(wait_s, ctx.settings.max_wait_s))
    if info is None:
        return Response(status_code=204)
    return info


@router.put(
    "/{version:int}",
    response_model=AdapterVersionInfo,
    summary="Publish version N = latest+1 (epoch-fenced; sha256-checked; atomic).",
    description=(
        "Body: the adapter directory as an uncompressed tar (the PEFT files), its weights all in one dtype (the run "
        "spec's `adapter_dtype` unless that is `auto`: 422 `adapter_dtype_mismatch`). The proxy stores the exact tar "
        "and the extracted files under `runs/{run}/adapters/v{N}/`, manifest last, then commits the version in Redis "
        "atomically with the epoch check. Re-sending the committed bytes of the latest version answers 200 (a "
        "retried PUT). 409 `version_conflict` unless N = latest+1; 409 `fenced` for an old epoch."
    ),
    responses=responses(401, 403, 404, 409, 413, 422, 503),
    openapi_extra=body.openapi_tar_body("The adapter directory as an uncompressed tar."),
)
async def publish(
    ctx: CtxDep,
    _: TrainerRole,
    ref: RunDep,
    version: VersionPath,
    sha: Sha256Dep,
    epoch: EpochDep,
    request: Request,
) -> AdapterVersionInfo:
    declared = body.check_content_length(request, ctx.settings.max_adapter_bytes, "adapter tar")
    if same := await versions.committed_same(ctx.redis, ref.run, version, sha, epoch):
        return same  # a retried PUT whose first answer was lost
    latest_now = await runs.latest_version(ctx.redis, ref.run)
    if latest_now == 0 and version > 1 and not await ctx.redis.exists(keys.run_key(ref.run, keys.STATE)):
        # Redis lost the run after this request found it (wiped, not rebuilt yet): retryable, not a conflict.
        raise errors.Unavailable(f"run {ref.run!r}: its state is being restored from the bucket; retry")
    if version != latest_now + 1:  # fail before reading the body; the commit re-checks atomically
        if same := await versions.committed_same(ctx.redis, ref.run, version, sha, epoch):
            return same  # its first attempt committed since the check above
        raise errors.Conflict(
            f"run {ref.run!r}: can only publish version {latest_now + 1} (latest is {latest_now}), not {version}",
            code="version_conflict",
        )
    chunks = body.stream_limited(request, ctx.settings.max_adapter_bytes, "adapter tar")
    # Staged publish (staging.py): the relays may pull the bytes while they arrive; they complete only on commit.
    staged = ctx.staging.begin(ref.run, version, sha, declared) if ctx.staging is not None else None
    committed = False
    try:
        info = await versions.publish(
            ctx, ref.run, version, epoch, sha, staging.teed(chunks, staged), ref.spec.adapter_dtype
        )
        committed = info.sha256 == sha
        return info
    finally:
        if staged is not None and ctx.staging is not None:
            ctx.staging.settle(staged, committed)


@router.get(
    "/{version:int}",
    summary="The adapter tar of a version (streamed; `X-Content-SHA256` header). 410 once garbage-collected.",
    response_class=StreamingResponse,
    responses={
        200: {"content": {TAR: {"schema": {"type": "string", "format": "binary"}}}, "description": "The tar."},
        304: {"description": "`If-None-Match` matched: the version is live and its sha256 is in the headers."},
        307: {"description": "`X-Bucketrl-Presign: 1` on an S3 bucket with presigning on: `Location` reads the tar."},
        **responses(401, 403, 404, 410, 422, 503),
    },
)
async def download(
    ctx: CtxDep,
    _: GeneratorRole,
    ref: RunDep,
    version: VersionPath,
    if_none_match: Annotated[str | None, Header(description='`*` or `"<sha256>"`: 304 without the body.')] = None,
    presign: Annotated[
        str | None, Header(alias="X-Bucketrl-Presign", description="`1`: a 307 to the bucket when presigning is on.")
    ] = None,
) -> Response:
    rec = await versions.live_record(ctx.redis, ref.run, version)
    prefix = versions.adapter_prefix(ref.run, version)
    etag = f'"{rec["sha256"]}"'
    if if_none_match is not None and if_none_match.strip() in ("*", etag):
        # A regional relay (bucketrl/relay) asks this for every caller: the caller's token and the version's
        # liveness (410 once collected) are checked here, and only the sha crosses the slow link.
        return Response(status_code=304, headers={"X-Content-SHA256": rec["sha256"], "ETag": etag})
    ttl = ctx.settings.presign_adapters_s
    if presign == "1" and ttl:
        # The bytes straight from the bucket (no credentials on the caller, none of the proxy's bandwidth).
        url = await asyncio.to_thread(dirs.presigned_bundle, ctx.store, prefix, ttl)
        if url is not None:
            return Response(status_code=307, headers={"Location": url, "X-Content-SHA256": rec["sha256"], "ETag": etag})
    headers = {"X-Content-SHA256": rec["sha256"], "Content-Length": rec["bytes"], "ETag": etag}
    if ctx.meter is not None:
        ctx.meter.served(ref.run, int(rec["bytes"]))
    cache = ctx.adapter_cache
    if cache is not None and cache.fits(int(rec["bytes"])):
        # Every generator asks at once after a publish: one bucket read per version per replica (adapter_cache.py).
        def read() -> bytes:
            return b"".join(dirs.iter_bundle(ctx.store, prefix))

        data = await cache.get((ref.run, version, rec["sha256"]), lambda: asyncio.to_thread(read))
        return Response(data, media_type=TAR, headers=headers)
    chunks = await asyncio.to_thread(dirs.iter_bundle, ctx.store, prefix)
    return StreamingResponse(chunks, media_type=TAR, headers=headers)
