"""``file:///abs/dir``: a local directory as a bucket (the embedded default, and a shared volume).

Each write goes to a temp file in the key's own directory (same filesystem, so the rename is atomic),
is fsynced, then ``os.replace``d over the key and the directory is fsynced: a reader sees the old
object or the new one, whole, never a prefix of either, and a crash never leaves a torn object under
a real key. Temp files carry the reserved segment prefix ``.bucketrl-tmp-`` and are invisible to
``list_keys``/``exists``; a crash may leave one behind (harmless, and ``delete_prefix`` removes it).

Every OSError is translated here: a missing key -> :class:`errors.NotFound`, anything else ->
:class:`errors.Unavailable` naming the path, so nothing from ``os`` escapes this module.

The root directory is the bucket itself: it is created once, when the store is opened, and never again.
While it is missing (a volume unmounted, the directory renamed away) or unusable, every operation raises
:class:`errors.Unavailable`: a key under a missing root is not "gone", the whole bucket is unreachable, and
a write must not quietly start an empty bucket in its place (the proxy's bucket identity check,
``proxy/identity.py``, refuses to serve one it did not expect).

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
from typing import IO, BinaryIO

from bucketrl import errors
from bucketrl.storage.paths import TEMP_MARKER, normalize_prefix, validate_key

_COPY_CHUNK = 1 << 20
_MKDIR_RETRIES = 5  # a concurrent delete may prune the directory between our mkdir and our mkstemp


class FileStore:
    """A bucket rooted at an absolute local directory."""

    def __init__(self, root: str | Path, *, create: bool = True) -> None:
        path = Path(root)
        if not path.is_absolute():
            raise errors.Invalid(f"file store root must be an absolute path, got {str(root)!r}")
        self.root = path
        self.url = f"file://{path}"
        if create:
            # Opening the store is "first use": later operations never recreate a missing root (see above).
            with contextlib.suppress(OSError):
                path.mkdir(parents=True, exist_ok=True)

    # -- paths ---------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def _unavailable(self, what: str, exc: OSError) -> errors.Unavailable:
        return errors.Unavailable(f"bucket {self.url}: cannot {what}: {exc.strerror or exc}")

    def _root_error(self) -> errors.Unavailable | None:
        """Unavailable when the root is not a usable directory (missing, a file, unreadable), else None."""
        try:
            ok = os.path.isdir(self.root) and os.access(self.root, os.R_OK | os.X_OK)
        except OSError:  # pragma: no cover - isdir/access do not raise on Linux
            ok = False
        if ok:
            return None
        return errors.Unavailable(
            f"bucket {self.url} is unavailable: its root directory is missing or unusable "
            "(a volume not mounted? check BUCKETRL_BUCKET_URL)"
        )

    def _not_found(self, key: str, exc: OSError) -> errors.BucketRLError:
        """A key that is absent: NotFound, unless the whole bucket is gone (then Unavailable)."""
        return self._root_error() or errors.NotFound(f"no object {key!r} in {self.url}")

    def _require_root(self) -> None:
        err = self._root_error()
        if err is not None:
            raise err

    # -- writes --------------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes) -> None:
        self._atomic_write(key, lambda fh: fh.write(data))

    def put_file(self, key: str, fileobj: IO[bytes], size: int | None = None) -> None:
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
                self._makedirs(target.parent)
                return tempfile.mkstemp(dir=target.parent, prefix=f"{TEMP_MARKER}{target.name}.")
            except (FileNotFoundError, FileExistsError) as exc:
                # A concurrent delete pruned the directory: after our mkdir (mkstemp: FileNotFoundError), or
                # between mkdir's "it exists" and its "is it a directory?" (FileExistsError). Create it again;
                # a file squatting on the directory's path fails every attempt. A missing root fails at once.
                self._require_root()
                if attempt == _MKDIR_RETRIES - 1:
                    raise self._unavailable(f"create {target.parent}", exc) from exc
            except OSError as exc:
                raise self._unavailable(f"create {target.parent}", exc) from exc
        raise AssertionError("unreachable")

    def _makedirs(self, directory: Path) -> None:
        """Create ``directory`` and its parents BELOW the root; FileNotFoundError if the root itself is gone
        (``mkdir(parents=True)`` would silently create a new, empty bucket in its place)."""
        missing: list[Path] = []
        while directory != self.root and not directory.is_dir():
            missing.append(directory)
            directory = directory.parent
        for d in reversed(missing):
            with contextlib.suppress(FileExistsError):
                d.mkdir()

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
            raise self._not_found(key, exc) from exc
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
        if self._path(key).is_file():
            return True
        self._require_root()  # "no" must mean the key is absent, not that the bucket is unreachable
        return False

    def list_keys(self, prefix: str) -> list[str]:
        norm = normalize_prefix(prefix)
        base = self.root / norm if norm else self.root
        keys: list[str] = []

        def walk_error(exc: OSError) -> None:
            # os.walk ignores every error by default; only a directory deleted meanwhile is harmless (the root
            # is checked before and after the walk).
            if not isinstance(exc, FileNotFoundError | NotADirectoryError):
                raise exc

        self._require_root()
        try:
            for dirpath, dirnames, filenames in os.walk(base, onerror=walk_error):
                dirnames[:] = [d for d in dirnames if not d.startswith(TEMP_MARKER)]
                rel = Path(dirpath).relative_to(self.root).as_posix()
                for name in filenames:
                    if not name.startswith(TEMP_MARKER):
                        keys.append(name if rel == "." else f"{rel}/{name}")
        except OSError as exc:
            raise self._unavailable(f"list {norm!r}", exc) from exc
        self._require_root()  # the root went away mid-walk: the listing is incomplete
        return sorted(keys)

    # -- deletes -------------------------------------------------------------------------------
    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            path = self._path(key)
            try:
                path.unlink()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                # Absent is fine, but not when the whole bucket is: the caller must retry the delete later.
                self._require_root()
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
            try:
                shutil.rmtree(base)
            except (FileNotFoundError, NotADirectoryError):
                self._require_root()
            except OSError as exc:
                raise self._unavailable(f"delete {norm!r}", exc) from exc
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
        # No mkdir of the root here: a readiness probe that recreated a vanished bucket would hide the outage.
        probe = f".bucketrl-check/{uuid.uuid4().hex}"
        self._require_root()
        self.put_bytes(probe, b"ok")
        self.delete([probe])
