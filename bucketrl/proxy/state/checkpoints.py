"""Checkpoints: epoch-fenced atomic writes under ``runs/{run}/checkpoints/step-{k}/`` and their index.

Redis per run: ``checkpoints`` (zset step -> step) and ``ckpt:{k}`` (hash sha256, bytes, created_at,
epoch). The protocol is the adapters' (``versions.py``): spool + hash, take the step's write lock with
the epoch check, commit the tar (manifest last), then ONE Lua script re-checks lock and epoch and
records the step. A fenced trainer's files are removed and it gets 409 ``fenced``.

Writing a step that already exists: the same bytes again is a no-op (a retried PUT) answered 200 only
when the step's files are in the bucket, checked again after the write lock is taken (a retry that waited
for the lock while its first attempt committed must not take the committed step for leftovers);
different bytes from the current epoch replace it (a resumed trainer redoing a step of a dead timeline) —
the index entry is dropped before the files change, so ``latest`` never points at a half-written step.

Retention (:func:`prune`, run by the maintenance loop): all but the newest ``checkpoint_keep`` steps are
un-indexed, then their files deleted (manifest first, so a crash in between leaves nothing a rebuild
would restore). A step whose write lock is held (being written) is left for a later pass.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from bucketrl import bundles, errors
from bucketrl.proxy import keys
from bucketrl.proxy.state.locks import WriteLock, fenced_or_restoring
from bucketrl.proxy.state.lua import Lua
from bucketrl.proxy.state.uploads import spool_verified
from bucketrl.storage import dirs
from bucketrl.wire import CheckpointInfo

# KEYS: state, lock, ckpt:k, checkpoints. ARGV: epoch, step, owner, sha256, bytes.
_COMMIT = Lua.load("checkpoint_commit.lua")


def checkpoint_prefix(run: str, step: int) -> str:
    return f"runs/{run}/checkpoints/step-{step}"


def _info_key(run: str, step: int) -> str:
    return keys.run_key(run, keys.CHECKPOINT_INFO.format(step=step))


async def get_info(r: Any, run: str, step: int) -> CheckpointInfo | None:
    h = await r.hgetall(_info_key(run, step))
    if not h:
        return None
    return CheckpointInfo(
        step=step,
        sha256=h[b"sha256"].decode(),
        bytes=int(h[b"bytes"]),
        created_at=float(h[b"created_at"]),
        epoch=int(h.get(b"epoch") or 0),
    )


async def latest_step(r: Any, run: str) -> int | None:
    top = await r.zrevrange(keys.run_key(run, keys.CHECKPOINTS), 0, 0)
    return int(top[0]) if top else None


async def latest(r: Any, run: str) -> CheckpointInfo | None:
    step = await latest_step(r, run)
    return None if step is None else await get_info(r, run, step)


async def put(
    ctx: Any, run: str, step: int, epoch: int, expected_sha256: str, chunks: AsyncIterator[bytes]
) -> CheckpointInfo:
    s = ctx.settings
    spooled = await spool_verified(chunks, s.max_checkpoint_bytes, expected_sha256, bundles.check_checkpoint_tar)
    with spooled:
        prefix = checkpoint_prefix(run, step)
        done = await _committed(ctx, run, step, spooled.sha256)
        if done is not None:
            return done
        lock = WriteLock(ctx.redis, run, f"step-{step}", epoch, ttl_s=s.publish_lock_s)
        await lock.acquire()
        # Files are removed on failure only while their fate is known (see versions.publish).
        keep_files = False
        try:
            # Again under the lock: another attempt of this PUT may have committed while this one waited.
            done = await _committed(ctx, run, step, spooled.sha256)
            if done is not None:
                keep_files = True
                return done
            existing = await get_info(ctx.redis, run, step)
            if existing is not None:
                # Un-index first: `latest` must never name a step whose files are being replaced.
                pipe = ctx.redis.pipeline(transaction=True)
                pipe.zrem(keys.run_key(run, keys.CHECKPOINTS), step)
                pipe.delete(_info_key(run, step))
                await pipe.execute()
            await asyncio.to_thread(_write_bundle, ctx.store, prefix, spooled, expected_sha256, run, step, epoch)
            keep_files = True
            status, detail = await _COMMIT(
                ctx.redis,
                [keys.run_key(run, keys.STATE), lock.key, _info_key(run, step), keys.run_key(run, keys.CHECKPOINTS)],
                [epoch, step, lock.owner, spooled.sha256, spooled.size],
            )
            status, detail = status.decode(), detail.decode()
            keep_files = status != "fenced"
            if status == "ok":
                return CheckpointInfo(
                    step=step, sha256=spooled.sha256, bytes=spooled.size, created_at=float(detail), epoch=epoch
                )
            if status == "fenced":
                err = await fenced_or_restoring(ctx.redis, run, epoch, int(detail), "during the write")
                if isinstance(err, errors.Fenced):
                    ctx.telemetry.fenced_writes.labels(run=run).inc()
                raise err
            raise errors.Conflict(
                f"run {run!r}: lost the write lock of checkpoint step {step}; retry",
                retryable=True,
                code="write_in_progress",
            )
        finally:
            if not keep_files and await lock.owned():
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(dirs.delete_dir, ctx.store, prefix)
            await lock.release()


async def _committed(ctx: Any, run: str, step: int, sha256: str) -> CheckpointInfo | None:
    """The step's record if it holds these bytes AND its files are in the bucket (a retried PUT), else None."""
    existing = await get_info(ctx.redis, run, step)
    if existing is None or existing.sha256 != sha256:
        return None
    manifest = await asyncio.to_thread(dirs.read_manifest, ctx.store, checkpoint_prefix(run, step))
    return existing if manifest is not None and manifest.bundle.sha256 == sha256 else None


# KEYS: checkpoints, ckpt:k, lock of step k. ARGV: step. Un-index the step unless it is being written.
_UNINDEX = Lua.load("checkpoint_unindex.lua")


async def prune(ctx: Any, run: str, keep: int) -> list[int]:
    """Delete every checkpoint but the newest ``keep`` steps (``keep`` <= 0: none); returns the deleted steps."""
    if keep <= 0:
        return []
    index = keys.run_key(run, keys.CHECKPOINTS)
    old = sorted(int(s) for s in await ctx.redis.zrange(index, 0, -(keep + 1)))
    done: list[int] = []
    for step in old:
        lock_key = keys.run_key(run, keys.WRITE_LOCK.format(name=f"step-{step}"))  # what put's WriteLock holds
        if not int(await _UNINDEX(ctx.redis, [index, _info_key(run, step), lock_key], [step])):
            continue
        await asyncio.to_thread(dirs.delete_dir, ctx.store, checkpoint_prefix(run, step))
        done.append(step)
    return done


def _write_bundle(store: Any, prefix: str, spooled: dirs.Spooled, sha256: str, run: str, step: int, epoch: int) -> None:
    if dirs.read_manifest(store, prefix) is not None:
        dirs.delete_dir(store, prefix)  # unindexed leftovers (crash, fenced attempt, replaced step); we hold the lock
    dirs.commit_tar(store, prefix, spooled, sha256, {"run": run, "step": step, "epoch": epoch})
