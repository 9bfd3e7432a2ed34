"""Workers' metrics pushes (which double as heartbeats) and what the status shows of them.

Redis per run: ``workers`` (hash worker_id -> JSON {role, loaded_versions, last_seen, step, phase, notes,
gpu_class, usd_per_hour, up_s}; ``state/cost.py`` accrues the run's cost on each push),
``wmetrics:{worker}`` (hash metric -> latest value) and ``metrics:stream`` (capped stream of every push,
newest last, for the dashboard's time series), ``workers:pushseq`` (hash worker_id -> "session seq" of its
last recorded push).
"""

from __future__ import annotations

import json
from typing import Any

from bucketrl.proxy import keys
from bucketrl.proxy.state import cost
from bucketrl.proxy.state.clock import redis_now
from bucketrl.proxy.state.lua import Lua
from bucketrl.wire import MetricsPush, SampleCompletion, WorkerStatus

PUSH_SEQ = "workers:pushseq"
STREAM_MAXLEN = 20_000
# Recent sample completions kept per run (``samples``, a capped list, newest first).
SAMPLES_KEPT = 48


# KEYS: pushseq. ARGV: worker session seq. 1 when the push is new (and now the last recorded), else 0.
_FRESH = Lua.load("worker_fresh.lua")


async def record_push(r: Any, run: str, role: str, push: MetricsPush, ttl_s: float = 120.0) -> bool:
    """Record a push; False (nothing recorded) for a replayed or late one (see ``MetricsPush.seq``). The time
    since the worker's last push (at most ``ttl_s``, the worker TTL) accrues to the run's cost."""
    seq_key = keys.run_key(run, PUSH_SEQ)
    if push.session and push.seq and not await _FRESH(r, [seq_key], [push.worker_id, push.session, push.seq]):
        return False
    workers_key = keys.run_key(run, keys.WORKERS)
    now = await redis_now(r)  # liveness is a TTL: measured by Redis TIME, like every lease
    loaded = push.loaded_versions
    prev_entry: dict[str, Any] = {}
    prev = await r.hget(workers_key, push.worker_id)  # always: the cost accrues from its last_seen
    prev_entry = json.loads(prev) if prev else {}
    if loaded is None:
        loaded = prev_entry.get("loaded_versions", [])
    entry = {
        "role": role,
        "loaded_versions": sorted(set(loaded)),
        "last_seen": now,
        "step": push.step,
        # A push without them keeps the last phase and notes (metrics-only pushes).
        "phase": push.phase if push.phase is not None else prev_entry.get("phase"),
        "notes": push.notes or prev_entry.get("notes", {}),
        **cost.declared(push, prev_entry),
    }
    pipe = r.pipeline(transaction=True)
    cost.accrue(pipe, run, role, push, prev_entry, entry, ttl_s)
    pipe.hset(workers_key, push.worker_id, json.dumps(entry))
    if push.metrics:
        pipe.hset(keys.run_key(run, keys.WORKER_METRICS.format(worker=push.worker_id)), mapping=push.metrics)
    record = {"worker_id": push.worker_id, "role": role, "ts": now, "step": push.step, "metrics": push.metrics}
    pipe.xadd(
        keys.run_key(run, keys.METRICS_STREAM), {"json": json.dumps(record)}, maxlen=STREAM_MAXLEN, approximate=True
    )
    if push.samples:
        samples_key = keys.run_key(run, "samples")
        pipe.lpush(samples_key, *(x.model_dump_json() for x in push.samples))
        pipe.ltrim(samples_key, 0, SAMPLES_KEPT - 1)
    if role == "trainer" and push.step is not None:
        pipe.hset(keys.run_key(run, keys.STATE), "trainer_step", push.step)
    await pipe.execute()
    return True


async def live_workers(r: Any, run: str, ttl_s: float) -> tuple[list[WorkerStatus], dict[str, dict[str, float]]]:
    """Workers heard from within ``ttl_s`` and their latest metrics (``{worker: {name: value, "_step": k}}``)."""
    now = await redis_now(r)
    raw = await r.hgetall(keys.run_key(run, keys.WORKERS))
    workers: list[WorkerStatus] = []
    steps: dict[str, Any] = {}
    for wid_b, blob in raw.items():
        wid, entry = wid_b.decode(), json.loads(blob)
        age = now - float(entry["last_seen"])
        if age > ttl_s:
            if age > 10 * ttl_s:  # long gone: forget it (its metrics too)
                await r.hdel(keys.run_key(run, keys.WORKERS), wid)
                await r.delete(keys.run_key(run, keys.WORKER_METRICS.format(worker=wid)))
                await r.hdel(keys.run_key(run, PUSH_SEQ), wid)
            continue
        workers.append(
            WorkerStatus(
                worker_id=wid,
                role=entry["role"],
                loaded_versions=entry["loaded_versions"],
                last_seen_s=age,
                phase=entry.get("phase"),
                notes=entry.get("notes") or {},
                gpu_class=entry.get("gpu_class"),
                usd_per_hour=entry.get("usd_per_hour"),
                up_s=float(entry.get("up_s", 0.0)),
            )
        )
        steps[wid] = entry.get("step")
    workers.sort(key=lambda w: (w.role, w.worker_id))
    pipe = r.pipeline(transaction=False)
    for w in workers:
        pipe.hgetall(keys.run_key(run, keys.WORKER_METRICS.format(worker=w.worker_id)))
    metrics: dict[str, dict[str, float]] = {}
    for w, h in zip(workers, await pipe.execute(), strict=True):
        values = {k.decode(): float(v) for k, v in h.items()}
        if steps.get(w.worker_id) is not None:
            values["_step"] = steps[w.worker_id]
        metrics[w.worker_id] = values
    return workers, metrics


async def recent_pushes(r: Any, run: str, count: int = 200) -> list[dict[str, Any]]:
    """The last ``count`` pushes, oldest first."""
    entries = await r.xrevrange(keys.run_key(run, keys.METRICS_STREAM), count=count)
    return [json.loads(fields[b"json"]) for _, fields in reversed(entries)]


async def recent_samples(r: Any, run: str, count: int = 12) -> list[SampleCompletion]:
    """The run's most recent sample completions, newest first."""
    raw = await r.lrange(keys.run_key(run, "samples"), 0, count - 1)
    return [SampleCompletion.model_validate_json(x) for x in raw]
