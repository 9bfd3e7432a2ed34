"""Tar uploads (adapters, checkpoints): spool the body to disk and check it against its declared sha256 and
what it must hold (``bucketrl.bundles``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import IO

from bucketrl import errors
from bucketrl.storage import dirs


async def spool_verified(
    chunks: AsyncIterator[bytes],
    max_bytes: int,
    expected_sha256: str,
    check: Callable[[IO[bytes]], None] | None = None,
    timings: dict[str, float] | None = None,
) -> dirs.Spooled:
    """The spooled body (the caller closes it); ``Invalid``, nothing written, if its sha256 is not the declared one
    or ``check`` (run in a worker thread: it reads the tar) refuses its contents. ``timings`` gets ``body_s`` (the
    upload, hashed and spooled as it arrives) and ``check_s``."""
    t0 = time.perf_counter()
    spooled = await dirs.spool_body(chunks, max_bytes)
    t1 = time.perf_counter()
    try:
        if spooled.sha256 != expected_sha256:
            raise errors.Invalid(
                f"body sha256 {spooled.sha256} does not match X-Content-SHA256 {expected_sha256}; nothing was written",
                code="sha256_mismatch",
            )
        if check is not None:
            await asyncio.to_thread(check, spooled.file)
    except BaseException:
        spooled.close()
        raise
    if timings is not None:
        timings.update(body_s=t1 - t0, check_s=time.perf_counter() - t1)
    return spooled
