"""Version leases and the garbage collector's decision: race-free by construction (docs/design.md invariant 1).

Redis per run: ``leases`` (zset lease_id -> expires_at, all leases), ``vleases:{N}`` (zset lease_id ->
expires_at, the leases of version N), ``lease:{id}`` (hash version, worker_id, expires_at). Times are
Redis ``TIME``, so every proxy replica agrees on when a lease expires.

Why no leased version is ever deleted:
- creating (or renewing) a lease and the GC's "mark N deleting" are each ONE Lua script, so Redis runs
  them one after the other, never interleaved;
- lease creation refuses (410) a version that is not ``live``; renewal refuses (410) a lease already
  expired, so an expired lease can never come back to protect a version GC already claimed;
- ``mark_collectable`` marks N ``deleting`` only if ``vleases:{N}`` holds no lease unexpired at that
  instant, and only for N < latest − max_staleness;
- the bucket files are deleted only after the mark. So a lease that exists at any moment when the files
  are being deleted was created after the mark — and that creation was refused.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from typing import Any

from bucketrl import errors
from bucketrl.proxy import keys
from bucketrl.proxy.state.clock import redis_now
from bucketrl.proxy.state.lua import Lua
from bucketrl.wire import VersionLease

# KEYS: state. ARGV: prefix, version (0 = latest), lease_id, worker_id, ttl_s.
_CREATE = Lua.load("now.lua", "version_lease_create.lua")

# ARGV: prefix, lease_id, ttl_s.
_RENEW = Lua.load("now.lua", "version_lease_renew.lua")

# ARGV: prefix, lease_id.
_RELEASE = Lua.load("now.lua", "version_lease_release.lua")

# KEYS: state, versions, gc:deleting, gc:hold. ARGV: prefix, max_staleness, limit.
# Returns the versions newly marked 'deleting' (their files may now be removed). While gc:hold exists
# (set by a rebuild: leases died with the old Redis, generators need time to lease again) nothing is marked.
_MARK_COLLECTABLE = Lua.load("now.lua", "version_mark_collectable.lua")


def _prefix(run: str) -> str:
    return keys.run_key(run, "")


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def lease_id_for(worker_id: str, request_id: str | None) -> str:
    """A fresh id, or with a request id one derived from it (per worker): every replay names the same lease."""
    if request_id is None:
        return secrets.token_urlsafe(16)
    digest = hashlib.sha256(f"{worker_id}\0{request_id}".encode()).digest()[:16]
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


async def create(
    r: Any, run: str, worker_id: str, version: int | None, ttl_s: float, request_id: str | None = None
) -> VersionLease:
    lease_id = lease_id_for(worker_id, request_id)
    status, v, detail = await _CREATE(
        r, [keys.run_key(run, keys.STATE)], [_prefix(run), version or 0, lease_id, worker_id, ttl_s]
    )
    status, v, detail = _s(status), int(_s(v)), _s(detail)
    if status == "ok":
        return VersionLease(lease_id=lease_id, version=v, expires_at=float(detail))
    if status == "none":
        raise errors.NotFound(f"run {run!r} has no published version yet", code="no_version")
    if status == "unknown":
        raise errors.NotFound(f"run {run!r} has no version {v} (latest is {detail})", code="unknown_version")
    raise errors.Gone(f"run {run!r}: version {v} was garbage-collected; lease the latest", code="version_gone")


async def renew(r: Any, run: str, lease_id: str, ttl_s: float) -> VersionLease:
    status, v, detail = await _RENEW(r, [], [_prefix(run), lease_id, ttl_s])
    status = _s(status)
    if status == "ok":
        return VersionLease(lease_id=lease_id, version=int(_s(v)), expires_at=float(_s(detail)))
    if status == "expired":
        raise errors.Gone(f"lease {lease_id} expired; its version is no longer protected", code="lease_expired")
    raise errors.Gone(f"lease {lease_id} is unknown or long expired", code="lease_expired")


async def release(r: Any, run: str, lease_id: str) -> int:
    status, v = await _RELEASE(r, [], [_prefix(run), lease_id])
    status = _s(status)
    if status == "ok":
        return int(_s(v))
    raise errors.Gone(f"lease {lease_id} had already expired", code="lease_expired")


async def mark_collectable(r: Any, run: str, max_staleness: int, limit: int = 100) -> list[int]:
    marked = await _MARK_COLLECTABLE(
        r,
        [
            keys.run_key(run, keys.STATE),
            keys.run_key(run, keys.VERSIONS),
            keys.run_key(run, keys.GC_DELETING),
            keys.run_key(run, keys.GC_HOLD),
        ],
        [_prefix(run), max_staleness, limit],
    )
    return [int(_s(v)) for v in marked]


async def live_counts(r: Any, run: str) -> dict[int, int]:
    """Live (unexpired) leases per live version, from Redis' clock."""
    now = await redis_now(r)
    versions = [int(_s(v)) for v in await r.zrange(keys.run_key(run, keys.VERSIONS), 0, -1)]
    if not versions:
        return {}
    pipe = r.pipeline(transaction=False)
    for v in versions:
        pipe.zcount(keys.run_key(run, keys.VERSION_LEASES.format(n=v)), f"({now}", "+inf")
    counts = await pipe.execute()
    return dict(zip(versions, (int(c) for c in counts), strict=True))
