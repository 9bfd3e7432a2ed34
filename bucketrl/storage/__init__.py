"""Bucket storage: one interface (:class:`BucketStore`), two backends, one factory.

    from bucketrl.storage import open_store
    store = open_store("file:///var/lib/bucketrl")           # a local directory
    store = open_store("s3://my-bucket/bucketrl")             # AWS, or BUCKETRL_S3_ENDPOINT_URL (MinIO...)
    store.put_bytes("runs/demo/run.json", b"{}")

Versioned directories (adapters, checkpoints: files + a manifest written last) are in
:mod:`bucketrl.storage.dirs`; key rules in :mod:`bucketrl.storage.paths`.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

from bucketrl import errors
from bucketrl.storage.base import BucketStore
from bucketrl.storage.file import FileStore
from bucketrl.storage.paths import normalize_prefix

__all__ = ["BucketStore", "open_store"]

# S3's bucket naming rules (3-63 chars, lowercase letters, digits, dots, hyphens); "_" for legacy/compatible stores.
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
_EXAMPLES = "file:///absolute/dir or s3://bucket/optional/prefix"


def open_store(
    url: str,
    *,
    s3_endpoint_url: str | None = None,
    s3_addressing_style: str | None = None,
    s3_region: str | None = None,
) -> BucketStore:
    """The store for ``url`` (the value of BUCKETRL_BUCKET_URL). Raises :class:`errors.Invalid` on a bad URL.

    For ``s3://`` URLs, ``s3_endpoint_url``, ``s3_addressing_style`` and ``s3_region`` override
    BUCKETRL_S3_ENDPOINT_URL, BUCKETRL_S3_ADDRESSING_STYLE and BUCKETRL_S3_REGION.
    """
    if not isinstance(url, str) or not url.strip():
        raise errors.Invalid(f"BUCKETRL_BUCKET_URL is empty; expected {_EXAMPLES}")
    parts = urlsplit(url.strip())
    if parts.query or parts.fragment:
        raise errors.Invalid(f"BUCKETRL_BUCKET_URL {url!r} must not have a query or fragment; expected {_EXAMPLES}")
    if parts.scheme == "file":
        return _open_file(url, parts.netloc, unquote(parts.path))
    if parts.scheme == "s3":
        return _open_s3(url, parts.netloc, parts.path, s3_endpoint_url, s3_addressing_style, s3_region)
    hint = f" (did you mean file://{url}?)" if url.startswith("/") else ""
    raise errors.Invalid(
        f"BUCKETRL_BUCKET_URL {url!r} has an unsupported scheme {parts.scheme!r}{hint}; expected {_EXAMPLES}"
    )


def _open_file(url: str, host: str, path: str) -> BucketStore:

    if host not in ("", "localhost"):
        raise errors.Invalid(
            f"BUCKETRL_BUCKET_URL {url!r} is not an absolute file URL (it names host {host!r}); "
            f"use three slashes for an absolute path, e.g. file:///{host}{path}"
        )
    if not path.startswith("/") or path == "/":
        raise errors.Invalid(f"BUCKETRL_BUCKET_URL {url!r} must name an absolute directory other than /")
    if "\x00" in path or any(seg == ".." for seg in path.split("/")):
        raise errors.Invalid(f"BUCKETRL_BUCKET_URL {url!r} must not contain '..' or NUL")
    return FileStore(path.rstrip("/"))


def _open_s3(
    url: str, bucket: str, path: str, endpoint_url: str | None, addressing_style: str | None, region: str | None
) -> BucketStore:
    if "@" in bucket or ":" in bucket:
        raise errors.Invalid(
            f"BUCKETRL_BUCKET_URL {url!r}: put credentials in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
            "and the endpoint in BUCKETRL_S3_ENDPOINT_URL, not in the URL"
        )
    if not _S3_BUCKET.match(bucket):
        raise errors.Invalid(f"BUCKETRL_BUCKET_URL {url!r}: {bucket!r} is not a valid S3 bucket name")
    prefix = path[1:] if path.startswith("/") else path
    try:
        normalize_prefix(prefix)
    except errors.Invalid as exc:
        raise errors.Invalid(f"BUCKETRL_BUCKET_URL {url!r} has an invalid prefix: {exc.message}") from exc
    from bucketrl.storage.s3 import S3Store

    return S3Store(bucket, prefix, endpoint_url=endpoint_url, addressing_style=addressing_style, region=region)
