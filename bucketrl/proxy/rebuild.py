"""Rebuild Redis from the bucket: the bucket is the durable truth, Redis only coordinates.

When: ``bucketrl proxy --rebuild`` (forced, at start), automatically at start and from the maintenance
loop when Redis holds no run but the bucket does (``BUCKETRL_REBUILD_ON_START``, default on), and for a
single run when ``PUT /v1/runs/{run}`` finds it in the bucket but not in Redis.

What, per run found as ``runs/{run}/run.json``:
- the spec (Redis keeps its own if it still has one);
- every committed adapter version ``runs/{run}/adapters/v{N}/manifest.json`` (sha256, bytes, dtype,
  published_at = manifest time) as ``live``; ``latest_version`` = the largest N (numbering continues
  densely after it; GC'd numbers below answer 410);
- every committed checkpoint ``runs/{run}/checkpoints/step-{k}/`` (``latest`` = the largest step);
- ``trainer_epoch`` = the largest epoch recorded in any manifest or registration record
  (``runs/{run}/trainer-epochs/``), so the live trainer keeps its epoch, a trainer registering after the
  rebuild gets a larger one and every older trainer is fenced;
- a GC hold of ``rebuild_gc_grace_s``: leases died with Redis, generators need time to lease again.
Then the rollout queue and the prompt cursor are rebuilt (``state/restore.py``).

Values are merged with ``max`` and records only added, so a rebuild is idempotent and two replicas
may run it at once.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

from redis import exceptions as redis_exc

from bucketrl import errors
from bucketrl.proxy import keys
from bucketrl.proxy.state import restore as restore_queue
from bucketrl.proxy.state import runs
from bucketrl.proxy.state.checkpoints import checkpoint_prefix
from bucketrl.proxy.state.versions import adapter_prefix
from bucketrl.storage import dirs
from bucketrl.wire import RunSpec
from bucketrl.wire.common import ID_PATTERN

log = logging.getLogger("bucketrl.proxy.rebuild")


_RUN_JSON = re.compile(r"^runs/([^/]+)/run\.json$")
_ID = re.compile(ID_PATTERN)


@dataclass
class RunSnapshot:
    """What the bucket says about one run."""

    run: str
    spec: RunSpec
    versions: dict[int, dirs.Manifest] = field(default_factory=dict)
    checkpoints: dict[int, dirs.Manifest] = field(default_factory=dict)
    max_new_tokens_bound: int = 0  # the largest sampling.max_new_tokens the spec has had (its bucket markers)
    registered_epoch: int = 0  # the largest trainer epoch recorded at registration
    hold: str = "0"  # the pool hold: 1 paused, 2 finished (its bucket marker: routes/pool.py), 0 none

    @property
    def max_epoch(self) -> int:
        manifests = [*self.versions.values(), *self.checkpoints.values()]
        return max([self.registered_epoch, *(int(m.meta.get("epoch", 0) or 0) for m in manifests)])


def paused_marker_key(run: str) -> str:
    """Present while the run's generation is paused (empty) or finished (``finished``): a rebuild after a Redis
    wipe keeps the hold."""
    return f"runs/{run}/generation-paused"


def bucket_runs(store: Any) -> list[str]:
    found = []
    for key in store.list_keys("runs"):
        m = _RUN_JSON.match(key)
        if m and _ID.match(m.group(1)):
            found.append(m.group(1))
    return sorted(found)


def scan_run(store: Any, run: str) -> RunSnapshot | None:
    """Read one run's spec and committed manifests from the bucket (blocking; call in a thread)."""
    try:
        spec = dirs.get_json(store, f"runs/{run}/run.json", RunSpec)
    except errors.NotFound:
        return None
    snap = RunSnapshot(run=run, spec=spec)
    epochs = [key.rsplit("/", 1)[1] for key in store.list_keys(f"runs/{run}/trainer-epochs/")]
    snap.registered_epoch = max((int(e) for e in epochs if e.isdigit()), default=0)
    try:
        snap.hold = "2" if store.get_bytes(paused_marker_key(run)) == b"finished" else "1"
    except errors.NotFound:
        snap.hold = "0"
    bounds = [key.rsplit("/", 1)[1] for key in store.list_keys(f"runs/{run}/sampling-bounds/")]
    snap.max_new_tokens_bound = max([spec.sampling.max_new_tokens, *(int(b) for b in bounds if b.isdigit())])
    for name in dirs.list_dirs(store, f"runs/{run}/adapters"):
        if (m := re.fullmatch(r"v(\d+)", name)) and (man := dirs.read_manifest(store, adapter_prefix(run, int(m[1])))):
            snap.versions[int(m[1])] = man
    for name in dirs.list_dirs(store, f"runs/{run}/checkpoints"):
        if (m := re.fullmatch(r"step-(\d+)", name)) and (
            man := dirs.read_manifest(store, checkpoint_prefix(run, int(m[1])))
        ):
            snap.checkpoints[int(m[1])] = man
    return snap


