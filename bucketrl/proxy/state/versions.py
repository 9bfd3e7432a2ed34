"""Adapter versions: publish (fenced, dense, atomic), look up, and wait for a newer one.

Redis per run: ``state.latest_version``; ``versions`` (zset version -> version) of versions whose files
exist; ``version:{N}`` (hash sha256, bytes, published_at, epoch, state). ``state`` is ``live`` (leasable,
downloadable), ``deleting`` (GC decided, files going) or ``gone``. A version hash never disappears while
Redis lives, so an old number answers 410, not 404.

Publishing version N (invariant 2: dense, monotonic, never by a fenced trainer):
1. the body is spooled to a temp file and hashed (never held whole in memory), and checked to be a PEFT adapter
   whose weights are in the run spec's ``adapter_dtype`` (422 ``adapter_dtype_mismatch`` if not); the dtype is
   recorded in the manifest's meta and the version's record, and announced with the version;
2. the write lock of ``v{N}`` is taken in Lua together with ``epoch == current`` and ``N == latest+1``;
3. the tar is committed under ``runs/{run}/adapters/v{N}/`` (manifest last; leftovers of a crashed or
   fenced attempt are cleared first: under the lock with N > latest, nobody can be reading them);
4. ONE Lua script re-checks lock ownership, the epoch and ``N == latest+1``, records the version, bumps
   ``latest_version`` and PUBLISHes N. A trainer registering between 2 and 4 fences the commit: the
   files are deleted and the caller gets 409 ``fenced``. So no fenced trainer ever publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import IO, Any

from bucketrl import bundles, errors
from bucketrl.proxy import keys
from bucketrl.proxy.state.locks import WriteLock, fenced_or_restoring
from bucketrl.proxy.state.lua import Lua
from bucketrl.proxy.state.runs import latest_version
from bucketrl.proxy.state.uploads import spool_verified
from bucketrl.storage import dirs
from bucketrl.wire import AdapterVersionInfo

log = logging.getLogger("bucketrl.proxy.versions")

LIVE, DELETING, GONE = "live", "deleting", "gone"

# KEYS: state, lock, version:N, versions, channel. ARGV: epoch, N, owner, sha256, bytes, dtype.
_COMMIT = Lua.load("version_commit.lua")


def adapter_prefix(run: str, version: int) -> str:
    return f"runs/{run}/adapters/v{version}"


def _info_key(run: str, version: int) -> str:
    return keys.run_key(run, keys.VERSION_INFO.format(n=version))


def _decode(h: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in h.items()}


async def get_record(r: Any, run: str, version: int) -> dict[str, str] | None:
    h = await r.hgetall(_info_key(run, version))
    return _decode(h) if h else None


def to_info(version: int, rec: dict[str, str]) -> AdapterVersionInfo:
    return AdapterVersionInfo(
        version=version,
        sha256=rec["sha256"],
        bytes=int(rec["bytes"]),
        published_at=float(rec["published_at"]),
        dtype=rec.get("dtype", "float32"),  # type: ignore[arg-type]  # written by publish from the checked tar
    )


async def live_record(r: Any, run: str, version: int) -> dict[str, str]:
    """The record of a downloadable version: 404 if never published, 410 if garbage-collected."""
    rec = await get_record(r, run, version)
    if rec is None:
        latest = await latest_version(r, run)
        if version > latest:
            raise errors.NotFound(f"run {run!r} has no version {version} (latest is {latest})", code="unknown_version")
        raise errors.Gone(f"run {run!r}: version {version} was garbage-collected", code="version_gone")
    if rec.get("state") != LIVE:
        raise errors.Gone(f"run {run!r}: version {version} was garbage-collected", code="version_gone")
    return rec


async def latest_info(r: Any, run: str) -> AdapterVersionInfo | None:
    latest = await latest_version(r, run)
    if latest == 0:
        return None
    rec = await get_record(r, run, latest)
    return None if rec is None else to_info(latest, rec)


async def wait_newer(ctx: Any, run: str, after: int, wait_s: float) -> AdapterVersionInfo | None:
    """The latest version if it is newer than ``after``, waiting up to ``wait_s`` for one (pub/sub woken)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    with ctx.notifier.waiter(run) as event:  # registered BEFORE the first read: no lost wake-up
        while True:
            event.clear()
            info = await latest_info(ctx.redis, run)
            if info is not None and info.version > after:
                return info
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), remaining)


async def committed_same(r: Any, run: str, version: int, sha256: str, epoch: int) -> AdapterVersionInfo | None:
    """The version's info if it is committed with these bytes by this epoch: a retried publish answers it (200)."""
    rec = await get_record(r, run, version)
    if rec is None or rec.get("sha256") != sha256 or rec.get("epoch") != str(epoch):
        return None
    return to_info(version, rec)


