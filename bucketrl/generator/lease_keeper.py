"""The generator's ``keeper`` thread: renews version and prompt leases at a third of their TTL and pushes the
worker's metrics (the heartbeat)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.generator.adapters import VersionBook
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.generator.submit import PromptLedger

# The worker's logger: these lines read as they did when this code was part of the worker.
log = logging.getLogger("bucketrl.generator.worker")


class LeaseKeeper:
    def __init__(
        self,
        *,
        client: ProxyClient,
        worker_id: str,
        settings: GeneratorSettings,
        book: VersionBook,
        ledger: PromptLedger,
        release_version_lease: Callable[[str], None],
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.settings = settings
        self.book = book
        self.ledger = ledger
        self.release_version_lease = release_version_lease

    def keep(self, stop_event: threading.Event, push_metrics: Callable[[], None]) -> None:
        """Thread: renew leases at a third of their TTL and push metrics (the heartbeat)."""
        s = self.settings
        period = min(s.metrics_interval_s, s.version_lease_ttl_s / 3, s.prompt_lease_ttl_s / 3)
        last_push = 0.0
        while not stop_event.wait(period):
            self.renew()
            if time.monotonic() - last_push >= s.metrics_interval_s:
                push_metrics()
                last_push = time.monotonic()

    def renew(self) -> None:
        self._renew_versions()
        self._renew_prompts()

    def _renew_versions(self) -> None:
        s = self.settings
        for version, lease_id in self.book.leases().items():
            try:
                self.client.renew_lease(lease_id, ttl_s=s.version_lease_ttl_s)
            except errors.Gone:
                try:  # expired (a long stall): lease the same version again if it still exists
                    fresh = self.client.lease_version(self.worker_id, version, s.version_lease_ttl_s)
                    if not self.book.replace_lease(version, lease_id, fresh.lease_id):
                        self.release_version_lease(fresh.lease_id)  # released on purpose meanwhile
                except errors.BucketRLError as exc:
                    log.warning("version %d lease lost: %s", version, exc.message)
            except errors.BucketRLError as exc:
                log.warning("renewing version %d lease: %s", version, exc.message)

    def _renew_prompts(self) -> None:
        ids = self.ledger.ids()
        if not ids:
            return
        try:
            renewed = self.client.renew_prompts(self.worker_id, ids, ttl_s=self.settings.prompt_lease_ttl_s)
            # Ids submitted meanwhile are complete, not lost: only those still held count.
            lost = (set(ids) - {p.prompt_id for p in renewed.prompts}) & set(self.ledger.ids())
            if lost:
                log.warning("%d prompt lease(s) had expired; the proxy may issue them again", len(lost))
        except errors.Gone:
            log.warning("all %d prompt leases had expired", len(ids))
        except errors.BucketRLError as exc:
            log.warning("renewing prompt leases: %s", exc.message)