async def restore(ctx: Any, snap: RunSnapshot) -> None:
    """Merge one run's snapshot into Redis (add-only, max-merge), then rebuild its queue and prompt cursor."""
    r, run = ctx.redis, snap.run

    def k(suffix: str) -> str:
        return keys.run_key(run, suffix)

    state = await r.hgetall(k(keys.STATE))
    wall = time.time()
    latest = max([int(state.get(b"latest_version", 0)), *snap.versions])
    epoch = max(int(state.get(b"trainer_epoch", 0)), snap.max_epoch)
    step = max([int(state.get(b"trainer_step", 0)), *snap.checkpoints])
    bound = max(int(state.get(runs.BOUND_FIELD.encode(), 0)), snap.max_new_tokens_bound)
    pipe = r.pipeline(transaction=True)
    # The spec in the same transaction as the state: a route that finds the spec must find latest_version and
    # the epoch too (a publish racing the rebuild was refused "latest is 0" as a version conflict).
    pipe.set(k(keys.SPEC), snap.spec.model_dump_json(), nx=True)
    pipe.hset(
        k(keys.STATE),
        mapping={
            "latest_version": latest,
            "trainer_epoch": epoch,
            "trainer_step": step,
            "updated_at": wall,
            runs.BOUND_FIELD: bound,
        },
    )
    pipe.hsetnx(k(keys.STATE), "created_at", wall)
    for n, man in snap.versions.items():
        info = k(keys.VERSION_INFO.format(n=n))
        pipe.hsetnx(info, "sha256", man.bundle.sha256)
        pipe.hsetnx(info, "bytes", man.bundle.size)
        pipe.hsetnx(info, "published_at", man.created_at)
        pipe.hsetnx(info, "epoch", int(man.meta.get("epoch", 0) or 0))
        pipe.hsetnx(info, "dtype", str(man.meta.get("dtype", "float32")))  # versions before the field: float32
        pipe.hsetnx(info, "state", "live")
    for step_k, man in snap.checkpoints.items():
        info = k(keys.CHECKPOINT_INFO.format(step=step_k))
        pipe.hsetnx(info, "sha256", man.bundle.sha256)
        pipe.hsetnx(info, "bytes", man.bundle.size)
        pipe.hsetnx(info, "created_at", man.created_at)
        pipe.hsetnx(info, "epoch", int(man.meta.get("epoch", 0) or 0))
        pipe.zadd(k(keys.CHECKPOINTS), {str(step_k): step_k})
    if ctx.settings.rebuild_gc_grace_s > 0:
        pipe.set(k(keys.GC_HOLD), "rebuild", px=int(ctx.settings.rebuild_gc_grace_s * 1000))
    if snap.hold != "0":
        pipe.hset(k(keys.POOL), "paused", snap.hold)
    pipe.sadd(keys.RUNS_SET, run)
    await pipe.execute()
    # Versions are indexed only where the record is live (a record Redis already had may say 'gone').
    for n in snap.versions:
        if await r.hget(k(keys.VERSION_INFO.format(n=n)), "state") == b"live":
            await r.zadd(k(keys.VERSIONS), {str(n): n})
    spec = RunSpec.model_validate_json(await r.get(k(keys.SPEC)))
    await restore_queue.ensure_ready(r, ctx.store, run, spec)
    log.warning(
        "run %s rebuilt from the bucket: %d version(s) (latest v%d), %d checkpoint(s), epoch %d",
        run,
        len(snap.versions),
        latest,
        len(snap.checkpoints),
        epoch,
    )


async def rebuild_run_if_in_bucket(ctx: Any, run: str) -> bool:
    snap = await asyncio.to_thread(scan_run, ctx.store, run)
    if snap is None:
        return False
    await restore(ctx, snap)
    return True


async def rebuild_all(ctx: Any) -> list[str]:
    """Restore every run the bucket holds (forced; ``bucketrl proxy --rebuild``). Returns the run ids."""
    restored = []
    for run in await asyncio.to_thread(bucket_runs, ctx.store):
        if await rebuild_run_if_in_bucket(ctx, run):
            restored.append(run)
    return restored


REBUILDING_TTL_MS = 120_000  # a replica that dies mid-rebuild must not leave every unknown run at 503 for long


async def rebuilding(ctx: Any) -> bool:
    """Whether a rebuild from the bucket is under way (this process, or any replica sharing the Redis)."""
    return ctx.rebuild_lock.locked() or bool(await ctx.redis.exists(keys.REBUILDING))


async def rebuild_if_wiped(ctx: Any) -> bool:
    """Rebuild when Redis holds no run but the bucket does. Never raises for an unreachable Redis/bucket."""
    try:
        if await ctx.redis.scard(keys.RUNS_SET):
            return False
        async with ctx.rebuild_lock:  # one rebuild per app at a time; the others wait and re-check
            if await ctx.redis.scard(keys.RUNS_SET):
                return True
            found = await asyncio.to_thread(bucket_runs, ctx.store)
            if not found:
                return False
            log.warning("Redis holds no runs but the bucket has %d: rebuilding from bucket manifests", len(found))
            # Runs are restored one by one, so RUNS_SET is non-empty before the last one is back: the marker
            # tells every replica that a run it cannot find yet is coming (503, retried), not unknown (404).
            await ctx.redis.set(keys.REBUILDING, "1", px=REBUILDING_TTL_MS)
            try:
                await rebuild_all(ctx)
            finally:
                await ctx.redis.delete(keys.REBUILDING)
            return True
    except (redis_exc.RedisError, errors.Unavailable) as exc:
        log.warning("rebuild check skipped (%r); the maintenance loop retries", exc)
        return False
