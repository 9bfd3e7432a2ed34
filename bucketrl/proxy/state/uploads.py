"""Tar uploads (adapters, checkpoints): spool the body to disk and check it against its declared sha256 and
what it must hold (``bucketrl.bundles``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import IO

from bucketrl import errors
from bucketrl.storage import dirs


async def spool_verified(
    chunks: AsyncIterator[bytes],
    max_bytes: int,
    expected_sha256: str,
    check: Callable[[IO[bytes]], None] | None = None,
) -> dirs.Spooled:
    """The spooled body (the caller closes it); ``Invalid``, nothing written, if its sha256 is not the declared one
    or ``check`` (run in a worker thread: it reads the tar) refuses its contents."""
    spooled = await dirs.spool_body(chunks, max_bytes)
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
    return spooled
