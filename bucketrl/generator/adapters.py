"""Adapter versions on one generator: download + verify + unpack, and the book of which versions are
leased, loaded, and used by work in flight.

Rules (issue 3, docs/design.md invariants 1 and 3):

- A version is sampled from under the name ``{run}-v{N}`` and only while this worker holds a version
  lease on it (the lease id travels with every rollout batch).
- A newer version is loaded while older ones stay resident for the batches still in flight.
- A version's lease is released once it is neither the current version nor used by work in flight.
- A version leaves the engine only when no work in flight uses it AND it is older than the staleness
  window (``latest - max_staleness``), or when the engine needs its slot for a newer version.

The :class:`VersionBook` only decides; the worker performs the engine and HTTP calls it returns.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bucketrl import bundles, errors
from bucketrl.client import ProxyClient
from bucketrl.generator.engines.base import adapter_name
from bucketrl.tarball import unpack

log = logging.getLogger("bucketrl.generator.adapters")

_VERSION_DIR = re.compile(r"^v(\d+)$")
DTYPE_MARKER = ".dtype"


def clear_stale_tmp(cache_root: Path) -> int:
    """Remove the ``.tmp-v*`` downloads and unpack directories a crashed fetch left (at start: no fetch of ours
    is running). The cache directory belongs to one generator (``up`` and the Helm chart give each its own)."""
    stale = list(cache_root.glob(".tmp-v*"))
    for p in stale:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if stale:
        log.info("removed %d downloads or unpack directories a crashed fetch left in %s", len(stale), cache_root)
    return len(stale)


def make_cache_dir(cache_root: str | None, run: str) -> tuple[Path, bool]:
    """The run's adapter cache: ``cache_root/run`` (stale downloads cleared), or a temporary directory when no root
    is set; and whether it is the worker's own (deleted at exit)."""
    if cache_root:
        cache_dir = Path(cache_root) / run
        cache_dir.mkdir(parents=True, exist_ok=True)
        clear_stale_tmp(cache_dir)
        return cache_dir, False
    return Path(tempfile.mkdtemp(prefix=f"bucketrl-{run}-adapters-")), True


def gc_cache(cache_root: Path, keep: set[int], newest_known: int) -> list[int]:
    """Delete the unpacked versions this generator no longer needs: every ``v{N}`` not in ``keep`` (the book's
    versions: loaded, pending, in use; an engine may re-read a resident adapter's files) and older than
    ``newest_known`` (a newer one may be being fetched right now). Returns the versions deleted."""
    gone = []
    for p in cache_root.iterdir():
        m = _VERSION_DIR.match(p.name)
        if m and p.is_dir() and int(m[1]) not in keep and int(m[1]) < newest_known:
            shutil.rmtree(p, ignore_errors=True)
            gone.append(int(m[1]))
    return sorted(gone)


