"""The bucket-store protocol every backend implements (``file://``, ``s3://``).

Keys are ``/``-separated relative paths (``runs/demo/adapters/v3/adapter_model.safetensors``); a key
never starts with ``/`` and never contains ``..``. Every write is atomic from a reader's point of view:
an object is visible whole or not at all. Backends raise :class:`bucketrl.errors.NotFound` for a
missing key and :class:`bucketrl.errors.Unavailable` when the store cannot be reached; no botocore or
OSError escapes a backend.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from typing import IO, Protocol, runtime_checkable


@runtime_checkable
class BucketStore(Protocol):
    url: str

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write one object atomically (temp + rename / single PUT)."""

    def put_file(self, key: str, fileobj: IO[bytes], size: int | None = None) -> None:
        """Stream a file-like object into one object atomically (multipart on S3 for large ones)."""

    def get_bytes(self, key: str) -> bytes:
        """The whole object. NotFound if absent."""

    def iter_chunks(self, key: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        """Stream an object in chunks. NotFound if absent (raised before the first chunk)."""

    def exists(self, key: str) -> bool: ...

    def list_keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (recursive), sorted."""

    def delete(self, keys: Iterable[str]) -> None:
        """Delete keys; absent keys are ignored."""

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""

    def check(self) -> None:
        """Raise Unavailable unless the store is reachable and writable (readiness probe)."""


AsyncChunks = AsyncIterator[bytes]
