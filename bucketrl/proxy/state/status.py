"""The run status (``GET /v1/runs/{run}/status``), assembled from every area's Redis state.

The rollout queue and prompt leases belong to P3: each function in ``STATUS_HOOKS`` is awaited as
``hook(ctx, run, spec, status_dict)`` and fills its part (``queue``, ``prompts_inflight``,
``prompt_cursor``) in place, before the dict is validated as :class:`bucketrl.wire.RunStatus`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from bucketrl.proxy import keys
from bucketrl.proxy.state import leases, runs, versions, workers
from bucketrl.wire import RunSpec, RunStatus

StatusHook = Callable[[Any, str, RunSpec, dict[str, Any]], Awaitable[None]]
STATUS_HOOKS: list[StatusHook] = []


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
    for hook in STATUS_HOOKS:
        await hook(ctx, run, spec, out)
    return RunStatus.model_validate(out)
