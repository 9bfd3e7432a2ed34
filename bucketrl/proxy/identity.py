"""Bucket identity: the proxy serves only the bucket its deployment has been using.

A missing bucket must never be silently replaced by an empty one (a volume that did not mount, a directory
renamed away, a recreated S3 bucket): a proxy that kept going would start the run over in the new bucket
while Redis still describes the old one (split brain). So the bucket carries an identity:

- a marker object :data:`MARKER_KEY` (``{"bucket_id", "created_at"}``) written when the deployment first uses
  the bucket, and the same JSON in Redis under :data:`bucketrl.proxy.keys.BUCKET_IDENTITY`;
- :func:`verify` compares them. Marker and record equal: serve. Marker present, no record (a new or wiped
  Redis): adopt the marker (the rebuild then restores Redis from this bucket). No marker and no record, and
  Redis holds no run the bucket lacks: first use, write both. Otherwise (no marker but a record, or records
  that differ, or runs in Redis over a bucket with none) REFUSE: ``/readyz`` answers 503 with the reason,
  every ``/v1`` route answers 503 ``bucket_identity`` (retryable: workers wait for the operator), the
  maintenance loop skips its pass (no GC, no rebuild from the wrong bucket), and one ERROR line says what to
  do. Each maintenance pass verifies again, so putting the right bucket back is all it takes to recover.

A deployment from before markers (runs in Redis and in the bucket, no marker) adopts its bucket silently.
Known limit: Redis wiped AND the bucket replaced by an empty one at once is indistinguishable from a new
deployment (nothing remembers the old bucket); the marker then starts a new identity.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from pydantic import BaseModel, ValidationError

from bucketrl import errors
from bucketrl.proxy import keys
from bucketrl.proxy.rebuild import bucket_runs

log = logging.getLogger("bucketrl.proxy.identity")

MARKER_KEY = "bucketrl-bucket.json"
# While not verified, a request re-checks at most this often (each check reads the marker and one Redis key).
RECHECK_S = 1.0


class BucketMarker(BaseModel):
    bucket_id: str
    created_at: float


class IdentityState:
    """Per-app verification state (on ``ProxyContext.identity``): None = verified, else why not."""

    def __init__(self) -> None:
        self.problem: str | None = "bucket identity not verified yet"
        self.refused = False  # True: a real mismatch (logged as an ERROR), not just an unreachable store
        self.checked_at = 0.0
        self._lock = asyncio.Lock()

    @property
    def ok(self) -> bool:
        return self.problem is None


def _read_marker(store: Any) -> BucketMarker | None:
    try:
        raw = store.get_bytes(MARKER_KEY)
    except errors.NotFound:
        return None
    try:
        return BucketMarker.model_validate_json(raw)
    except ValidationError as exc:
        raise errors.Unavailable(f"bucket {store.url}: {MARKER_KEY} is not a bucketrl identity marker: {exc}") from exc


async def verify(ctx: Any) -> str | None:
    """None when the bucket is this deployment's (writing the identity on first use), else the refusal.

    Raises Unavailable / Redis errors when either store cannot be read (the state stays "not verified")."""
    r, store = ctx.redis, ctx.store
    marker = await asyncio.to_thread(_read_marker, store)
    raw = await r.get(keys.BUCKET_IDENTITY)
    recorded = BucketMarker.model_validate_json(raw) if raw else None
    if marker is not None and recorded is not None:
        if marker.bucket_id == recorded.bucket_id:
            return None
        return (
            f"bucket {store.url} has identity {marker.bucket_id} but Redis belongs to bucket {recorded.bucket_id}: "
            "this is another deployment's bucket. Point BUCKETRL_BUCKET_URL at the right bucket (or "
            "BUCKETRL_REDIS_URL at this bucket's Redis)"
        )
    if marker is not None:
        # A new or wiped Redis: this bucket is the truth (the rebuild restores Redis from it).
        await r.set(keys.BUCKET_IDENTITY, marker.model_dump_json(), nx=True)
        return await verify(ctx)  # now recorded: compared like any other (another replica may have raced)
    if recorded is not None:
        return (
            f"bucket {store.url} has no identity marker ({MARKER_KEY}) but Redis records bucket "
            f"{recorded.bucket_id}: the deployment's bucket is missing or was replaced by an empty one. Restore it "
            f"(mount the volume, rename the directory back, fix BUCKETRL_BUCKET_URL); to start over on purpose "
            f"in this bucket, delete the Redis key {keys.BUCKET_IDENTITY!r} and the runs"
        )
    in_redis = {m.decode() if isinstance(m, bytes) else m for m in await r.smembers(keys.RUNS_SET)}
    if in_redis and not in_redis & set(await asyncio.to_thread(bucket_runs, store)):
        return (
            f"Redis holds {len(in_redis)} run(s) ({', '.join(sorted(in_redis)[:3])}) but bucket {store.url} has "
            f"neither those runs nor an identity marker: the deployment's bucket is missing. Restore it (or "
            "fix BUCKETRL_BUCKET_URL)"
        )
    # First use (or a bucket from before identity markers): Redis decides, so concurrent replicas agree.
    fresh = BucketMarker(bucket_id=uuid.uuid4().hex, created_at=time.time())
    await r.set(keys.BUCKET_IDENTITY, fresh.model_dump_json(), nx=True)
    chosen = BucketMarker.model_validate_json(await r.get(keys.BUCKET_IDENTITY))
    await asyncio.to_thread(store.put_bytes, MARKER_KEY, json.dumps(chosen.model_dump()).encode())
    log.info("bucket %s: identity %s recorded (first use by this deployment)", store.url, chosen.bucket_id)
    return None


async def check(ctx: Any, *, force: bool = False) -> IdentityState:
    """Verify (at most every :data:`RECHECK_S` unless ``force``) and update ``ctx.identity``; never raises."""
    from redis import exceptions as redis_exc

    state: IdentityState = ctx.identity
    if not force and state.ok:
        return state
    async with state._lock:
        if not force and (state.ok or time.monotonic() - state.checked_at < RECHECK_S):
            return state
        state.checked_at = time.monotonic()
        try:
            problem = await verify(ctx)
        except (errors.BucketRLError, redis_exc.RedisError) as exc:
            # Unreachable: cannot tell. A verified bucket stays verified through an outage (its routes answer
            # 503 on their own; Redis-only ones such as lease renewals keep working), a refusal stays a refusal.
            if not state.ok and not state.refused:
                state.problem = f"cannot verify the bucket's identity yet: {getattr(exc, 'message', None) or exc!r}"
            return state
        if problem is None:
            if state.refused:
                log.warning("bucket %s: identity confirmed again; serving", ctx.store.url)
            state.problem, state.refused = None, False
        else:
            if not state.refused or state.problem != problem:
                log.error("REFUSING TO SERVE: %s", problem)
            state.problem, state.refused = problem, True
    return state
