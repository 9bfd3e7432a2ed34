"""Builders for tar bodies (good and hostile) and a store wrapper that fails on cue (a crash stand-in)."""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import AsyncIterator, Callable
from typing import Any

from bucketrl import errors
from bucketrl.storage import BucketStore


def make_tar(members: dict[str, bytes], *, fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """An uncompressed tar of regular files, in the given order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_tar_with(infos: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    """A tar with hand-made headers (links, devices, hostile names)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in infos:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def chunked(data: bytes, size: int = 4096) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


class FailingStore:
    """Delegates to a real store, but raises Unavailable on the first write whose key matches ``fail_on``.

    Stands in for a proxy process dying (or the bucket going away) in the middle of a multi-object commit.
    """

    def __init__(self, inner: BucketStore, fail_on: Callable[[str], bool], method: str = "put") -> None:
        self._inner = inner
        self._fail_on = fail_on
        self._method = method
        self.url = inner.url

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _maybe_fail(self, method: str, key: str) -> None:
        if method == self._method and self._fail_on(key):
            raise errors.Unavailable(f"injected failure writing {key}")

    def put_bytes(self, key: str, data: bytes) -> None:
        self._maybe_fail("put", key)
        self._inner.put_bytes(key, data)

    def put_file(self, key: str, fileobj: Any, size: int | None = None) -> None:
        self._maybe_fail("put", key)
        self._inner.put_file(key, fileobj, size)

    def delete_prefix(self, prefix: str) -> int:
        self._maybe_fail("delete_prefix", prefix)
        return self._inner.delete_prefix(prefix)
