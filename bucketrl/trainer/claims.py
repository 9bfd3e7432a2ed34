"""The trainer's claims: the claim loop that gathers a step's groups (on the claim helper thread) and the last
staleness guard before they are trained."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.trainer.exits import Stopped
from bucketrl.trainer.ledger import DeliveryLedger
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.wire import Delivery, RunSpec

# The worker's logger: these lines read as they did when this code was part of the worker.
log = logging.getLogger("bucketrl.trainer")


class ClaimLoop:
    """Claims for one trainer; ``spec`` is read at each claim (the worker sets it once the run is known)."""

    def __init__(
        self,
        *,
        settings: TrainerSettings,
        client: ProxyClient,
        worker_id: str,
        spec: Callable[[], RunSpec | None],
        ledger: DeliveryLedger,
        stop_requested: threading.Event,
        retrying: Callable[[Callable[[], Any]], Any],
    ) -> None:
        self.settings = settings
        self.client = client
        self.worker_id = worker_id
        self.spec = spec
        self.ledger = ledger
        self.stop_requested = stop_requested
        self.retrying = retrying

    def claim_groups(self, train_version: int) -> tuple[list[Delivery], int, list[str]]:
        """Claim until ``groups_per_step`` new groups to train with ``train_version``, none older than it minus
        max_staleness (helper thread); the claims tell the proxy this pace. Also returns the ids of repeats
        (deliveries this lineage already took: held, never trained twice). Raises Stopped on a stop request."""
        spec = self.spec()
        assert spec is not None
        min_version = max(0, train_version - spec.max_staleness)
        need = spec.groups_per_step
        got: list[Delivery] = []
        repeats: list[str] = []
        dropped = n = 0
        t0 = time.monotonic()
        while n < need:
            if self.stop_requested.is_set():
                raise Stopped  # what was claimed stays unacked: the next trainer gets it at once
            waited = time.monotonic() - t0
            if self.settings.max_rollout_wait_s and waited > self.settings.max_rollout_wait_s:
                raise errors.Unavailable(
                    f"no rollouts for {waited:.0f}s (BUCKETRL_MAX_ROLLOUT_WAIT_S): are generators running?"
                )
            fresh, n_dropped, again = self._claim_once(need - n, min_version, train_version)
            got += fresh
            dropped += n_dropped
            repeats += again
            n = sum(len(d.groups) for d in got)
        return got, dropped, repeats

    def _claim_once(self, k: int, min_version: int, train_version: int) -> tuple[list[Delivery], int, list[str]]:
        """One claim of up to ``k`` groups: the new deliveries, the stale drops to count, the repeats to hold."""
        # One request id per claim, the same on its retries: a replay after a lost answer gets the same
        # deliveries (the proxy never redelivers them to this epoch otherwise).
        request_id, release = secrets.token_hex(12), self.ledger.take_release()
        resp = self.retrying(
            lambda: self.client.claim(
                self.worker_id,
                max_groups=k,
                wait_s=self.settings.claim_wait_s,
                min_version=min_version,
                train_version=train_version if train_version >= 1 else None,
                sync_every=self.settings.sync_every,
                request_id=request_id,
                release=release,
                hold_rebuilt=True,
            )
        )
        # Groups a rebuild re-queued (after a Redis wipe) below the floor: never trained now. Those this lineage
        # trained before are held and acked with the next checkpoint (counted acked, as they were); the rest are
        # given back, and the proxy drops and counts them stale.
        below = [d.delivery_id for d in resp.deliveries if d.rebuilt_stale]
        held = self.ledger.trained(below)
        if len(held) < len(below):
            self.ledger.give_back(sorted(set(below) - set(held)))
        # (An older proxy ignores hold_rebuilt: it drops them and lists them, and the ack of those this lineage
        # trained moves them to acked.)
        trained_before = self.ledger.trained(resp.dropped_rebuilt)
        fresh, again = self.ledger.admit([d for d in resp.deliveries if not d.rebuilt_stale])
        return fresh, resp.dropped_stale - len(trained_before), again + held + trained_before


def within_staleness(
    deliveries: list[Delivery], *, policy_version: int, max_staleness: int, ledger: DeliveryLedger
) -> tuple[list[Delivery], int]:
    """The deliveries the current policy may train on, and how many groups were held back as too stale.

    A last guard: the claim's ``min_version`` already excludes such groups, so this finds none unless the
    version arithmetic of :meth:`TrainerWorker._train_version` is broken. A held-back delivery is neither trained
    nor consumed, so it is never acked: the next claim gives it back (``release``; a claim never redelivers a
    delivery to the epoch holding it) and a later claim, whose ``min_version`` is at least as high, drops it
    and counts it in ``dropped_stale_total``, which comes back to this trainer's ``sample/dropped_stale_total``.
    So each such group is counted once, as a stale drop, by the proxy; its accounting (accepted = acked +
    dropped + queued + pending) stays truthful: ``acked`` only ever means trained. Until then it is pending.
    """
    limit = policy_version - max_staleness
    keep = [d for d in deliveries if d.version >= limit]
    if len(keep) == len(deliveries):
        return deliveries, 0
    held = sum(len(d.groups) for d in deliveries if d.version < limit)
    # Given back with the next claim: the proxy drops and counts them (they are not redelivered to the
    # epoch that holds them otherwise).
    ledger.give_back([d.delivery_id for d in deliveries if d.version < limit])
    log.warning(
        "held back %d group(s) older than v%d (policy v%d - max_staleness %d): not trained, left unacked for "
        "the proxy to drop and count on redelivery",
        held,
        limit,
        policy_version,
        max_staleness,
    )
    return keep, held
