"""The generator's adapter versions: the ``adapter-sync`` thread long-polls for new versions and leases, fetches and
verifies each; the main thread loads the newest fetched one into the engine and retires versions nobody uses."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.generator.adapters import VersionBook, fetch_adapter, file_dtype, gc_cache
from bucketrl.generator.metrics import GeneratorMetrics
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.generator.staging import StagedPulls
from bucketrl.rollout.engine import Engine
from bucketrl.wire import RunSpec

# The worker's logger: these lines read as they did when this code was part of the worker.
log = logging.getLogger("bucketrl.generator.worker")


def release_version_lease(client: ProxyClient, lease_id: str) -> None:
    if not lease_id:
        return
    try:
        client.release_lease(lease_id)
    except errors.BucketRLError as exc:  # expired already (410) or proxy away: it will expire anyway
        log.debug("release of lease %s: %s", lease_id, exc)


class AdapterVersions:
    def __init__(
        self,
        *,
        client: ProxyClient,
        worker_id: str,
        settings: GeneratorSettings,
        book: VersionBook,
        engine: Engine,
        spec: Callable[[], RunSpec | None],
        metrics: GeneratorMetrics,
        cache_dir: Path,
        stop_event: threading.Event,
        version_ready: threading.Event,
        refresh_spec: Callable[[], None],
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.settings = settings
        self.book = book
        self.engine = engine
        self.spec = spec
        self.metrics = metrics
        self.cache_dir = cache_dir
        self.stop_event = stop_event
        self.version_ready = version_ready
        self.refresh_spec = refresh_spec  # before each fetch: mutable run fields may change between versions
        self._cache_gc_at = 0  # newest_known at the last cache GC
        # Staged publish (staging.py): uploads pulled while the trainer sends them, on a client of their own.
        self.staged: StagedPulls | None = None
        if settings.staging:
            staging_client = settings.proxy_client(settings.outage(worker_id))
            self.staged = StagedPulls(staging_client, cache_dir, stop_event, settings.version_wait_s)

    def release(self, lease_id: str) -> None:
        release_version_lease(self.client, lease_id)

    # -- the main thread ---------------------------------------------------------------------------------

    def sync(self) -> None:
        """Between engine steps and during waits: load what the sync thread fetched, retire what left the
        window (the version being sampled is in use, so it stays), so a long call or wait neither delays
        weight sync nor piles up resident adapters."""
        self.load_pending()
        self.retire()

    def load_pending(self) -> None:
        """Load the newest fetched version into the engine (older versions stay resident)."""
        slot = self.book.pending()
        if slot is None:
            return
        capacity = getattr(self.engine, "max_loras", None)
        if capacity is not None and len(self.engine.loaded_adapters()) >= capacity:
            return  # retire makes room between engine calls
        t0 = time.monotonic()
        try:
            self.engine.load_adapter(slot.name, slot.version, slot.path)
        except Exception as exc:
            log.error("adapter v%d could not be loaded (%s); staying on the current version", slot.version, exc)
            self.metrics.add("sync/adapter_failures_total")
            self.book.drop(slot.version)
            self.release(slot.lease_id)
            return
        self.book.mark_loaded(slot.version)
        load_s = slot.fetch_s + (time.monotonic() - t0)
        self.metrics.set("sync/adapter_load_s", load_s)
        self.metrics.set("sync/adapter_version", slot.version)
        self.metrics.set("policy/version", slot.version)
        shipped, served = file_dtype(slot.path), getattr(self.engine, "adapter_dtype", None)
        cast = f", {shipped} cast to {served} on load" if shipped and served and shipped != served else ""
        log.info(
            "loaded %s in %.2fs (served in %s%s; resident: %s)",
            slot.name,
            load_s,
            served or shipped or "the engine's dtype",
            cast,
            self.book.loaded_versions(),
        )

    def retire(self) -> None:
        """Unload versions nobody uses that left the staleness window (or whose slot the next version needs);
        release the leases of versions no longer sampled from."""
        spec = self.spec()
        assert spec is not None
        capacity = getattr(self.engine, "max_loras", None) or (spec.max_staleness + 2)
        reserve = 1 if self.book.pending() is not None else 0
        retired = self.book.retire(spec.max_staleness, capacity, reserve)
        for slot in retired:
            self.engine.unload_adapter(slot.name)
            self.release(slot.lease_id)
            log.info("unloaded %s", slot.name)
        for lease_id in self.book.take_idle_leases():
            self.release(lease_id)
        if self.staged is not None:
            self.staged.prune(self.book.newest_known)
        if retired or self.book.newest_known > self._cache_gc_at:
            # Superseded (fetched, never loaded) and retired versions leave the disk: the cache stays bounded
            # (issue 10 item 11: a long run filled the chart's emptyDir).
            self._cache_gc_at = self.book.newest_known
            gone = gc_cache(self.cache_dir, self.book.versions(), self.book.newest_known)
            if gone:
                log.debug("deleted cached adapters %s", gone)

    # -- the adapter-sync thread ---------------------------------------------------------------------------

    def follow(self) -> None:
        """Thread: long-poll for new versions; lease, fetch and verify each; the main thread loads it."""
        if self.staged is not None:
            threading.Thread(target=self.staged.follow, name="adapter-staging", daemon=True).start()
        delay = 0.5
        while not self.stop_event.is_set():
            try:
                info = self.client.wait_for_version(self.book.newest_known, wait_s=self.settings.version_wait_s)
                if info is not None and not self.stop_event.is_set():
                    self.book.announced = max(self.book.announced, info.version)
                    self._fetch(info.version, info.sha256, info.dtype)
                delay = 0.5
            except errors.BucketRLError as exc:
                if self.stop_event.is_set():
                    return
                log.warning("adapter sync: %s %s", exc.code, exc.message)
                self.stop_event.wait(delay)
                delay = min(delay * 2, 10.0)
            except Exception:
                if self.stop_event.is_set():
                    return  # the client was closed under a long-poll at shutdown
                log.exception("adapter sync failed")
                self.stop_event.wait(delay)
                delay = min(delay * 2, 10.0)

    def _fetch(self, announced: int, sha256: str, dtype: str | None = None) -> None:
        s = self.settings
        self.refresh_spec()
        t0 = time.monotonic()
        # Lease "the latest" rather than the announced number: never Gone, and maybe one newer already.
        lease = self.client.lease_version(self.worker_id, None, ttl_s=s.version_lease_ttl_s)
        self.book.begin_fetch(lease.version, lease.lease_id)  # the keeper renews it during the download
        try:
            expected = sha256 if lease.version == announced else None
            spec = self.spec()
            want = dtype if lease.version == announced else (spec.adapter_dtype if spec is not None else None)
            used = self.staged.used if self.staged is not None else 0
            take = self.staged.take if self.staged is not None else None
            path = fetch_adapter(self.client, lease.version, self.cache_dir, expected, want, take)
            if self.staged is not None and self.staged.used > used:
                self.metrics.add("sync/staged_fetches_total")  # its bytes came before the commit: not downloaded
        except errors.Invalid as exc:
            self.release(self.book.end_fetch(lease.version) or lease.lease_id)
            if exc.retryable:  # a corrupted transfer: try again
                raise
            log.error("adapter v%d is unusable, skipping it: %s", lease.version, exc.message)
            self.metrics.add("sync/adapter_failures_total")
            self.book.newest_known = max(self.book.newest_known, lease.version)
            return
        except BaseException:
            self.release(self.book.end_fetch(lease.version) or lease.lease_id)
            raise
        lease_id = self.book.end_fetch(lease.version) or lease.lease_id
        for old in self.book.add(lease.version, lease_id, path, time.monotonic() - t0):
            self.release(old.lease_id)  # fetched but never loaded: superseded
        if self.stop_event.is_set():  # shutdown may have released the book's leases already
            self.release(lease_id)
        self.version_ready.set()
