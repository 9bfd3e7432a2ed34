"""Where a worker's streamed downloads go (:class:`Sink`), and the bucket read behind a presigned URL.

A generator with ``BUCKETRL_PRESIGNED_ADAPTERS=1`` asks the proxy for an adapter with ``X-Bucketrl-Presign: 1``; a
proxy that presigns (an S3 bucket, ``BUCKETRL_PRESIGN_ADAPTERS_S``) checks the token and the version, then answers
307 with a URL that reads the tar from the bucket for a while. That URL is the credential: no token goes there and
the worker holds no bucket keys. The bytes are hashed on the way like the proxy's, and checked the same way.
"""

from __future__ import annotations

import hashlib
from typing import IO

import httpx

from bucketrl import errors
from bucketrl.tls import TransportSecurity


class Sink:
    """Where a streamed answer's body goes: a seekable file, hashed on the way."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.start = out, out.tell()
        self.sha = hashlib.sha256()

    def restart(self) -> None:
        self.out.seek(self.start)
        self.out.truncate()
        self.sha = hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self.out.write(chunk)
        self.sha.update(chunk)


def from_bucket(url: str, sink: Sink, timeout: httpx.Timeout) -> None:
    """The presigned URL's bytes into ``sink``. Verified against public roots (the system store and certifi's,
    not ``BUCKETRL_CA_FILE``, which names the proxy's CA); a failure is retryable (the proxy signs a new URL)."""
    sink.restart()
    try:
        with httpx.stream("GET", url, timeout=timeout, verify=TransportSecurity().verify()) as resp:
            if resp.status_code != 200:
                raise errors.Unavailable(f"the bucket answered {resp.status_code} to a presigned URL", retryable=True)
            for chunk in resp.iter_bytes(1 << 20):
                sink.write(chunk)
    except httpx.TransportError as exc:
        raise errors.Unavailable(f"bucket unreachable through a presigned URL: {exc!r}", retryable=True) from exc
