"""Versioned directory objects in the bucket: adapters and checkpoints, made visible by a manifest.

A directory ``{prefix}`` (e.g. ``runs/demo/adapters/v3``) holds

    {prefix}/bundle.tar        the exact tar body the trainer uploaded (so a GET returns the same sha256)
    {prefix}/files/<name>      each tar member, extracted (PeftModel.from_pretrained loads files/ directly)
    {prefix}/manifest.json     size + sha256 of the bundle and of every file, created_at, meta: WRITTEN LAST

The manifest is the commit point: a directory without one does not exist for readers
(:func:`read_manifest` returns None, :func:`list_dirs` skips it). A crash mid-commit leaves invisible
garbage that the next commit of the same prefix clears. :func:`delete_dir` removes the manifest FIRST,
so a reader stops seeing the directory before any of its files go.

The upload path, as the proxy uses it::

    spooled = await spool_body(request.stream(), max_bytes=settings.max_adapter_bytes)  # 413 early
    try:
        manifest = await run_in_threadpool(commit_tar, store, prefix, spooled, header_sha256, {"version": 3})
    finally:
        spooled.close()

The body goes to a temp file (in memory up to 1 MiB, on disk beyond), hashed on the way in: it is
never held whole in memory, let alone twice. Nothing is written to the bucket unless the sha256
matches and the tar is a safe, uncompressed archive of regular files.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, TypeVar

from pydantic import BaseModel, Field, ValidationError
from pydantic_core import PydanticSerializationError

from bucketrl import errors
from bucketrl.storage.base import BucketStore
from bucketrl.storage.paths import normalize_prefix, validate_key

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
BUNDLE = "bundle.tar"
FILES = "files"
MAX_MEMBERS = 10_000  # an adapter has a handful of files, a checkpoint a few dozen
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HASH_CHUNK = 1 << 20
M = TypeVar("M", bound=BaseModel)


class FileEntry(BaseModel):
    size: int = Field(..., ge=0)
    sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    """``{prefix}/manifest.json``: what a committed directory holds. Written last."""

    format: int = 1
    files: dict[str, FileEntry]
    bundle: FileEntry
    created_at: float
    meta: dict[str, Any] = Field(default_factory=dict)


# -- spooling an HTTP body --------------------------------------------------------------------------
@dataclass
class Spooled:
    """A request body on a temp file, with its sha256 and size. Close it when done (or use ``with``)."""

    file: IO[bytes]
    sha256: str
    size: int

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> Spooled:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def spool_body(
    chunks: AsyncIterator[bytes], max_bytes: int, *, memory_bytes: int = 1 << 20, spool_dir: str | None = None
) -> Spooled:
    """Stream ``chunks`` to a temp file, hashing as it goes; PayloadTooLarge as soon as ``max_bytes`` is passed.

    The file stays in memory up to ``memory_bytes`` and moves to ``spool_dir`` (default: the system temp dir)
    beyond. Writes are synchronous: a chunk is at most a socket read, and a thread hop per chunk costs more.
    """
    fh = tempfile.SpooledTemporaryFile(max_size=memory_bytes, dir=spool_dir)  # noqa: SIM115 (returned open)
    digest = hashlib.sha256()
    size = 0
    try:
        async for chunk in chunks:
            size += len(chunk)
            if size > max_bytes:
                raise errors.PayloadTooLarge(f"body is larger than the limit of {max_bytes} bytes")
            digest.update(chunk)
            fh.write(chunk)
    except BaseException:
        fh.close()
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()  # stop an async generator producer instead of leaving it suspended
        raise
    fh.seek(0)
    return Spooled(file=fh, sha256=digest.hexdigest(), size=size)


# -- committing a tar -------------------------------------------------------------------------------
def commit_tar(
    store: BucketStore,
    prefix: str,
    spooled: Spooled,
    expected_sha256: str,
    meta: dict[str, Any],
    timings: dict[str, float] | None = None,
) -> Manifest:
    """Verify and commit ``spooled`` (an uncompressed tar) as the directory ``prefix``; returns its manifest.

    Invalid (nothing written) when the sha256 differs (code ``sha256_mismatch``) or the tar is not a safe
    archive of regular files. Committing the same bytes again returns the existing manifest (a retried PUT
    is a no-op); different bytes on a committed prefix -> Conflict (a committed directory never changes).
    ``timings`` gets where the time went: ``scan_s`` (members validated and hashed), ``writes_s`` (the bundle and
    the members into the bucket), ``manifest_s``.
    """
    t0 = time.perf_counter()
    norm = _dir_prefix(prefix)
    expected = (expected_sha256 or "").strip().lower()
    if not _SHA256.match(expected):
        raise errors.Invalid(f"X-Content-SHA256 must be 64 hex digits, got {expected_sha256!r}")
    if spooled.sha256 != expected:
        raise errors.Invalid(
            f"body sha256 {spooled.sha256} does not match X-Content-SHA256 {expected}; nothing was written",
            code="sha256_mismatch",
        )
    existing = read_manifest(store, norm)
    if existing is not None:
        if existing.bundle.sha256 == spooled.sha256:
            return existing
        raise errors.Conflict(f"{norm.rstrip('/')} is already committed with different content")

    files = _scan_tar(spooled.file)
    t_scan = time.perf_counter()
    manifest = Manifest(
        files=files, bundle=FileEntry(size=spooled.size, sha256=spooled.sha256), created_at=time.time(), meta=meta
    )
    try:
        manifest_bytes = manifest.model_dump_json().encode()  # fail on un-JSON-able meta before writing anything
    except PydanticSerializationError as exc:
        raise errors.Invalid(f"manifest meta is not JSON-serializable: {exc}") from exc
    # A crashed earlier attempt may have left files here (invisible, no manifest): start clean so
    # files/ holds exactly this tar's members.
    store.delete_prefix(norm)

    # The bundle and the members are the same bytes written twice: at the same time when the body is on disk
    # (a second, positional reader of the one file), so the publish waits for the slower write, not their sum.
    bundle = _PositionalReader.of(spooled) if spooled.size >= PARALLEL_WRITE_BYTES else None
    pool = ThreadPoolExecutor(1, thread_name_prefix="bucketrl-bundle") if bundle is not None else None
    try:
        if pool is not None and bundle is not None:
            writing = pool.submit(store.put_file, norm + BUNDLE, bundle, spooled.size)
        else:
            spooled.file.seek(0)
            store.put_file(norm + BUNDLE, spooled.file, spooled.size)
        spooled.file.seek(0)
        with tarfile.open(fileobj=spooled.file, mode="r:") as tar:
            for info in tar:
                name = _member_name(info)
                if name is None:
                    continue
                src = tar.extractfile(info)
                assert src is not None  # _scan_tar admitted regular files only
                store.put_file(norm + f"{FILES}/{name}", src, info.size)
        if pool is not None:
            writing.result()  # its error, if any, is this commit's: no manifest
    finally:
        if pool is not None:
            pool.shutdown(wait=True)

    t_written = time.perf_counter()
    store.put_bytes(norm + MANIFEST, manifest_bytes)  # the commit point
    if timings is not None:
        timings.update(scan_s=t_scan - t0, writes_s=t_written - t_scan, manifest_s=time.perf_counter() - t_written)
    return manifest


# Bodies at least this large (on disk: SpooledTemporaryFile rolled over) write the bundle and the members at once.
PARALLEL_WRITE_BYTES = 4 << 20


class _PositionalReader(io.RawIOBase):
    """A read-only view of an open file that reads with ``os.pread``: it never moves the file's own offset, so
    another thread can read the same file through it while this one reads the file itself."""

    def __init__(self, fd: int, size: int) -> None:
        super().__init__()
        self._fd, self._size, self._pos = fd, size, 0

    @classmethod
    def of(cls, spooled: Spooled) -> io.BufferedReader | None:
        try:
            fd = spooled.file.fileno()  # rolls an in-memory spool over to disk; a spool that big already is
        except (AttributeError, OSError, io.UnsupportedOperation):
            return None
        spooled.file.flush()
        return io.BufferedReader(cls(fd, spooled.size), _HASH_CHUNK)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), max(0, self._size - self._pos))
        data = os.pread(self._fd, n, self._pos) if n else b""
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _dir_prefix(prefix: str) -> str:
    norm = normalize_prefix(prefix)
    if not norm:
        raise errors.Invalid("a directory prefix must not be the bucket root")
    return norm


def _member_name(info: tarfile.TarInfo) -> str | None:
    """The member's key under files/, None for directory entries; Invalid for anything unsafe."""
    name = info.name
    while name.startswith("./"):
        name = name[2:]
    if info.isdir():
        if name not in ("", ".", "./"):
            _validate_member(name.rstrip("/"), info.name)
        return None
    if not info.isreg() or info.issparse():
        raise errors.Invalid(f"tar member {info.name!r} is not a regular file (links, devices, sparse files refused)")
    _validate_member(name, info.name)
    return name


