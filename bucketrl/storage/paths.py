"""Bucket keys and prefixes: validation and joining, shared by every backend.

A key is a ``/``-separated relative path such as ``runs/demo/adapters/v3/manifest.json``. It may not
start with ``/``, contain a backslash, an empty segment (``a//b``, a trailing ``/``), a ``.`` or ``..``
segment, a control character, or a segment starting with :data:`TEMP_MARKER` (reserved for the
``file://`` backend's in-flight temp files). So no key, whatever a client sends, can escape the store's
root or its ``s3://bucket/prefix``.

A prefix names a directory: ``runs/demo/adapters`` and ``runs/demo/adapters/`` mean the same thing and
cover ``runs/demo/adapters/v1/...`` but NOT ``runs/demo/adapters-old/...``. ``""`` is the whole store.
"""

from __future__ import annotations

from bucketrl import errors

TEMP_MARKER = ".bucketrl-tmp-"
MAX_KEY_BYTES = 1024  # the S3 limit; applied everywhere so both backends accept the same keys


def validate_key(key: str) -> str:
    """Return ``key`` unchanged, or raise :class:`errors.Invalid` saying what is wrong with it."""
    if not isinstance(key, str) or not key:
        raise errors.Invalid(f"bucket key must be a non-empty string, got {key!r}")
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise errors.Invalid(f"bucket key longer than {MAX_KEY_BYTES} bytes: {key[:80]!r}...")
    if key.startswith("/"):
        raise errors.Invalid(f"bucket key {key!r} must be relative (no leading '/')")
    if "\\" in key:
        raise errors.Invalid(f"bucket key {key!r} contains a backslash")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        raise errors.Invalid(f"bucket key {key!r} contains a control character")
    for segment in key.split("/"):
        if segment == "":
            raise errors.Invalid(f"bucket key {key!r} has an empty path segment")
        if segment in (".", ".."):
            raise errors.Invalid(f"bucket key {key!r} contains a {segment!r} segment")
        if segment.startswith(TEMP_MARKER):
            raise errors.Invalid(f"bucket key {key!r} uses the reserved segment prefix {TEMP_MARKER!r}")
    return key


def normalize_prefix(prefix: str) -> str:
    """``""`` for the whole store, else the validated directory prefix WITH a trailing ``/``."""
    if prefix in ("", "/"):
        return ""
    stripped = prefix[:-1] if prefix.endswith("/") else prefix
    return validate_key(stripped) + "/"


def join_key(*parts: str) -> str:
    """Join key fragments with ``/`` (a fragment may end with ``/``; empty ones are skipped) and validate."""
    return validate_key("/".join(p[:-1] if p.endswith("/") else p for p in parts if p))
