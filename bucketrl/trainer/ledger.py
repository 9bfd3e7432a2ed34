"""Which deliveries this trainer's lineage took for training: a delivery is never trained twice in it.

A delivery can reach the trainer again although the trainer already has it: after a Redis wipe the proxy
rebuilds the queue from the bucket, and groups trained since the last checkpoint are still unacked (acks wait
for the checkpoint that holds their effect), so they are queued again; so are groups acked just before the
wipe whose bucket settlement had not landed yet. Such a repeat is not trained again: it is *held* and acked
with the next checkpoint (its effect is in the weights that checkpoint saves, or in an earlier one). A
re-queued delivery that is below the claim's version floor is handed over flagged (``rebuilt_stale``) rather
than dropped, because only this ledger knows whether the lineage trained it: held if so, else given back.

A trainer restarted from a checkpoint starts a new ledger from that checkpoint's list: what the dead
process trained after the checkpoint is gone from the weights, so it is trained again (correctly).

Memory is bounded: the ids of the last ``remember_checkpoints`` checkpoints are kept (a repeat comes within
seconds of a wipe, long before that many checkpoints pass).
"""

from __future__ import annotations

import threading
from collections import deque

from bucketrl.wire import Delivery

# How many checkpoints' worth of trained ids a ledger remembers beyond the open interval.
REMEMBER_CHECKPOINTS = 16


class DeliveryLedger:
    """Thread-safe: the claim helper thread admits, the main thread trains, gives back and checkpoints."""

    def __init__(self, remember_checkpoints: int = REMEMBER_CHECKPOINTS) -> None:
        self._lock = threading.Lock()
        self._taken: set[str] = set()
        self._open: list[str] = []  # taken since the last checkpoint
        self._closed: deque[list[str]] = deque()
        self._remember = max(1, remember_checkpoints)
        self._release: list[str] = []

    def seed(self, ids: list[str]) -> None:
        """The resumed checkpoint's deliveries: trained in this lineage."""
        with self._lock:
            self._taken.update(ids)
            self._closed.append(list(ids))
            self._prune()

    def admit(self, deliveries: list[Delivery]) -> tuple[list[Delivery], list[str]]:
        """Split claimed deliveries into new ones (now taken) and repeats of taken ones (their ids)."""
        fresh: list[Delivery] = []
        repeats: list[str] = []
        with self._lock:
            for d in deliveries:
                if d.delivery_id in self._taken:
                    repeats.append(d.delivery_id)
                else:
                    self._taken.add(d.delivery_id)
                    self._open.append(d.delivery_id)
                    fresh.append(d)
        return fresh, repeats

    def trained(self, ids: list[str]) -> list[str]:
        """Those of ``ids`` this lineage took (the proxy dropped them as stale after a rebuild re-queued them: they
        are held and acked with the next checkpoint, so the proxy counts them acked, not dropped)."""
        with self._lock:
            return [d for d in ids if d in self._taken]

    def give_back(self, ids: list[str]) -> None:
        """Not trained (held back as too stale, or handed over below the floor after a rebuild and never taken):
        forget them, and have the next claim release them (the proxy then drops and counts them stale)."""
        with self._lock:
            self._taken.difference_update(ids)
            gone = set(ids)
            self._open = [d for d in self._open if d not in gone]
            self._release.extend(ids)

    def take_release(self, limit: int = 4096) -> list[str]:
        """Up to ``limit`` given-back ids (a claim's ``release`` is bounded) for the next claim to carry."""
        with self._lock:
            out, self._release = self._release[:limit], self._release[limit:]
        return out

    def remembered(self) -> list[str]:
        """The ids of the earlier checkpoints this ledger still remembers (not the open interval's): a checkpoint
        records them, so a trainer resumed from it still holds a repeat of one (a Redis wipe re-queues groups
        acked after the proxy's last snapshot) instead of training it again or leaving it counted as dropped."""
        with self._lock:
            return [d for ids in self._closed for d in ids]

    def checkpointed(self) -> None:
        """A checkpoint now holds everything taken so far (trained before it)."""
        with self._lock:
            self._closed.append(self._open)
            self._open = []
            self._prune()

    def __contains__(self, delivery_id: object) -> bool:
        with self._lock:
            return delivery_id in self._taken

    def _prune(self) -> None:
        while len(self._closed) > self._remember:
            self._taken.difference_update(self._closed.popleft())