def _validate_member(name: str, raw: str) -> None:
    try:
        validate_key(name)
    except errors.Invalid as exc:
        raise errors.Invalid(f"unsafe tar member name {raw!r}: {exc.message}") from exc


def _scan_tar(fileobj: IO[bytes]) -> dict[str, FileEntry]:
    """Read the whole tar once: validate every member and hash its data (catches truncation too)."""
    files: dict[str, FileEntry] = {}
    fileobj.seek(0)
    try:
        with tarfile.open(fileobj=fileobj, mode="r:") as tar:
            for info in tar:
                name = _member_name(info)
                if name is None:
                    continue
                if name in files:
                    raise errors.Invalid(f"tar member {name!r} appears twice")
                if len(files) >= MAX_MEMBERS:
                    raise errors.Invalid(f"tar has more than {MAX_MEMBERS} files")
                src = tar.extractfile(info)
                assert src is not None
                digest, size = hashlib.sha256(), 0
                while block := src.read(_HASH_CHUNK):
                    digest.update(block)
                    size += len(block)
                if size != info.size:
                    raise errors.Invalid(f"tar member {name!r} is truncated ({size} of {info.size} bytes)")
                files[name] = FileEntry(size=size, sha256=digest.hexdigest())
    except (tarfile.TarError, EOFError) as exc:
        raise errors.Invalid(f"body is not an uncompressed tar archive: {exc}") from exc
    if not files:
        raise errors.Invalid("tar archive holds no files")
    parents = {name.rsplit("/", i)[0] for name in files for i in range(1, name.count("/") + 1)}
    if clash := sorted(parents & files.keys()):
        raise errors.Invalid(f"tar member {clash[0]!r} is both a file and a directory")
    return files


