"""The maintenance loop: version garbage collection (docs/design.md invariant 1) and wiped-Redis detection.

Every ``gc_interval_s`` (``BUCKETRL_GC_INTERVAL_S``), for each run:
1. ``leases.mark_collectable`` (one Lua script) drops expired leases and marks ``deleting`` every
   version older than ``latest − max_staleness`` that no live lease holds;
2. the files of every version marked ``deleting`` (this pass's and any a crashed replica left) are
   deleted from the bucket, manifest first;
3. the version becomes ``gone`` (GET answers 410) and ``gc_versions`` counts it;
4. rollout batch objects whose groups are all settled but that a batch cleaner left (a proxy that died,
   a bucket that was down) are deleted (``state/cleanup.sweep``);
5. checkpoints older than the newest ``checkpoint_keep`` steps are deleted (``state/checkpoints.prune``).
Several replicas may run this loop at once: marking is atomic, deleting is idempotent.

Run one pass by hand: ``await gc.collect_run(ctx, run, spec)`` (tests do).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from redis import exceptions as redis_exc

from bucketrl import errors
from bucketrl.proxy import bucket_meter, identity, keys, rebuild
from bucketrl.proxy.state import checkpoints, cleanup, leases, runs
from bucketrl.proxy.state.versions import GONE, adapter_prefix
from bucketrl.storage import dirs
from bucketrl.wire import RunSpec

log = logging.getLogger("bucketrl.proxy.gc")


async def collect_run(ctx: Any, run: str, spec: RunSpec) -> list[int]:
    """One GC pass over ``run``; returns the versions whose files were deleted."""
    r = ctx.redis
    await leases.mark_collectable(r, run, spec.max_staleness)
    deleting = sorted(int(v) for v in await r.smembers(keys.run_key(run, keys.GC_DELETING)))
    done: list[int] = []
    for version in deleting:
        await asyncio.to_thread(dirs.delete_dir, ctx.store, adapter_prefix(run, version))
        await r.hset(keys.run_key(run, keys.VERSION_INFO.format(n=version)), "state", GONE)
        if await r.srem(keys.run_key(run, keys.GC_DELETING), version):
            # Another replica may have finished the same version first: count it once.
            await r.hincrby(keys.run_key(run, keys.COUNTERS), "gc_versions", 1)
            ctx.telemetry.gc_versions.labels(run=run).inc()
            done.append(version)
            log.info("run %s: garbage-collected adapter v%d", run, version)
    return done


async def collect_all(ctx: Any) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for run in await runs.list_runs(ctx.redis):
        spec = await runs.get_spec(ctx.redis, run)
        if spec is not None:
            out[run] = await collect_run(ctx, run, spec)
            await cleanup.sweep(ctx.redis, ctx.store, run, spec)
            keep = ctx.settings.checkpoint_keep
            pruned = await checkpoints.prune(ctx, run, keep)
            if pruned:
                log.info("run %s: deleted checkpoints %s (keeping the newest %d)", run, pruned, keep)
    return out


async def maintenance_loop(ctx: Any, stop: asyncio.Event) -> None:
    """Run passes until ``stop`` is set. A stop flag, not just cancellation: a cancel that lands inside a
    Redis read's own timeout can surface as a Redis TimeoutError, which this loop must survive."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), ctx.settings.gc_interval_s)
        if stop.is_set():
            return
        try:
            if not (await identity.check(ctx, force=True)).ok:
                continue  # never rebuild from, or collect in, a bucket that is not this deployment's
            if ctx.settings.rebuild_on_start:
                await rebuild.rebuild_if_wiped(ctx)
            await collect_all(ctx)
            await bucket_meter.flush(ctx.redis, ctx.meter)
        except asyncio.CancelledError:
            raise
        except (redis_exc.RedisError, errors.Unavailable) as exc:
            log.warning("maintenance pass skipped: %r", exc)
        except Exception:
            log.exception("maintenance pass failed")
