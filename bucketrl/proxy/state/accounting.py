"""The queue's accounting for ``GET /v1/runs/{run}/status`` and the metrics: depth, pending, counters.

Invariant 4 (``state/queue.py``)::

    accepted_total == acked_total + dropped_stale_total + lost_total + XLEN(stream)
"""

from __future__ import annotations

from typing import Any

from bucketrl.proxy.state import prompts
from bucketrl.proxy.state.queue import GROUP, QueueKeys, as_str
from bucketrl.wire import QueueStatus, RunSpec

COUNTER_FIELDS = (
    "accepted_total",
    "acked_total",
    "dropped_stale_total",
    "rejected_stale_total",
    "backpressure_total",
    "lost_total",
)


async def queue_status(r: Any, run: str, spec: RunSpec) -> QueueStatus:
    """The queue part of ``GET /v1/runs/{run}/status``: depth, pending, and the invariant-4 counters.

    ``groups`` = queued, not yet claimed; ``pending`` = claimed, not yet acked.
    """
    k = QueueKeys.of(run)
    pipe = r.pipeline(transaction=True)
    pipe.exists(k.stream)
    pipe.xlen(k.stream)
    pipe.hmget(k.counters, *COUNTER_FIELDS)
    exists, length, counts = await pipe.execute()
    pending = 0
    if exists:
        pending = int((await r.xpending(k.stream, GROUP))["pending"])
    c = {f: int(v or 0) for f, v in zip(COUNTER_FIELDS, counts, strict=True)}
    return QueueStatus(
        groups=int(length) - pending,
        capacity=spec.queue_capacity_groups,
        pending=pending,
        accepted_total=c["accepted_total"],
        acked_total=c["acked_total"],
        dropped_stale_total=c["dropped_stale_total"],
        rejected_stale_total=c["rejected_stale_total"],
        backpressure_total=c["backpressure_total"],
        lost_total=c["lost_total"],
    )


async def counters(r: Any, run: str) -> dict[str, int]:
    raw = await r.hgetall(QueueKeys.of(run).counters)
    return {as_str(f): int(v) for f, v in raw.items()}


async def status_part(r: Any, run: str, spec: RunSpec) -> dict[str, Any]:
    """The rollout queue's and the prompt leases' fields of the run status (``state/status.py``)."""
    return {
        "queue": (await queue_status(r, run, spec)).model_dump(),
        "prompts_inflight": await prompts.prompts_inflight(r, run),
        "prompt_cursor": await prompts.cursor(r, run),
    }