async def publish(
    ctx: Any,
    run: str,
    version: int,
    epoch: int,
    expected_sha256: str,
    chunks: AsyncIterator[bytes],
    adapter_dtype: str = "auto",
) -> AdapterVersionInfo:
    """Publish ``version`` from a tar body stream; see the module docstring for the protocol. ``adapter_dtype``:
    the run spec's (``auto``: whatever one dtype the trainer chose)."""
    s = ctx.settings
    found: list[str] = []
    timings: dict[str, float] = {}
    check = _dtype_check(adapter_dtype, version, found)
    spooled = await spool_verified(chunks, s.max_adapter_bytes, expected_sha256, check, timings)
    dtype = found[0]
    with spooled:
        lock = WriteLock(ctx.redis, run, f"v{version}", epoch, ttl_s=s.publish_lock_s, expected_next=version)
        try:
            await lock.acquire()
        except errors.Conflict as exc:
            # A retry that waited for the lock while its first attempt committed the same bytes: that is success.
            if exc.code == "version_conflict" and (
                same := await committed_same(ctx.redis, run, version, spooled.sha256, epoch)
            ):
                return same
            raise
        prefix = adapter_prefix(run, version)
        # Files are removed on failure only while their fate is known: before the commit is attempted, or
        # after a 'fenced' answer. A Redis error mid-commit (it may have been recorded) or a lost lock
        # (another writer may own the prefix now) leaves them; a retry finds the version or clears them.
        keep_files = False
        try:
            meta = {"run": run, "version": version, "epoch": epoch, "dtype": dtype}
            t_write = time.perf_counter()
            await asyncio.to_thread(_write_bundle, ctx.store, prefix, spooled, expected_sha256, meta, timings)
            t_commit = time.perf_counter()
            timings["bucket_s"] = t_commit - t_write
            keep_files = True
            status, detail = await _COMMIT(
                ctx.redis,
                [
                    keys.run_key(run, keys.STATE),
                    lock.key,
                    _info_key(run, version),
                    keys.run_key(run, keys.VERSIONS),
                    keys.run_key(run, keys.VERSION_CHANNEL),
                ],
                [epoch, version, lock.owner, spooled.sha256, spooled.size, dtype],
            )
            status, detail = status.decode(), detail.decode()
            keep_files = status != "fenced"
            if status == "ok":
                ctx.telemetry.published_versions.labels(run=run).inc()
                timings["commit_s"] = time.perf_counter() - t_commit
                _log_published(run, version, spooled.size, dtype, timings)
                return AdapterVersionInfo(
                    version=version,
                    sha256=spooled.sha256,
                    bytes=spooled.size,
                    published_at=float(detail),
                    dtype=dtype,  # type: ignore[arg-type]  # one of bundles.WEIGHT_DTYPES' names
                )
            if status == "fenced":
                err = await fenced_or_restoring(ctx.redis, run, epoch, int(detail), "during publish")
                if isinstance(err, errors.Fenced):
                    ctx.telemetry.fenced_writes.labels(run=run).inc()
                raise err
            if status == "conflict":
                if same := await committed_same(ctx.redis, run, version, spooled.sha256, epoch):
                    return same
                raise errors.Conflict(
                    f"run {run!r}: version {version} is not latest+1 (latest is {detail})", code="version_conflict"
                )
            raise errors.Conflict(
                f"run {run!r}: lost the write lock of v{version} (Redis restarted?); retry",
                retryable=True,
                code="write_in_progress",
            )
        finally:
            if not keep_files and await lock.owned():
                # Nobody can have seen these files (Redis never recorded them): remove them.
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(dirs.delete_dir, ctx.store, prefix)
            await lock.release()


def _dtype_check(want: str, version: int, found: list[str]) -> Callable[[IO[bytes]], None]:
    """The publish's tar check: a PEFT adapter whose weights are in ``want`` (the run spec's adapter_dtype); the
    dtype found is appended to ``found``."""

    def check(fh: IO[bytes]) -> None:
        dtype = bundles.check_adapter_tar(fh)
        bundles.check_dtype(dtype, want, f"adapter v{version}", "the run spec's adapter_dtype")
        found.append(dtype)

    return check


def _log_published(run: str, version: int, size: int, dtype: str, timings: dict[str, float]) -> None:
    """Where a publish's time went (docs/scale.md; bench/publish_path.py reads this line)."""
    phases = " ".join(f"{k}={v:.3f}" for k, v in timings.items())
    log.info("published %s v%d (%d bytes, %s): %s", run, version, size, dtype, phases)


def _write_bundle(
    store: Any,
    prefix: str,
    spooled: dirs.Spooled,
    sha256: str,
    meta: dict[str, Any],
    timings: dict[str, float] | None = None,
) -> None:
    if dirs.read_manifest(store, prefix) is not None:
        # A crashed or fenced attempt committed files Redis never recorded; we hold the lock and N > latest.
        log.warning("clearing unrecorded leftovers at %s before publishing", prefix)
        dirs.delete_dir(store, prefix)
    dirs.commit_tar(store, prefix, spooled, sha256, meta, timings)
