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

# Lease hashes outlive their expiry a while so a late renew says "expired" (410) with the version.
_GRACE_MS = 600_000

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
"""

# KEYS: state. ARGV: prefix, version (0 = latest), lease_id, worker_id, ttl_s.
_CREATE = Lua(
    _NOW
    + """
local p = ARGV[1]
local lk = p .. 'lease:' .. ARGV[3]
-- A replay (same request id, so the same lease id) answers the lease its first attempt created, even one
-- released or expired since: one lease per request, never a second one that only waits to expire.
if redis.call('EXISTS', lk) == 1 then
  return {'ok', redis.call('HGET', lk, 'version'), redis.call('HGET', lk, 'expires_at')}
end
local v = tonumber(ARGV[2])
local latest = tonumber(redis.call('HGET', KEYS[1], 'latest_version') or '0')
if v == 0 then v = latest end
if v == 0 then return {'none', '0', '0'} end
local st = redis.call('HGET', p .. 'version:' .. v, 'state')
if not st then
  if v > latest then return {'unknown', tostring(v), tostring(latest)} end
  return {'gone', tostring(v), tostring(latest)}
end
if st ~= 'live' then return {'gone', tostring(v), tostring(latest)} end
local exp = now + tonumber(ARGV[5])
local sexp = string.format('%.6f', exp)
redis.call('ZADD', p .. 'leases', sexp, ARGV[3])
redis.call('ZADD', p .. 'vleases:' .. v, sexp, ARGV[3])
redis.call('HSET', lk, 'version', v, 'worker_id', ARGV[4], 'expires_at', sexp)
redis.call('PEXPIRE', lk, math.floor(tonumber(ARGV[5]) * 1000) + """
    + str(_GRACE_MS)
    + """)
return {'ok', tostring(v), sexp}
"""
)

# ARGV: prefix, lease_id, ttl_s.
_RENEW = Lua(
    _NOW
    + """
local p = ARGV[1]
local lk = p .. 'lease:' .. ARGV[2]
local v = redis.call('HGET', lk, 'version')
if not v then return {'unknown', '0', '0'} end
local exp = tonumber(redis.call('HGET', lk, 'expires_at'))
if exp <= now or redis.call('HEXISTS', lk, 'released') == 1 then
  redis.call('ZREM', p .. 'leases', ARGV[2])
  redis.call('ZREM', p .. 'vleases:' .. v, ARGV[2])
  return {'expired', v, string.format('%.6f', exp)}
end
local new = string.format('%.6f', now + tonumber(ARGV[3]))
redis.call('ZADD', p .. 'leases', new, ARGV[2])
redis.call('ZADD', p .. 'vleases:' .. v, new, ARGV[2])
redis.call('HSET', lk, 'expires_at', new)
redis.call('PEXPIRE', lk, math.floor(tonumber(ARGV[3]) * 1000) + """
    + str(_GRACE_MS)
    + """)
return {'ok', v, new}
"""
)

# ARGV: prefix, lease_id.
_RELEASE = Lua(
    _NOW
    + """
local p = ARGV[1]
local lk = p .. 'lease:' .. ARGV[2]
local v = redis.call('HGET', lk, 'version')
if not v then return {'unknown', '0'} end
-- A replayed release answers what the first one did (the hash stays, marked, until its grace ends; a
-- replayed create then answers this ended lease rather than creating a new one).
local done = redis.call('HGET', lk, 'released')
if done then return {done, v} end
local exp = tonumber(redis.call('HGET', lk, 'expires_at'))
redis.call('ZREM', p .. 'leases', ARGV[2])
redis.call('ZREM', p .. 'vleases:' .. v, ARGV[2])
local out = 'ok'
if exp <= now then out = 'expired' end
redis.call('HSET', lk, 'released', out, 'expires_at', string.format('%.6f', math.min(exp, now)))
return {out, v}
"""
)

# KEYS: state, versions, gc:deleting, gc:hold. ARGV: prefix, max_staleness, limit.
# Returns the versions newly marked 'deleting' (their files may now be removed). While gc:hold exists
# (set by a rebuild: leases died with the old Redis, generators need time to lease again) nothing is marked.
_MARK_COLLECTABLE = Lua(
    _NOW
    + """
local p = ARGV[1]
redis.call('ZREMRANGEBYSCORE', p .. 'leases', '-inf', now)
if redis.call('EXISTS', KEYS[4]) == 1 then return {} end
local latest = tonumber(redis.call('HGET', KEYS[1], 'latest_version') or '0')
local cutoff = latest - tonumber(ARGV[2])
local marked = {}
if cutoff <= 1 then return marked end
local cands = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. cutoff, 'LIMIT', 0, tonumber(ARGV[3]))
for _, v in ipairs(cands) do
  local vk = p .. 'vleases:' .. v
  redis.call('ZREMRANGEBYSCORE', vk, '-inf', now)
  if redis.call('ZCARD', vk) == 0 then
    redis.call('HSET', p .. 'version:' .. v, 'state', 'deleting')
    redis.call('ZREM', KEYS[2], v)
    redis.call('SADD', KEYS[3], v)
    redis.call('DEL', vk)
    table.insert(marked, v)
  end
end
return marked
"""
)


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
