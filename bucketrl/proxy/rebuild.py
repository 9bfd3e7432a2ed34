"""Rebuild Redis from the bucket (being written by P2). P3 appends its hooks to REBUILD_HOOKS."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

# hook(ctx, run, spec) -> None, called for each run after P2 restored spec, versions and checkpoints.
RebuildHook = Callable[[Any, str, Any], Awaitable[None]]
REBUILD_HOOKS: list[RebuildHook] = []


async def rebuild_if_wiped(ctx: Any) -> bool:
    return False
