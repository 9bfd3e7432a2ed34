"""The run's live cost in the trainer's experiment trackers (issue 25): ``cost/*`` next to the loss.

The proxy owns the cost (``status.cost``: GPU time by class, bucket requests, egress; docs/cost.md); the trainer
only reads it, at most every ``every_s`` and at the last step, on the uploader thread that already talks to the
proxy. The figures go to the trackers only: the proxy has them already.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from bucketrl import errors
from bucketrl.wire.cost import RunCost

log = logging.getLogger("bucketrl.trainer")

COST_EVERY_S = 30.0  # a status read costs the proxy more than a push; the figures move slowly anyway


def cost_metrics(cost: RunCost) -> dict[str, float]:
    """The tracker metrics of a run's cost; a ratio whose denominator is still 0 is left out, not logged as 0."""
    raw = {
        "cost/usd_total": cost.usd_total,
        "cost/usd_gpu": cost.usd_gpu,
        "cost/usd_per_step": cost.usd_per_step,
        "cost/usd_per_trained_token": cost.usd_per_trained_token,
        "cost/usd_per_accepted_group": cost.usd_per_accepted_group,
        "cost/waste_usd": cost.waste_usd,
        "cost/waste_fraction": cost.waste_fraction,
    }
    return {k: float(v) for k, v in raw.items() if v is not None and math.isfinite(v)}


class CostReports:
    """When the trackers get the cost again: the first call, then every ``every_s``, and when ``final``."""

    def __init__(self, every_s: float = COST_EVERY_S) -> None:
        self.every_s = every_s
        self._last: float | None = None
        self._warned = False

    def due(self, client: Any, *, final: bool = False) -> dict[str, float]:
        now = time.monotonic()
        if not final and self._last is not None and now - self._last < self.every_s:
            return {}
        self._last = now
        try:
            cost = client.status().cost
        except errors.BucketRLError as exc:  # best effort, as every metric: never stop training for it
            if not self._warned:
                log.warning("the run's cost could not be read for the trackers (%s); trying again later", exc)
                self._warned = True
            return {}
        return {} if cost is None else cost_metrics(cost)