# -- reading, listing, deleting ---------------------------------------------------------------------
def read_manifest(store: BucketStore, prefix: str) -> Manifest | None:
    """The committed manifest of ``prefix``, or None if the directory is absent or not committed."""
    key = _dir_prefix(prefix) + MANIFEST
    try:
        raw = store.get_bytes(key)
    except errors.NotFound:
        return None
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as exc:
        # Atomic writes make this impossible short of tampering; treat it as uncommitted rather than crash
        # a rebuild that walks every directory.
        log.warning("ignoring unreadable manifest %s: %s", key, exc)
        return None


def iter_bundle(store: BucketStore, prefix: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
    """Stream ``{prefix}/bundle.tar``; NotFound (raised by this call) unless the directory is committed."""
    norm = _dir_prefix(prefix)
    if read_manifest(store, norm) is None:
        raise errors.NotFound(f"no committed directory {norm.rstrip('/')}")
    return store.iter_chunks(norm + BUNDLE, chunk_size)


def presigned_bundle(store: BucketStore, prefix: str, expires_s: int) -> str | None:
    """A credential-free URL of ``{prefix}/bundle.tar`` valid ``expires_s``; None when the store cannot sign
    one (a file bucket). The caller has checked the directory is committed (a live version's record)."""
    presign = getattr(store, "presign_get", None)
    return None if presign is None else str(presign(_dir_prefix(prefix) + BUNDLE, expires_s))


def delete_dir(store: BucketStore, prefix: str) -> int:
    """Delete a directory: manifest first (readers stop seeing it), then the rest. Returns objects deleted after."""
    norm = _dir_prefix(prefix)
    store.delete([norm + MANIFEST])
    return store.delete_prefix(norm)


def list_dirs(store: BucketStore, parent_prefix: str) -> list[str]:
    """Names of the committed child directories of ``parent_prefix``, in natural order (v2 before v10)."""
    parent = normalize_prefix(parent_prefix)
    names = []
    suffix = "/" + MANIFEST
    for key in store.list_keys(parent):
        rest = key[len(parent) :]
        if rest.endswith(suffix) and rest.count("/") == 1:
            names.append(rest[: -len(suffix)])
    return sorted(names, key=_natural)


def _natural(name: str) -> list[Any]:
    # re.split with a capture group alternates text/digits, so positions always compare like with like.
    return [int(tok) if i % 2 else tok for i, tok in enumerate(re.split(r"(\d+)", name))]


# -- small JSON objects -----------------------------------------------------------------------------
def put_json(store: BucketStore, key: str, obj: BaseModel | dict[str, Any] | list[Any]) -> None:
    """Write a pydantic model or a JSON-able dict/list as one atomic object."""
    if isinstance(obj, BaseModel):
        data = obj.model_dump_json().encode()
    else:
        data = json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
    store.put_bytes(validate_key(key), data)


def get_json(store: BucketStore, key: str, model: type[M] | None = None) -> Any:
    """Read a JSON object (validated into ``model`` when given). NotFound if absent, Invalid if unreadable."""
    raw = store.get_bytes(key)
    try:
        return model.model_validate_json(raw) if model is not None else json.loads(raw)
    except (ValueError, ValidationError) as exc:
        raise errors.Invalid(f"bucket object {key!r} is not valid JSON for {model or 'json'}: {exc}") from exc


__all__ = [
    "BUNDLE",
    "FILES",
    "MANIFEST",
    "FileEntry",
    "Manifest",
    "Spooled",
    "commit_tar",
    "delete_dir",
    "get_json",
    "iter_bundle",
    "list_dirs",
    "put_json",
    "read_manifest",
    "spool_body",
]
