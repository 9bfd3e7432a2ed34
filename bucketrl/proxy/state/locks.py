"""The write lock of one bundle (an adapter version or a checkpoint step), fenced by the trainer epoch.

A bundle is written to the bucket BEFORE Redis records it, so two writers of the same prefix (a fenced
trainer whose upload is still in flight and its successor) must never write at the same time. The lock
is taken in Lua together with the epoch check (and, for versions, the ``N == latest + 1`` check), held
with a short TTL that a background task refreshes while the bucket write runs, and released by its
owner only. A second writer waits up to ``wait_s`` for it, then gets 409 ``write_in_progress``
(retryable). The refresh re-checks the epoch, so a writer fenced mid-upload learns it early.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from typing import Any

from bucketrl import errors
from bucketrl.proxy import keys
from bucketrl.proxy.state.lua import Lua

# Epoch of a lock that is not fenced (the run's dataset: write-once and content-checked, see routes/dataset.py).
UNFENCED = -1

# KEYS: state, lock. ARGV: epoch (UNFENCED = no check), owner, ttl_ms, expected_next (0 = no check).
_RESERVE = Lua.load("lock_reserve.lua")

# KEYS: state, lock. ARGV: epoch, owner, ttl_ms.
_REFRESH = Lua.load("lock_refresh.lua")

# KEYS: lock. ARGV: owner.
_RELEASE = Lua.load("lock_release.lua")


async def fenced_or_restoring(r: Any, run: str, epoch: int, current: int, what: str) -> errors.BucketRLError:
    """The error for a write whose epoch check failed. Current epoch 0 with no run state at all is a Redis that
    lost everything (wiped or restarted empty) and is not rebuilt yet: 503, retry (the retry's run lookup
    rebuilds it from the bucket), not ``fenced`` (which would stop the live trainer for good)."""
    # (A state hash can exist without the epoch: another write, e.g. a metrics push, recreated it after the wipe.)
    if current == 0 and not await r.hexists(keys.run_key(run, keys.STATE), "trainer_epoch"):
        return errors.Unavailable(f"run {run!r}: its state is being restored from the bucket (Redis lost it); retry")
    return errors.Fenced(f"run {run!r}: trainer epoch {epoch} was fenced by epoch {current} {what}")


class WriteLock:
    def __init__(
        self, r: Any, run: str, name: str, epoch: int, *, ttl_s: float, expected_next: int = 0, wait_s: float = 30.0
    ) -> None:
        self.r = r
        self.run = run
        self.epoch = epoch
        self.state_key = keys.run_key(run, keys.STATE)
        self.key = keys.run_key(run, keys.WRITE_LOCK.format(name=name))
        self.name = name
        self.owner = secrets.token_hex(12)
        self.ttl_ms = max(1000, int(ttl_s * 1000))
        self.expected_next = expected_next
        self.wait_s = wait_s
        self.fenced = False
        self.lost = False
        self._refresher: asyncio.Task[None] | None = None

    async def acquire(self) -> int:
        """Take the lock; returns ``latest_version``. Fenced / Conflict / 409 write_in_progress otherwise."""
        deadline = time.monotonic() + self.wait_s
        pause = 0.02
        while True:
            status, latest = await _RESERVE(
                self.r, [self.state_key, self.key], [self.epoch, self.owner, self.ttl_ms, self.expected_next]
            )
            status = status.decode() if isinstance(status, bytes) else status
            if status == "ok":
                self._refresher = asyncio.create_task(self._refresh_loop())
                return int(latest)
            if status == "fenced":
                why = "(a newer trainer registered)"
                raise await fenced_or_restoring(self.r, self.run, self.epoch, int(latest), why)
            if status == "conflict":
                raise errors.Conflict(
                    f"run {self.run!r}: version {self.expected_next} is not latest+1 (latest is {latest})",
                    code="version_conflict",
                )
            if time.monotonic() >= deadline:
                raise errors.Conflict(
                    f"run {self.run!r}: {self.name} is being written by another upload; retry",
                    retryable=True,
                    code="write_in_progress",
                )
            await asyncio.sleep(pause)
            pause = min(0.5, pause * 2)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            with contextlib.suppress(Exception):  # a Redis blip: the commit re-checks ownership anyway
                res = await _REFRESH(self.r, [self.state_key, self.key], [self.epoch, self.owner, self.ttl_ms])
                res = res.decode() if isinstance(res, bytes) else res
                self.fenced = self.fenced or res == "fenced"
                self.lost = self.lost or res == "lost"

    async def owned(self) -> bool:
        """Whether this writer still holds the lock (then nobody else can be writing its prefix)."""
        try:
            holder = await self.r.get(self.key)
        except Exception:
            return False
        return holder is not None and holder.decode() == self.owner

    async def release(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None
        with contextlib.suppress(Exception):  # an unreleased lock expires by itself after its TTL
            await _RELEASE(self.r, [self.key], [self.owner])
