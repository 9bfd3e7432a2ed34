"""Staged publish, a generator's half when it fetches from the proxy itself (no relay in between): pull each of its
run's adapter uploads into the adapter cache while the trainer is still sending it (``bucketrl/proxy/staging.py``
is the proxy's half, ``bucketrl/relay/staging.py`` a relay's).

The ``adapter-staging`` thread long-polls ``/v1/staging?run=RUN`` with the generator's own token and streams each
new upload into ``.tmp-v{N}-staged-….part`` in the cache directory. When the version is announced (its commit
done) the adapter-sync thread leases it as before and, instead of downloading it, :meth:`StagedPulls.take`s the
staged tar whose (version, sha256) is the announced one, waiting for the pull's last bytes while they still come.

Why nothing uncommitted is ever loaded: the proxy withholds an upload's last byte until its commit and ends the
stream short when the publish fails (a lost commit, a fenced trainer, the trainer gone), so a pull is complete
(its size and sha256 the declared ones) only for a committed upload; one that ends short is deleted at once. And a
staged tar is used only for the version the proxy announced, with the announced sha256, under a lease: the same
gate as a download. Files are named ``.tmp-v*`` so a generator that restarts mid-pull deletes them at start
(``adapters.clear_stale_tmp``) and downloads the committed version as before.

Behind a regional relay the relay answers the long-poll itself with "nothing staged here" (it stages for the
whole region into its cache), so no generator pulls an upload across the slow link on its own.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.wire.adapters import StagedUpload

log = logging.getLogger("bucketrl.generator.staging")

OFF_S = 30.0  # staging off at the proxy (or a proxy without it): ask again this much later
STALL_S = 10.0  # a pull whose file did not grow for this long is not waited for: the version is downloaded


@dataclass(eq=False)
class Pull:
    upload: StagedUpload
    part: Path
    done: threading.Event = field(default_factory=threading.Event)
    tar: Path | None = None  # set once complete: the whole committed upload, its sha256 checked


class StagedPulls:
    """The staged uploads this generator pulled or is pulling, by (version, sha256)."""

    def __init__(self, client: ProxyClient, cache_dir: Path, stop_event: threading.Event, wait_s: float) -> None:
        self.client, self.cache_dir, self.stop_event, self.wait_s = client, cache_dir, stop_event, wait_s
        self._lock = threading.Lock()
        self._pulls: dict[tuple[int, str], Pull] = {}
        self.pulled = self.dropped = self.used = 0

    # -- the adapter-staging thread -------------------------------------------------------------------------

    def follow(self) -> None:
        """Long-poll for new uploads of the run until stopped; each one is pulled on a thread of its own."""
        try:
            self._follow()
        finally:
            self.client.close()

    def _follow(self) -> None:
        after, instance = 0, ""
        while not self.stop_event.is_set():
            try:
                listing = self.client.staged_uploads(after, instance, self.wait_s)
            except errors.BucketRLError as exc:
                if self.stop_event.is_set():
                    return
                # 403/404: a proxy from before generators could read staging; otherwise an outage. Either way the
                # versions still come by download: staging only makes them earlier.
                log.debug("staging: %s %s", exc.code, exc.message)
                self.stop_event.wait(OFF_S if exc.status in (403, 404) else 1.0)
                continue
            except Exception:
                if self.stop_event.is_set():
                    return  # the client was closed under the long-poll at shutdown
                log.exception("staging: the long-poll failed")
                self.stop_event.wait(1.0)
                continue
            if not listing.instance:  # off at the proxy, or a relay's answer: nothing to pull here
                self.stop_event.wait(OFF_S)
                continue
            after, instance = listing.seq, listing.instance
            for upload in listing.uploads:
                if upload.run == self.client.run:
                    self._start(upload)

    def _start(self, upload: StagedUpload) -> None:
        key = (upload.version, upload.sha256)
        with self._lock:
            if key in self._pulls:
                return
            part = self.cache_dir / f".tmp-v{upload.version}-staged-{uuid.uuid4().hex[:8]}.part"
            pull = self._pulls[key] = Pull(upload, part)
        threading.Thread(target=self._pull, args=(pull,), name=f"staged-v{upload.version}", daemon=True).start()

    def _pull(self, pull: Pull) -> None:
        up = pull.upload
        try:
            with pull.part.open("wb") as fh:
                size, sha = self.client.read_staged(up.upload_id, fh)
            if (size, sha) != (up.bytes, up.sha256):
                raise errors.Invalid(f"{size} bytes with sha256 {sha}, not the {up.bytes} declared")
            tar = pull.part.with_suffix(".tar")
            pull.part.rename(tar)
            pull.tar = tar
            self.pulled += 1
            log.info("staged v%d: its %d bytes are here, before the download", up.version, up.bytes)
        except Exception as exc:  # the publish failed (the stream ended short), or the link dropped: keep nothing
            pull.part.unlink(missing_ok=True)
            self.dropped += 1
            log.info("staged v%d not kept (%s): a committed version is downloaded as before", up.version, exc)
        finally:
            pull.done.set()

    # -- the adapter-sync thread -------------------------------------------------------------------------------

    def take(self, version: int, sha256: str) -> Path | None:
        """The committed version's staged tar (the caller's now: it unlinks it), waiting for a pull under way
        while its file grows; None when there is none (then it is downloaded)."""
        with self._lock:
            pull = self._pulls.get((version, sha256))
        if pull is None:
            return None
        seen, at = -1, time.monotonic()
        while not pull.done.wait(0.05):
            size = pull.part.stat().st_size if pull.part.exists() else 0
            if size != seen:
                seen, at = size, time.monotonic()
            elif time.monotonic() - at > STALL_S or self.stop_event.is_set():
                return None  # stalled: download it (the pull ends and deletes its file on its own)
        with self._lock:
            self._pulls.pop((version, sha256), None)
        if pull.tar is None:
            return None
        self.used += 1
        return pull.tar

    def prune(self, below: int) -> None:
        """Forget finished pulls of versions up to ``below`` that nobody took (superseded; their bytes go)."""
        with self._lock:
            gone = [k for k, p in self._pulls.items() if k[0] <= below and p.done.is_set()]
            pulls = [self._pulls.pop(k) for k in gone]
        for p in pulls:
            if p.tar is not None:
                p.tar.unlink(missing_ok=True)
