"""The one clock of every lease and TTL: Redis ``TIME`` (proxy replicas' own clocks may disagree)."""

from __future__ import annotations

from typing import Any


async def redis_now(r: Any) -> float:
    """Redis ``TIME`` in seconds (Lua scripts read ``redis.call('TIME')`` themselves)."""
    sec, usec = await r.time()
    return float(sec) + float(usec) / 1e6
