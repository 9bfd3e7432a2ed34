"""Version leases on the versions TRL can still name, so the proxy's GC keeps them past the run's ``max_staleness``.

TRL unloads ``trl-policy-v{N - max_staleness - 1}`` only after loading ``v{N}``: until then it may send requests
naming any of the newer ones. The proxy's GC deletes versions older than ``latest - max_staleness`` (the run
spec's) unless a live lease holds them. The gateway holds one lease per version that a loaded name maps to, renews
them, and releases one when the last name mapping to it is unloaded; so TRL's own staleness window is the one that
counts. Leases are a generator-role route: the gateway takes them with ``BUCKETRL_LEASE_TOKEN`` (a generator token
of the run); without one it holds none (and the run's ``max_staleness`` must cover TRL's, docs/trl.md).

Blocking (``ProxyClient``): the gateway calls it in a thread.
"""

from __future__ import annotations

import logging
import threading

from bucketrl import errors
from bucketrl.client import ProxyClient

log = logging.getLogger("bucketrl.gateway")

LEASE_TTL_S = 60.0


class VersionHolds:
    def __init__(self, client: ProxyClient, worker_id: str, ttl_s: float = LEASE_TTL_S) -> None:
        self.client = client
        self.worker_id = worker_id
        self.ttl_s = ttl_s
        self.leases: dict[int, str] = {}  # version -> lease_id
        self._lock = threading.Lock()

    def hold(self, version: int) -> bool:
        """Lease ``version`` unless held already; False if it is gone (collected while nobody held it)."""
        with self._lock:
            if version in self.leases:
                return True
            try:
                lease = self.client.lease_version(self.worker_id, version, self.ttl_s)
            except (errors.Gone, errors.NotFound) as exc:
                log.warning("version %d cannot be held: %s", version, exc.message)
                return False
            self.leases[version] = lease.lease_id
            return True

    def release(self, version: int) -> None:
        with self._lock:
            lease_id = self.leases.pop(version, None)
        if lease_id is None:
            return
        try:
            self.client.release_lease(lease_id)
        except errors.BucketRLError as exc:  # expired already or proxy away: it lapses on its own
            log.debug("release of the lease on version %d: %s", version, exc.message)

    def renew_all(self) -> None:
        """Extend every lease; one that lapsed (the gateway was stalled, Redis wiped) is taken again."""
        with self._lock:
            held = dict(self.leases)
        for version, lease_id in held.items():
            try:
                self.client.renew_lease(lease_id, self.ttl_s)
            except errors.Gone:
                with self._lock:
                    self.leases.pop(version, None)
                self.hold(version)
            except errors.BucketRLError as exc:  # proxy away: try again next round, the lease has ttl left
                log.warning("renewing the lease on version %d: %s", version, exc.message)

    def release_all(self) -> None:
        for version in list(self.leases):
            self.release(version)