def fetch_adapter(
    client: ProxyClient,
    version: int,
    cache_root: Path,
    expected_sha256: str | None = None,
    expected_dtype: str | None = None,
    staged: Callable[[int, str], Path | None] | None = None,
) -> Path:
    """Download version ``version``'s tar to disk, check its sha256, unpack it under ``cache_root/v{N}`` atomically.

    ``staged(version, sha256)``: the tar pulled before the commit (``staging.StagedPulls.take``), used instead of a
    download when it is the one with ``expected_sha256`` (the announced version's).

    ``expected_dtype`` (the announced version's, or the run spec's ``adapter_dtype``; None or ``auto``: any): the
    weights must be in it, or the version is refused (``Invalid`` ``adapter_dtype_mismatch``, not retryable).

    Memory stays bounded whatever the adapter's size: the tar streams to a file next to the cache (one chunk in
    memory at a time), and is checked and unpacked from there. A directory already there with the same verified
    sha256 is reused. ``Invalid`` on a bad or unsafe tar (not retryable: a bad version), or on a transfer whose
    sha256 is not the published one (retryable, once: a second such download is a bad version too, since the
    stored object itself is not what was published).
    """
    final = cache_root / f"v{version}"
    marker = final / ".sha256"
    if expected_sha256 and marker.is_file() and marker.read_text().strip() == expected_sha256:
        return final
    tag = uuid.uuid4().hex[:8]
    tar_path = cache_root / f".tmp-v{version}-{tag}.tar"
    tmp = cache_root / f".tmp-v{version}-{tag}"
    try:
        tar = staged(version, expected_sha256) if staged is not None and expected_sha256 else None
        # Pulled while the trainer uploaded it and checked against this sha256: no second download.
        if tar is not None and expected_sha256:
            tar.rename(tar_path)
            got = expected_sha256
        else:
            got = _download(client, version, tar_path, expected_sha256)
        dtype = _unpack_adapter(tar_path, tmp, version, expected_dtype)
        (tmp / ".sha256").write_text(got)
        (tmp / DTYPE_MARKER).write_text(dtype)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        tar_path.unlink(missing_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _download(client: ProxyClient, version: int, tar_path: Path, expected_sha256: str | None) -> str:
    """The tar into ``tar_path``; its sha256. Bytes that are not what was published (the proxy's header or the
    announced sha256) are downloaded once more, then refused as a bad version."""
    for attempt in (1, 2):
        with tar_path.open("wb") as fh:
            try:
                # Checks the proxy's X-Content-SHA256 header; the second time a relay's cache is checked too.
                got = client.download_adapter_to(version, fh, fresh=attempt == 2)
            except errors.Invalid as exc:
                if not exc.retryable:
                    raise
                problem = exc.message
            else:
                if not expected_sha256 or got == expected_sha256:
                    return got
                problem = f"adapter v{version}: sha256 {got} != published {expected_sha256}"
        if attempt == 2:
            raise errors.Invalid(f"{problem} (downloaded twice: the stored tar is not the published one)")
        log.warning("%s; downloading it again", problem)
    raise AssertionError("unreachable")


def file_dtype(path: Path) -> str | None:
    """The dtype of a fetched adapter's weights as shipped (None for a directory from before the marker)."""
    marker = path / DTYPE_MARKER
    return marker.read_text().strip() if marker.is_file() else None


def _unpack_adapter(tar_path: Path, dest: Path, version: int, expected_dtype: str | None = None) -> str:
    """Check that the tar is exactly a PEFT adapter (``bucketrl.bundles``: no pickle ever reaches the engine),
    then unpack it. ANY failure, MemoryError and RecursionError included, is a bad version: ``Invalid``, not
    retryable (the worker logs it, counts it and keeps serving the previous version), never a crash."""
    try:
        size = tar_path.stat().st_size
        with tar_path.open("rb") as fh:
            dtype = bundles.check_adapter_tar(fh)
        bundles.check_dtype(dtype, expected_dtype, f"adapter v{version}", "the version's announcement or run spec")
        # Members stream to disk in chunks; only the adapter's files, none larger than the tar, none sparse.
        allowed = dict.fromkeys((*bundles.ADAPTER_FILES, *bundles.ADAPTER_OPTIONAL), size)
        unpack(tar_path, dest, max_bytes=size, expected=allowed)
        return dtype
    except errors.Invalid as exc:
        message = exc.message if exc.message.startswith(f"adapter v{version}") else f"adapter v{version}: {exc.message}"
        raise errors.Invalid(message, retryable=False, code=exc.code) from exc
    except Exception as exc:  # a hostile tar: ValueError, tarfile errors, OSError, MemoryError, RecursionError...
        raise errors.Invalid(
            f"adapter v{version}: not a usable adapter tar ({type(exc).__name__}: {str(exc)[:200]})", retryable=False
        ) from exc


@dataclass
class VersionSlot:
    version: int
    name: str
    lease_id: str
    path: Path
    fetch_s: float
    loaded: bool = False
    inflight: int = 0  # batches sampled with this version and not yet settled (submitted, dropped, released)


class VersionBook:
    """Thread-safe record of this worker's versions. The adapter syncer adds, the main loop loads and
    retires, the submitter settles batches."""

    def __init__(self, run: str) -> None:
        self.run = run
        self._lock = threading.Lock()
        self._slots: dict[int, VersionSlot] = {}
        self.newest_known = 0  # the newest version fetched (or skipped as unusable)
        self.announced = 0  # the newest version the proxy announced (its fetch may still run)
        self._loading: int | None = None  # the version pending() handed to the main thread to load
        self._fetching: dict[int, str] = {}  # version -> lease id, while its adapter downloads
        # Versions whose evaluation this worker takes part in and the proxy still has prompts of (worker.py
        # _evaluate_some): kept loaded past the staleness window until it is done, or the version would never be
        # evaluated (nobody else holds it once the window moved on).
        self._pinned: set[int] = set()

    def name(self, version: int) -> str:

        return adapter_name(self.run, version)

    def add(self, version: int, lease_id: str, path: Path, fetch_s: float) -> list[VersionSlot]:
        """Record a fetched version; returns fetched-but-unloaded older versions it supersedes (to release)."""
        with self._lock:
            self._slots[version] = VersionSlot(version, self.name(version), lease_id, path, fetch_s)
            self.newest_known = max(self.newest_known, version)
            # Not the one the main thread is loading right now (handed out by pending()): removing it under the
            # load made mark_loaded raise KeyError and killed the worker (seen end to end when versions arrive
            # faster than one engine call).
            superseded = [
                s for s in self._slots.values() if not s.loaded and s.version < version and s.version != self._loading
            ]
            for s in superseded:
                del self._slots[s.version]
            return superseded

    def pending(self) -> VersionSlot | None:
        """The newest fetched version not loaded yet, if it is newer than the current one."""
        with self._lock:
            cur = self._current_locked()
            cands = [s for s in self._slots.values() if not s.loaded and (cur is None or s.version > cur.version)]
            slot = max(cands, key=lambda s: s.version) if cands else None
            self._loading = slot.version if slot is not None else None
            return slot

    def mark_loaded(self, version: int) -> None:
        with self._lock:
            self._slots[version].loaded = True
            self._loading = None

    def drop(self, version: int) -> VersionSlot | None:
        with self._lock:
            if self._loading == version:
                self._loading = None
            return self._slots.pop(version, None)

    def _current_locked(self) -> VersionSlot | None:
        loaded = [s for s in self._slots.values() if s.loaded]
        return max(loaded, key=lambda s: s.version) if loaded else None

    def current(self) -> VersionSlot | None:
        """The newest loaded version: what new prompts are sampled with."""
        with self._lock:
            return self._current_locked()

    def begin(self, version: int) -> VersionSlot:
        with self._lock:
            slot = self._slots[version]
            slot.inflight += 1
            return slot

    def end(self, version: int) -> None:
        with self._lock:
            slot = self._slots.get(version)
            if slot is not None:
                slot.inflight = max(0, slot.inflight - 1)

    def versions(self) -> set[int]:
        """Every version on the book (fetched, loading, loaded)."""
        with self._lock:
            return set(self._slots)

    def loaded_versions(self) -> list[int]:
        with self._lock:
            return sorted(s.version for s in self._slots.values() if s.loaded)

    def begin_fetch(self, version: int, lease_id: str) -> None:
        """A version's adapter is downloading under ``lease_id``: renew that lease meanwhile (a slow download
        must not outlive it: the version could be collected under the fetch)."""
        with self._lock:
            self._fetching[version] = lease_id

    def end_fetch(self, version: int) -> str:
        """The download is over: its lease id now (the keeper may have replaced an expired one)."""
        with self._lock:
            return self._fetching.pop(version, "")

    def leases(self) -> dict[int, str]:
        """Leases to keep renewing: every version still on the book, and those downloading."""
        with self._lock:
            out = {v: lease_id for v, lease_id in self._fetching.items() if lease_id}
            out.update({s.version: s.lease_id for s in self._slots.values() if s.lease_id})
            return out

    def replace_lease(self, version: int, old_id: str, new_id: str) -> bool:
        """Swap an expired lease for a fresh one, unless the version was retired meanwhile (then False)."""
        with self._lock:
            if self._fetching.get(version) == old_id:
                self._fetching[version] = new_id
                return True
            slot = self._slots.get(version)
            if slot is None or slot.lease_id != old_id:
                return False
            slot.lease_id = new_id
            return True

    def pin(self, version: int) -> None:
        """Keep ``version`` loaded past the staleness window (its evaluation is not done)."""
        with self._lock:
            self._pinned.add(version)

    def unpin(self, *versions: int) -> None:
        with self._lock:
            self._pinned.difference_update(versions)

    def pinned(self) -> set[int]:
        with self._lock:
            return set(self._pinned)

    def retire(self, max_staleness: int, capacity: int, reserve: int = 0) -> list[VersionSlot]:
        """Loaded versions to unload now (and forget, releasing their lease).

        Unused (no work in flight) and not current, and either older than the staleness window (unless
        pinned) or needed to keep ``loaded + reserve <= capacity`` (oldest first, pinned ones last: an idle
        version that is not current samples nothing for training).
        """
        with self._lock:
            cur = self._current_locked()
            idle = sorted(
                (s for s in self._slots.values() if s.loaded and s.inflight == 0 and s is not cur),
                key=lambda s: (s.version in self._pinned, s.version),
            )
            floor = self.newest_known - max_staleness
            out = [s for s in idle if s.version < floor and s.version not in self._pinned]
            loaded = sum(s.loaded for s in self._slots.values()) - len(out)
            for s in idle:
                if loaded + reserve <= capacity:
                    break
                if s not in out:
                    out.append(s)
                    loaded -= 1
            for s in out:
                del self._slots[s.version]
                self._pinned.discard(s.version)
            return out

    def take_idle_leases(self) -> list[str]:
        """Lease ids of versions loaded, not current, with no work in flight: they can go (the weights stay).
        The book forgets them, so they are neither renewed nor released twice."""
        with self._lock:
            cur = self._current_locked()
            idle = [s for s in self._slots.values() if s.loaded and s.inflight == 0 and s is not cur and s.lease_id]
            out = [s.lease_id for s in idle]
            for s in idle:
                s.lease_id = ""
            return out
