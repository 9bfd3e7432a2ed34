"""Tar uploads (adapters, checkpoints): spool the body to disk and check it against its declared sha256."""

from __future__ import annotations

from collections.abc import AsyncIterator

from bucketrl import errors
from bucketrl.storage import dirs


async def spool_verified(chunks: AsyncIterator[bytes], max_bytes: int, expected_sha256: str) -> dirs.Spooled:
    """The spooled body (the caller closes it); ``Invalid``, nothing written, if its sha256 is not the declared one."""
    spooled = await dirs.spool_body(chunks, max_bytes)
    if spooled.sha256 != expected_sha256:
        spooled.close()
        raise errors.Invalid(
            f"body sha256 {spooled.sha256} does not match X-Content-SHA256 {expected_sha256}; nothing was written",
            code="sha256_mismatch",
        )
    return spooled
