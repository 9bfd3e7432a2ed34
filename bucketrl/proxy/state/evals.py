"""Evaluation during training (``RunSpec.eval``): eval prompts leased to generators, results counted once.

Versions 1, 1 + every, 1 + 2 * every ... are evaluated on the first ``eval.size`` prompts of the eval set.
A generator that has such a version loaded (and nothing better to do: it asks only when its training lease
was refused, so eval never takes a slot training could use) leases eval prompts of it
(``POST /v1/runs/{run}/eval/lease`` with its loaded versions), samples them with the eval sampling settings
(greedy, or ``n`` samples for pass@k), scores them with the run's reward and submits per prompt the rewards
and lengths (``POST /v1/runs/{run}/eval/submit``). Nothing of it is ever queued for the trainer.

Counted once: a prompt's result enters the version's sums only if its index was not done before (``SADD`` in
the same script as the sums), so a retried submit or a lease that expired and was done twice adds nothing.
When every prompt of a version is done, its :class:`~bucketrl.wire.EvalVersionResult` is written to the
bucket (``runs/{run}/eval/v{V}.json``) and to ``eval:results``; its working keys are deleted. A Redis wipe
loses only partial progress (the version starts over from zero, so nothing is counted twice); complete
results are read back from the bucket on the next eval call or status read.

Redis: ``brl:{run}:eval:results`` hash version -> result JSON; ``eval:loaded`` marker (results restored from
the bucket); per version V: ``eval:v{V}:cursor`` (next never-leased index), ``eval:v{V}:leased`` (zset index
-> expiry; expired ones are leased again first), ``eval:v{V}:done`` (set of indices), ``eval:v{V}:sums``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bucketrl.proxy import keys
from bucketrl.proxy.state.lua import Lua
from bucketrl.storage.base import BucketStore
from bucketrl.wire import EvalLease, EvalLeaseItem, EvalResult, EvalSubmitResponse, EvalVersionResult, RunSpec


def result_key(run: str, version: int) -> str:
    return f"runs/{run}/eval/v{version:08d}.json"


def _k(run: str, suffix: str) -> str:
    return keys.run_key(run, f"eval:{suffix}")


_LEASE = Lua.load("eval_lease.lua")

_SUBMIT = Lua.load("eval_submit.lua")


async def ensure_loaded(r: Any, store: BucketStore, run: str) -> None:
    """Complete results from the bucket into Redis once per Redis lifetime (after a wipe, again)."""
    marker = _k(run, "loaded")
    if await r.exists(marker):
        return
    names = await asyncio.to_thread(store.list_keys, f"runs/{run}/eval/")
    for name in names:
        if name.endswith(".json"):
            data = await asyncio.to_thread(store.get_bytes, name)
            res = EvalVersionResult.model_validate_json(data)
            await r.hsetnx(_k(run, "results"), str(res.version), res.model_dump_json())
    await r.set(marker, "1")


async def lease(
    r: Any,
    store: BucketStore,
    run: str,
    spec: RunSpec,
    versions: list[int],
    n: int,
    ttl_s: float,
    *,
    worker_id: str = "",
    request_id: str | None = None,
) -> EvalLease:
    """Up to ``n`` eval prompts of the oldest of ``versions`` (the caller's loaded ones) still being evaluated.

    ``request_id``: a replay of a lease answers the prompts its first attempt leased (for ``ttl_s``)."""
    if spec.eval is None:
        return EvalLease()
    await ensure_loaded(r, store, run)
    latest = int(await r.hget(keys.run_key(run, keys.STATE), "latest_version") or 0)
    request = _k(run, f"leasereq:{worker_id}:{request_id or '-'}")
    for v in sorted({v for v in versions if spec.eval.evaluates(v) and v <= latest}):
        got = await _LEASE(
            r,
            [_k(run, "results"), _k(run, f"v{v}:cursor"), _k(run, f"v{v}:leased"), _k(run, f"v{v}:done"), request],
            [v, repr(float(ttl_s)), n, spec.eval.size, 1 if request_id else 0],
        )
        if got:
            return EvalLease(items=[EvalLeaseItem(version=int(got[0]), index=int(i)) for i in got[1:]])
    return EvalLease()


def _increments(res: EvalResult, threshold: float) -> dict[str, float]:
    rewards = [s.reward for s in res.samples]
    scored = [x for x in rewards if x is not None]
    passed = sum(1 for x in scored if x >= threshold)
    return {
        "prompts": 1,
        "samples": len(rewards),
        "scored": len(scored),
        "reward_sum": sum(scored),
        "pass1_sum": passed / len(rewards),
        "passk": 1 if passed else 0,
        "length_sum": sum(s.length for s in res.samples),
        "unscorable": len(rewards) - len(scored),
    }


async def submit(r: Any, store: BucketStore, run: str, spec: RunSpec, results: list[EvalResult]) -> EvalSubmitResponse:
    """Count each prompt's result once; finish (bucket + results hash) every version this completes."""
    if spec.eval is None:
        return EvalSubmitResponse(accepted=0, duplicates=len(results))
    await ensure_loaded(r, store, run)
    size = spec.eval.size
    accepted = duplicates = 0
    complete: set[int] = set()
    for res in results:
        v = res.version
        flat: list[Any] = []
        for field, inc in _increments(res, spec.eval.pass_threshold).items():
            flat += [field, repr(float(inc))]
        added, done = await _SUBMIT(
            r,
            [_k(run, "results"), _k(run, f"v{v}:done"), _k(run, f"v{v}:sums"), _k(run, f"v{v}:leased")],
            [v, res.index, size, *flat],
        )
        if int(added):
            accepted += 1
        else:
            duplicates += 1
        if int(done) >= size:
            complete.add(v)
    for v in sorted(complete):
        await _finish(r, store, run, spec, v)
    return EvalSubmitResponse(accepted=accepted, duplicates=duplicates)


async def _finish(r: Any, store: BucketStore, run: str, spec: RunSpec, version: int) -> None:
    assert spec.eval is not None
    raw = await r.hgetall(_k(run, f"v{version}:sums"))
    sums = {(k.decode() if isinstance(k, bytes) else k): float(x) for k, x in raw.items()}
    prompts = max(sums.get("prompts", 0.0), 1.0)
    samples = max(sums.get("samples", 0.0), 1.0)
    scored = sums.get("scored", 0.0)
    res = EvalVersionResult(
        version=version,
        prompts=int(sums.get("prompts", 0.0)),
        samples=int(sums.get("samples", 0.0)),
        k=spec.eval.n,
        reward_mean=sums.get("reward_sum", 0.0) / scored if scored else None,
        pass_at_1=sums.get("pass1_sum", 0.0) / prompts,
        pass_at_k=sums.get("passk", 0.0) / prompts,
        mean_length=sums.get("length_sum", 0.0) / samples,
        unscorable_frac=sums.get("unscorable", 0.0) / samples,
        completed_at=time.time(),
    )
    # Bucket first: once the results hash says "done", a Redis wipe must find it in the bucket.
    await asyncio.to_thread(store.put_bytes, result_key(run, version), res.model_dump_json().encode())
    if await r.hsetnx(_k(run, "results"), str(version), res.model_dump_json()):
        await r.delete(*(_k(run, f"v{version}:{s}") for s in ("cursor", "leased", "done", "sums")))


async def results(r: Any, store: BucketStore, run: str) -> list[EvalVersionResult]:
    """Every evaluated version, oldest first."""
    await ensure_loaded(r, store, run)
    raw = await r.hgetall(_k(run, "results"))
    out = [EvalVersionResult.model_validate_json(v) for v in raw.values()]
    return sorted(out, key=lambda x: x.version)
