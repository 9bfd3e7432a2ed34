"""``file:///abs/dir``: a local directory as a bucket (the embedded default, and a shared volume).

Each write goes to a temp file in the key's own directory (same filesystem, so the rename is atomic),
is fsynced, then ``os.replace``d over the key and the directory is fsynced: a reader sees the old
object or the new one, whole, never a prefix of either, and a crash never leaves a torn object under
a real key. Temp files carry the reserved segment prefix ``.bucketrl-tmp-`` and are invisible to
``list_keys``/``exists``; a crash may leave one behind (harmless, and ``delete_prefix`` removes it).

Every OSError is translated here: a missing key -> :class:`errors.NotFound`, anything else ->
:class:`errors.Unavailable` naming the path, so nothing from ``os`` escapes this module.

    >>> store = FileStore("/tmp/bucket")
    >>> store.put_bytes("runs/demo/run.json", b"{}")
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from bucketrl import errors
from bucketrl.storage.paths import TEMP_MARKER, normalize_prefix, validate_key

_COPY_CHUNK = 1 << 20
_MKDIR_RETRIES = 5  # a concurrent delete may prune the directory between our mkdir and our mkstemp


class FileStore:
    """A bucket rooted at an absolute local directory."""

    def __init__(self, root: str | Path) -> None:
        path = Path(root)
        if not path.is_absolute():
            raise errors.Invalid(f"file store root must be an absolute path, got {str(root)!r}")
        self.root = path
        self.url = f"file://{path}"

    # -- paths ---------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def _unavailable(self, what: str, exc: OSError) -> errors.Unavailable:
        return errors.Unavailable(f"bucket {self.url}: cannot {what}: {exc.strerror or exc}")

    # -- writes --------------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes) -> None:
        self._atomic_write(key, lambda fh: fh.write(data))

    def put_file(self, key: str, fileobj: BinaryIO, size: int | None = None) -> None:
        self._atomic_write(key, lambda fh: shutil.copyfileobj(fileobj, fh, _COPY_CHUNK))

    def _atomic_write(self, key: str, write: Callable[[BinaryIO], object]) -> None:
        target = self._path(key)
        fd, tmp = self._mkstemp(target)
        try:
            with os.fdopen(fd, "wb") as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, OSError):
                raise self._unavailable(f"write {key!r}", exc) from exc
            raise
        self._fsync_dir(target.parent)

    def _mkstemp(self, target: Path) -> tuple[int, str]:
        for attempt in range(_MKDIR_RETRIES):
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                return tempfile.mkstemp(dir=target.parent, prefix=f"{TEMP_MARKER}{target.name}.")
            except (FileNotFoundError, FileExistsError) as exc:
                # A concurrent delete pruned the directory: after our mkdir (mkstemp: FileNotFoundError), or
                # between mkdir's "it exists" and its "is it a directory?" (FileExistsError). Create it again;
                # a file squatting on the directory's path fails every attempt.
                if attempt == _MKDIR_RETRIES - 1:
                    raise self._unavailable(f"create {target.parent}", exc) from exc
            except OSError as exc:
                raise self._unavailable(f"create {target.parent}", exc) from exc
        raise AssertionError("unreachable")

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        # Makes the rename itself durable; not supported everywhere (some network filesystems), so best effort.
        with contextlib.suppress(OSError):
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # -- reads ---------------------------------------------------------------------------------
    def _open(self, key: str) -> BinaryIO:
        path = self._path(key)
        try:
            return path.open("rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise errors.NotFound(f"no object {key!r} in {self.url}") from exc
        except OSError as exc:
            raise self._unavailable(f"read {key!r}", exc) from exc

    def get_bytes(self, key: str) -> bytes:
        with self._open(key) as fh:
            try:
                return fh.read()
            except OSError as exc:
                raise self._unavailable(f"read {key!r}", exc) from exc

    def iter_chunks(self, key: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        fh = self._open(key)  # opened now, so NotFound is raised by this call, not by the first next()
        return self._chunks(fh, key, chunk_size)

    def _chunks(self, fh: BinaryIO, key: str, chunk_size: int) -> Iterator[bytes]:
        with fh:
            while True:
                try:
                    chunk = fh.read(chunk_size)
                except OSError as exc:
                    raise self._unavailable(f"read {key!r}", exc) from exc
                if not chunk:
                    return
                yield chunk

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list_keys(self, prefix: str) -> list[str]:
        norm = normalize_prefix(prefix)
        base = self.root / norm if norm else self.root
        keys: list[str] = []
        try:
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = [d for d in dirnames if not d.startswith(TEMP_MARKER)]
                rel = Path(dirpath).relative_to(self.root).as_posix()
                for name in filenames:
                    if not name.startswith(TEMP_MARKER):
                        keys.append(name if rel == "." else f"{rel}/{name}")
        except OSError as exc:
            raise self._unavailable(f"list {norm!r}", exc) from exc
        return sorted(keys)

    # -- deletes -------------------------------------------------------------------------------
    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            path = self._path(key)
            try:
                path.unlink()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                continue
            except OSError as exc:
                raise self._unavailable(f"delete {key!r}", exc) from exc
            self._prune_empty_dirs(path.parent)

    def delete_prefix(self, prefix: str) -> int:
        norm = normalize_prefix(prefix)
        keys = self.list_keys(norm)
        self.delete(keys)
        if norm:
            # Also sweeps temp files that a crashed writer left behind under the prefix.
            base = self.root / norm
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(base)
            self._prune_empty_dirs(base.parent)
        return len(keys)

    def _prune_empty_dirs(self, directory: Path) -> None:
        # rmdir only succeeds on an empty directory, so a concurrent writer's fresh file is never lost;
        # the writer's mkstemp retries if we pruned its directory between its mkdir and its mkstemp.
        while directory != self.root and self.root in directory.parents:
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent

    # -- readiness -----------------------------------------------------------------------------
    def check(self) -> None:
        probe = f".bucketrl-check/{uuid.uuid4().hex}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._unavailable("create the bucket directory (check BUCKETRL_BUCKET_URL)", exc) from exc
        self.put_bytes(probe, b"ok")
        self.delete([probe])
