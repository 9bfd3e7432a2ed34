"""Warn when Redis would come back from a crash with an OLDER state instead of its last one or none at all.

The proxy survives a Redis that loses everything: it finds the runs gone and rebuilds them from the bucket
(``rebuild.py``). What it cannot see is a Redis that restarts with part of its recent past missing: an
append-only file written with ``appendfsync everysec`` loses up to its last second of acknowledged writes, and
RDB snapshots alone (``save`` rules, no AOF) lose everything since the last snapshot. The restarted Redis then
holds a consistent but older state (a submit answered 202 whose group is not queued, an ack undone, a published
version unknown), and nothing marks it as a wipe. Exactly-once needs ``appendonly yes`` with ``appendfsync
always`` (what ``bucketrl up``, compose and the chart run), or no persistence at all (then a restart is a wipe).

Managed Redis services often refuse ``CONFIG GET``: then the proxy says nothing (it cannot know).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("bucketrl.proxy")


def rollback_risk(config: dict[str, str]) -> str | None:
    """What a crash of a Redis with this configuration could roll back, or None when it cannot."""
    aof = config.get("appendonly", "no") == "yes"
    if aof:
        fsync = config.get("appendfsync", "everysec")
        if fsync != "always":
            return (
                f"Redis runs with appendfsync {fsync}: a crash of Redis can lose its last acknowledged writes "
                "(accepted groups, acks, published versions) without the proxy noticing; run it with "
                "--appendfsync always (or without persistence, so that a restart is a wipe the proxy rebuilds from)"
            )
        return None
    if config.get("save", "").strip():
        return (
            f"Redis persists by RDB snapshots only (save {config['save']!r}): a crash of Redis restarts it from "
            "its last snapshot, an older state the proxy cannot tell from the current one; run it with "
            '--appendonly yes --appendfsync always (or --save "" so that a restart is a wipe the proxy rebuilds from)'
        )
    return None


async def warn_if_rollback_possible(r: Any) -> str | None:
    """Log :func:`rollback_risk` of the connected Redis once (at start); returns the warning, if any."""
    config: dict[str, str] = {}
    try:
        for name in ("appendonly", "appendfsync", "save"):
            got = await r.config_get(name)
            config.update({_s(k): _s(v) for k, v in got.items()})
    except Exception as exc:  # CONFIG refused (managed Redis, ACLs) or Redis away: nothing to say
        log.debug("cannot read the Redis persistence settings: %s", exc)
        return None
    risk = rollback_risk(config)
    if risk:
        log.warning("%s", risk)
    return risk


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
