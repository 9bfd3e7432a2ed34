"""The run's uploaded dataset: ``PUT/GET /v1/runs/{run}/dataset`` (``dataset.uri = "bucket:dataset.jsonl"``).

The trainer uploads a JSONL file once (after ``PUT /v1/runs/{run}``, whose ``dataset.size`` it already
knows); generators download it instead of needing a path or credentials of their own. Row ``i`` is prompt
index ``i``. The upload is streamed to a spool file while every line is checked (a JSON object holding the
spec's ``prompt_field``); nothing is stored unless the whole body is valid (422 naming the line).

Bucket: ``runs/{run}/dataset.jsonl`` (the bytes), then ``runs/{run}/dataset.json`` (sha256, bytes, rows —
written last, so a reader never sees a half-uploaded dataset as complete). The dataset is immutable like
``spec.dataset``: the same bytes again answer 200, different bytes 409 (create a new run instead).

Create-if-absent is atomic: the check of the stored dataset and the two writes happen under the run's
``dataset`` write lock (Redis, refreshed while held), so of two concurrent uploads of different bytes exactly
one answers 201 and the other 409, and the stored sha256 always describes the stored bytes (two unlocked
uploads both answered 201 and could leave one's bytes under the other's hash).

No trainer epoch fence: the fence orders MUTABLE writes across trainer lifetimes (versions, checkpoints),
so a fenced trainer cannot overwrite its successor's. The dataset is written once and every later upload is
compared with it, so a fenced trainer can at most store the dataset first (which the current trainer's
upload then has to match: it is the run's dataset either way) and there is nothing to order. Requiring an
epoch would also forbid the ordinary flow of uploading the dataset before any trainer registers.

    curl -X PUT -H "Authorization: Bearer $T" --data-binary @train.jsonl $PROXY/v1/runs/demo/dataset
    curl -H "Authorization: Bearer $G" $PROXY/v1/runs/demo/dataset > train.jsonl
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from bucketrl import errors
from bucketrl.datasets import CHAT_FIELD
from bucketrl.proxy import body
from bucketrl.proxy.deps import AnyRole, CtxDep, RunDep, TrainerRole
from bucketrl.proxy.errors import responses
from bucketrl.proxy.state.locks import UNFENCED, WriteLock
from bucketrl.storage.base import BucketStore
from bucketrl.wire import RunSpec
from bucketrl.wire.datasets import DatasetInfo

router = APIRouter(prefix="/v1/runs/{run}/dataset", tags=["dataset"])

JSONL = "application/x-ndjson"
_SPOOL_IN_MEMORY = 8 * 1024 * 1024


def data_key(run: str) -> str:
    return f"runs/{run}/dataset.jsonl"


def meta_key(run: str) -> str:
    return f"runs/{run}/dataset.json"


def _limit(settings: Any) -> int:
    # A dedicated BUCKETRL_MAX_DATASET_BYTES if the settings have one, else the adapter upload bound.
    return int(getattr(settings, "max_dataset_bytes", None) or settings.max_adapter_bytes)


class _JsonlChecker:
    """Checks a JSONL stream line by line as chunks arrive (lines may straddle chunks)."""

    def __init__(self, prompt_field: str) -> None:
        self.prompt_field = prompt_field
        self.tail = b""
        self.lineno = 0
        self.rows = 0

    def feed(self, chunk: bytes) -> None:
        *lines, self.tail = (self.tail + chunk).split(b"\n")
        for line in lines:
            self._line(line)

    def close(self) -> None:
        self._line(self.tail)
        self.tail = b""

    def _line(self, raw: bytes) -> None:
        self.lineno += 1
        if not raw.strip():
            return
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise errors.Invalid(f"body: line {self.lineno}: not UTF-8 JSON ({str(exc)[:80]})") from None
        if not isinstance(row, dict):
            raise errors.Invalid(f"body: line {self.lineno}: a row must be a JSON object")
        if self.prompt_field not in row and CHAT_FIELD not in row:  # a chat row holds "messages"
            raise errors.Invalid(
                f"body: line {self.lineno}: missing the prompt field {self.prompt_field!r} (or chat {CHAT_FIELD!r})"
            )
        self.rows += 1


async def _spool(chunks: AsyncIterator[bytes], spec: RunSpec, spool: Any) -> tuple[str, int, int]:
    """Copy the body into ``spool`` while checking it; (sha256, bytes, rows)."""
    checker = _JsonlChecker(spec.dataset.prompt_field)
    digest = hashlib.sha256()
    size = 0
    async for chunk in chunks:
        checker.feed(chunk)
        digest.update(chunk)
        size += len(chunk)
        spool.write(chunk)
    checker.close()
    spool.seek(0)
    return digest.hexdigest(), size, checker.rows


def _read_meta(store: BucketStore, run: str) -> DatasetInfo | None:
    try:
        return DatasetInfo.model_validate_json(store.get_bytes(meta_key(run)))
    except errors.NotFound:
        return None


@router.put(
    "",
    response_model=DatasetInfo,
    summary="Upload the run's dataset as JSONL (once; the same bytes again are 200, other bytes 409).",
    description=(
        "Each non-empty line is a JSON object holding the spec's `dataset.prompt_field`; there must be at least "
        "`dataset.size` rows (prompt index i is row i). 201 when stored, 200 when identical to the stored one."
    ),
    responses={201: {"model": DatasetInfo, "description": "Stored."}, **responses(401, 403, 404, 409, 413, 422, 503)},
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {JSONL: {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def upload(ctx: CtxDep, _: TrainerRole, ref: RunDep, request: Request, response: Response) -> DatasetInfo:
    chunks = body.stream_limited(request, _limit(ctx.settings), "dataset")
    with tempfile.SpooledTemporaryFile(max_size=_SPOOL_IN_MEMORY) as spool:
        sha, size, rows = await _spool(chunks, ref.spec, spool)
        if rows < ref.spec.dataset.size:
            raise errors.Invalid(
                f"body: {rows} rows, but the run's dataset.size is {ref.spec.dataset.size} (prompt indices "
                f"0..{ref.spec.dataset.size - 1} must each name a row)"
            )
        lock = WriteLock(ctx.redis, ref.run, "dataset", UNFENCED, ttl_s=ctx.settings.publish_lock_s)
        await lock.acquire()
        try:
            existing = await asyncio.to_thread(_read_meta, ctx.store, ref.run)
            if existing is not None:
                if existing.sha256 != sha:
                    raise errors.Conflict(
                        f"run {ref.run!r} already has a dataset (sha256 {existing.sha256[:12]}...); it is immutable "
                        "like spec.dataset: create a new run for a new dataset",
                        code="immutable_field",
                    )
                return existing
            info = DatasetInfo(sha256=sha, bytes=size, rows=rows, uploaded_at=time.time())
            await asyncio.to_thread(ctx.store.put_file, data_key(ref.run), spool, size)
            await asyncio.to_thread(ctx.store.put_bytes, meta_key(ref.run), info.model_dump_json().encode())
        finally:
            await lock.release()
    response.status_code = 201
    return info


@router.get(
    "",
    summary="Download the run's dataset (JSONL, streamed; `X-Content-SHA256` header).",
    response_class=StreamingResponse,
    responses={
        200: {"content": {JSONL: {"schema": {"type": "string", "format": "binary"}}}, "description": "The JSONL."},
        **responses(401, 404, 422, 503),
    },
)
async def download(ctx: CtxDep, _: AnyRole, ref: RunDep) -> StreamingResponse:
    info = await asyncio.to_thread(_read_meta, ctx.store, ref.run)
    if info is None:
        raise errors.NotFound(
            f"run {ref.run!r} has no uploaded dataset: PUT /v1/runs/{ref.run}/dataset first", code="no_dataset"
        )
    chunks = await asyncio.to_thread(ctx.store.iter_chunks, data_key(ref.run))
    headers = {"X-Content-SHA256": info.sha256, "Content-Length": str(info.bytes)}
    if ctx.meter is not None:
        ctx.meter.served(ref.run, info.bytes)
    return StreamingResponse(chunks, media_type=JSONL, headers=headers)
