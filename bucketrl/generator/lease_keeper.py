"""The generator's ``keeper`` thread: renews version and prompt leases at a third of their TTL and pushes the
worker's metrics (the heartbeat). The renewals ride on the heartbeat (``MetricsPush.renew``): one request per tick
instead of three; an older proxy ignores them, and then the keeper renews on the renew routes."""

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
from bucketrl.wire import PromptLease
from bucketrl.wire.metrics import Renewals, Renewed

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

    def keep(self, stop_event: threading.Event, push_metrics: Callable[..., bool]) -> None:
        """Thread: renew leases at a third of their TTL and push metrics (the heartbeat), the renewals on the
        heartbeat when it is due."""
        s = self.settings
        period = min(s.metrics_interval_s, s.version_lease_ttl_s / 3, s.prompt_lease_ttl_s / 3)
        last_push = 0.0
        while not stop_event.wait(period):
            if time.monotonic() - last_push >= s.metrics_interval_s:
                last_push = time.monotonic()
                if push_metrics(renew=True):
                    continue  # the renewals rode on the heartbeat: one request instead of three
            self.renew()

    def renew(self) -> None:
        self._renew_versions()
        self._renew_prompts()

    def _renew_versions(self) -> None:
        s = self.settings
        for version, lease_id in self.book.leases().items():
            try:
                self.client.renew_lease(lease_id, ttl_s=s.version_lease_ttl_s)
            except errors.Gone:
                self._version_lease_expired(version, lease_id)
            except errors.BucketRLError as exc:
                log.warning("renewing version %d lease: %s", version, exc.message)

    def _renew_prompts(self) -> None:
        ids = self.ledger.ids()
        if not ids:
            return
        try:
            renewed = self.client.renew_prompts(self.worker_id, ids, ttl_s=self.settings.prompt_lease_ttl_s)
            self._prompts_renewed(ids, renewed)
        except errors.Gone:
            log.warning("all %d prompt leases had expired", len(ids))
        except errors.BucketRLError as exc:
            log.warning("renewing prompt leases: %s", exc.message)

    def _version_lease_expired(self, version: int, lease_id: str) -> None:
        """Expired (a long stall): lease the same version again if it still exists."""
        s = self.settings
        try:
            fresh = self.client.lease_version(self.worker_id, version, s.version_lease_ttl_s)
            if not self.book.replace_lease(version, lease_id, fresh.lease_id):
                self.release_version_lease(fresh.lease_id)  # released on purpose meanwhile
        except errors.BucketRLError as exc:
            log.warning("version %d lease lost: %s", version, exc.message)

    def _prompts_renewed(self, ids: list[str], renewed: PromptLease) -> None:
        # Ids submitted meanwhile are complete, not lost: only those still held count.
        lost = (set(ids) - {p.prompt_id for p in renewed.prompts}) & set(self.ledger.ids())
        if lost:
            log.warning("%d prompt lease(s) had expired; the proxy may issue them again", len(lost))

    # -- renewals on the heartbeat ----------------------------------------------------------------------

    def renewals(self) -> tuple[dict[int, str], Renewals]:
        """The leases held now (version -> lease id) and the heartbeat's renewal of them."""
        s = self.settings
        held = self.book.leases()
        return held, Renewals(
            version_leases=list(held.values()),
            version_ttl_s=s.version_lease_ttl_s,
            prompt_ids=self.ledger.ids(),
            prompt_ttl_s=s.prompt_lease_ttl_s,
        )

    def renewed(self, held: dict[int, str], sent: Renewals, got: Renewed) -> None:
        """What the proxy answered to the heartbeat's renewals: an expired version lease is leased again."""
        for version, lease_id in held.items():
            if lease_id in got.versions and got.versions[lease_id] is None:
                self._version_lease_expired(version, lease_id)
        if sent.prompt_ids and got.prompts is not None:
            if got.prompts.prompts:
                self._prompts_renewed(sent.prompt_ids, got.prompts)
            else:
                log.warning("all %d prompt leases had expired", len(sent.prompt_ids))
