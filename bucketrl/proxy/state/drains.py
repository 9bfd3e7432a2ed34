"""Drains (issue 25): a worker told it will be reclaimed (a spot-notice watcher's ``POST .../workers/{id}/drain``).

Redis per run: ``drain:{worker}`` holds the notice's deadline (Redis TIME, like every lease) and expires with
the notice, so a drain outlives neither its notice nor the worker. The worker learns of it from the answer to its
next heartbeat (``POST .../metrics``), which carries the seconds left, or at once from its drain long-poll
(``GET .../workers/{id}/drain?wait_s=N``): a drain publishes the worker's id on the run's ``drains`` channel
(``notify.py``), which wakes that worker's waiting long-polls to re-read their key.
"""

from __future__ import annotations

from typing import Any

from bucketrl import errors
from bucketrl.proxy import keys
from bucketrl.proxy.notify import Notifier, drain_topic, poll_until
from bucketrl.proxy.state.clock import redis_now
from bucketrl.wire.metrics import DrainNotice


def _key(run: str, worker_id: str) -> str:
    return keys.run_key(run, keys.WORKER_DRAIN.format(worker=worker_id))


async def request(r: Any, run: str, worker_id: str, notice_s: float) -> DrainNotice:
    """Record a drain for a worker the proxy has heard from; 404 for one it never has. A second drain keeps the
    earlier deadline when that is sooner (a watcher repeating its call must not lengthen the notice)."""
    if not await r.hexists(keys.run_key(run, keys.WORKERS), worker_id):
        raise errors.NotFound(f"run {run!r}: no worker {worker_id!r} has pushed a heartbeat")
    now = await redis_now(r)
    key = _key(run, worker_id)
    prev = await r.get(key)
    deadline = now + notice_s
    if prev is not None:
        deadline = min(deadline, float(prev))
    await r.set(key, repr(deadline), px=max(1, int((deadline - now) * 1000)))
    # After the set: a long-poll registered before its read either reads the key or is woken by this.
    await r.publish(keys.run_key(run, keys.DRAIN_CHANNEL), worker_id)
    return DrainNotice(worker_id=worker_id, notice_s=max(0.0, deadline - now))


async def pending(r: Any, run: str, worker_id: str) -> DrainNotice | None:
    """The drain pending for this worker, if any (with the seconds left)."""
    raw = await r.get(_key(run, worker_id))
    if raw is None:
        return None
    left = float(raw) - await redis_now(r)
    return DrainNotice(worker_id=worker_id, notice_s=max(0.0, left)) if left > 0 else None


async def wait(r: Any, notifier: Notifier | None, run: str, worker_id: str, wait_s: float) -> DrainNotice | None:
    """The drain pending for this worker, waiting up to ``wait_s`` for one (woken by its ``drains`` topic)."""
    return await poll_until(
        notifier, run, (drain_topic(worker_id),), wait_s, lambda: pending(r, run, worker_id), lambda x: x is not None
    )
