"""What a run's cost is computed from, accrued on every metrics push, and the run's cost (docs/cost.md).

Redis per run: ``cost:usage`` (hash ``{role}|{class}|{field}`` -> float, fields ``s`` (worker seconds),
``idle_s``, ``usd`` (dollars of seconds whose worker declared its price) and ``undeclared_s`` (seconds priced
from the table at read time, so a changed table reprices them); ``trained_tokens``). The seconds between two
pushes of a worker count for it, capped at the worker TTL: a worker silent longer was gone.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from bucketrl.cost import ClassTotals, RunTotals, compute
from bucketrl.proxy import bucket_meter, keys
from bucketrl.wire import MetricsPush, QueueStatus, WorkerStatus
from bucketrl.wire.cost import Prices, RunCost

USAGE = keys.COST_USAGE
# A generator in any other phase (waiting for the first version, loading, stopping) is idle.
BUSY_PHASE = "generating"


def declared(push: MetricsPush, prev: dict[str, Any]) -> dict[str, Any]:
    """The worker entry's cost fields after ``push`` (a push without a class keeps the last declared)."""
    if push.gpu_class is not None:
        return {"gpu_class": push.gpu_class, "usd_per_hour": push.usd_per_hour}
    return {"gpu_class": prev.get("gpu_class") or "unknown", "usd_per_hour": prev.get("usd_per_hour")}


def accrue(
    pipe: Any, run: str, role: str, push: MetricsPush, prev: dict[str, Any], entry: dict[str, Any], cap_s: float
) -> None:
    """Queue on ``pipe`` the accruals of the interval since the worker's last push; sets ``entry["up_s"]``."""
    key = keys.run_key(run, USAGE)
    if role == "trainer" and "train/tokens" in push.metrics:
        pipe.hincrbyfloat(key, "trained_tokens", push.metrics["train/tokens"])
    up_s = float(prev.get("up_s", 0.0))
    last = prev.get("last_seen")
    dt = 0.0 if last is None else max(0.0, min(entry["last_seen"] - float(last), cap_s))
    entry["up_s"] = up_s + dt
    if dt <= 0.0:
        return
    field = f"{role}|{entry['gpu_class']}|"
    pipe.hincrbyfloat(key, field + "s", dt)
    if role == "generator":
        idle = dt if entry.get("phase") != BUSY_PHASE else min(dt, push.metrics.get("rollout/backpressure_s", 0.0))
        if idle > 0:
            pipe.hincrbyfloat(key, field + "idle_s", idle)
    price = entry.get("usd_per_hour")
    if price is None:
        pipe.hincrbyfloat(key, field + "undeclared_s", dt)
    else:
        pipe.hincrbyfloat(key, field + "usd", dt / 3600.0 * float(price))


async def _usage(r: Any, run: str) -> tuple[dict[tuple[str, str], dict[str, float]], float, dict[str, float]]:
    """Usage by (role, class), the trained tokens, and the bucket meter's fields (``bucket_meter.FIELDS``)."""
    raw = await r.hgetall(keys.run_key(run, USAGE))
    by_class: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    tokens = 0.0
    metered: dict[str, float] = {}
    for f_b, v in raw.items():
        f = f_b.decode() if isinstance(f_b, bytes) else f_b
        if f == "trained_tokens":
            tokens = float(v)
            continue
        if f in bucket_meter.FIELDS:
            metered[f] = float(v)
            continue
        role, gpu_class, name = f.split("|", 2)
        by_class[(role, gpu_class)][name] = float(v)
    return by_class, tokens, metered


async def run_cost(
    r: Any,
    run: str,
    prices: Prices,
    *,
    queue: QueueStatus,
    trainer_step: int,
    live: list[WorkerStatus],
    metrics: dict[str, dict[str, float]],
) -> RunCost:
    by_class, tokens, metered = await _usage(r, run)
    live_by: dict[tuple[str, str], list[WorkerStatus]] = defaultdict(list)
    for w in live:
        live_by[(w.role, w.gpu_class or "unknown")].append(w)
    classes = []
    for cls in sorted(set(by_class) | set(live_by)):
        u, ws = by_class.get(cls, {}), live_by.get(cls, [])
        m = [metrics.get(w.worker_id, {}) for w in ws]
        classes.append(
            ClassTotals(
                role=cls[0],
                gpu_class=cls[1],
                worker_s=u.get("s", 0.0),
                idle_s=u.get("idle_s", 0.0),
                declared_usd=u.get("usd", 0.0),
                undeclared_s=u.get("undeclared_s", 0.0),
                workers_live=len(ws),
                live_up_s=sum(w.up_s for w in ws),
                live_tokens=sum(x.get("rollout/tokens_total", 0.0) for x in m),
                live_groups=sum(x.get("rollout/groups_submitted_total", 0.0) for x in m),
            )
        )
    # A prompt whose lease expired was worked on by a worker that vanished (SIGKILL, preemption without notice).
    expired = int(await r.hget(keys.run_key(run, keys.COUNTERS), "prompts_expired_total") or 0)
    wasted = queue.dropped_stale_total + queue.rejected_stale_total + queue.lost_total + expired
    totals = RunTotals(
        trainer_steps=trainer_step,
        trained_tokens=tokens,
        accepted_groups=queue.accepted_total,
        wasted_groups=wasted,
        produced_groups=queue.accepted_total + queue.rejected_stale_total + expired,
        bucket_requests=round(metered.get(bucket_meter.WRITES, 0.0)),
        bucket_reads=round(metered.get(bucket_meter.READS, 0.0)),
        egress_bytes=metered.get(bucket_meter.PROXY_EGRESS, 0.0),
        bucket_egress_bytes=metered.get(bucket_meter.BUCKET_EGRESS, 0.0),
    )
    return compute(prices, classes, totals)
