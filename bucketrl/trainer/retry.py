"""The trainer's retry of a proxy call through outages and other retryable answers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from bucketrl import errors
from bucketrl.client import Outage

# The worker's logger: these lines read as they did when this code was part of the worker.
log = logging.getLogger("bucketrl.trainer")

T = TypeVar("T")


def retrying(call: Callable[[], T], *, budget_s: float, outage: Outage) -> T:
    """Retry a call through proxy outages (503 / unreachable) and other retryable answers (409
    ``write_in_progress``: a slow write of the same bundle still holds its lock) for up to ``budget_s``
    (``outage_budget_s``).

    The client already retries each request through an outage for that long (with backoff honouring
    Retry-After); this covers a retryable error raised by the call itself. Every call retried here is
    idempotent on the proxy: a replayed claim (same request id) answers the same deliveries, a re-sent
    publish or checkpoint of the same bytes answers 200, acks are idempotent.
    """
    deadline = time.monotonic() + budget_s
    while True:
        try:
            return call()
        except errors.BucketRLError as exc:
            if not exc.retryable or isinstance(exc, errors.Fenced) or time.monotonic() > deadline:
                raise
            if isinstance(exc, errors.Unavailable) and outage.spent():
                raise  # the client rode this outage out for the whole budget already: do not double it
            log.warning("proxy unavailable (%s); retrying", exc.message)
            time.sleep(1.0)
