"""The run status (``GET /v1/runs/{run}/status``), assembled from every area's Redis state.

Each area fills its part: the rollout queue and prompt leases (``accounting.status_part``: ``queue``,
``prompts_inflight``, ``prompt_cursor``), the workers' recent samples and the evaluated versions, before the
dict is validated as :class:`bucketrl.wire.RunStatus`.
"""

from __future__ import annotations

from typing import Any

from bucketrl.proxy import bucket_meter, keys
from bucketrl.proxy.state import accounting, cost, evals, leases, pool, runs, versions, workers
from bucketrl.wire import RunSpec, RunStatus


async def build(ctx: Any, run: str, spec: RunSpec) -> RunStatus:
    r = ctx.redis
    state = await runs.get_state(r, run)
    counts = await leases.live_counts(r, run)
    version_list = []
    for v in sorted(counts):
        rec = await versions.get_record(r, run, v)
        if rec is not None:
            version_list.append({"version": v, "leases": counts[v], "published_at": float(rec["published_at"])})
    worker_list, metrics = await workers.live_workers(r, run, ctx.settings.worker_ttl_s)
    gc_total = await r.hget(keys.run_key(run, keys.COUNTERS), "gc_versions")
    out: dict[str, Any] = {
        "run": run,
        "latest_version": state.latest_version,
        "versions": version_list,
        "queue": {"groups": 0, "capacity": spec.queue_capacity_groups},
        "prompts_inflight": 0,
        "workers": [w.model_dump() for w in worker_list],
        "trainer": {"epoch": state.trainer_epoch, "step": state.trainer_step},
        "metrics": metrics,
        "gc_versions_total": int(gc_total or 0),
    }
    out.update(await accounting.status_part(r, run, spec))
    # What people watching a run look at beside its curves: recent completions, and the evaluated versions.
    out["samples"] = [x.model_dump() for x in await workers.recent_samples(r, run)]
    if spec.eval is not None:
        out["eval"] = [x.model_dump() for x in await evals.results(r, ctx.store, run)]
    status = RunStatus.model_validate(out)
    status.pool = pool.with_occupancy(await pool.run_status(r, run, spec), spec, counts, worker_list, status.queue)
    await bucket_meter.flush(r, ctx.meter)  # this replica's counts so far: the cost as of now
    status.cost = await cost.run_cost(
        r,
        run,
        ctx.settings.price_table(),
        queue=status.queue,
        trainer_step=status.trainer.step,
        live=status.workers,
        metrics=metrics,
    )
    return status
