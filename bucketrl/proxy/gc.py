"""Maintenance loop (being written by P2)."""

from __future__ import annotations

import asyncio
from typing import Any


async def maintenance_loop(ctx: Any) -> None:
    while True:
        await asyncio.sleep(ctx.settings.gc_interval_s)
