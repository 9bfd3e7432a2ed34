"""Runs: create/confirm a spec, read it, register a trainer (the fencing epoch)."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Response

from bucketrl.proxy import body, rebuild
from bucketrl.proxy.context import ProxyContext
from bucketrl.proxy.deps import AnyRole, CtxDep, RunDep, RunId, TrainerRole
from bucketrl.proxy.errors import responses
from bucketrl.proxy.state import checkpoints, claim, pool, runs
from bucketrl.storage import dirs
from bucketrl.wire import RunInfo, RunSpec, TrainerRegistration
from bucketrl.wire.trainer import TrainerRegisterRequest

log = logging.getLogger("bucketrl.proxy.runs")

router = APIRouter(prefix="/v1/runs", tags=["runs"])


def run_json_key(run: str) -> str:
    return f"runs/{run}/run.json"


@router.put(
    "/{run}",
    response_model=RunInfo,
    status_code=200,
    summary="Create (201) or confirm (200) a run spec; a changed immutable field is 409.",
    description=(
        "Same spec again: 200 and nothing changes. A change to a mutable field (max_staleness, sampling, reward, "
        "queue_capacity_groups, groups_per_step, loss, share, budget_tokens) is applied and answered 200. "
        "base_model, lora, adapter_dtype, group_size, vocab_size, dataset, env and partial_rollouts are immutable: "
        "409 `immutable_field`. The spec is "
        "also written to the bucket as "
        "`runs/{run}/run.json` (what a rebuild restores from)."
    ),
    responses={201: {"model": RunInfo, "description": "Run created."}, **responses(401, 403, 409, 413, 422, 503)},
    openapi_extra=body.openapi_body(RunSpec),
)
async def put_run(
    ctx: CtxDep,
    run: RunId,
    _: TrainerRole,
    spec: Annotated[RunSpec, Depends(body.decoded(RunSpec))],
    response: Response,
) -> RunInfo:
    if await runs.get_spec(ctx.redis, run) is None:
        # Redis may have lost a run the bucket still has: restore it (versions, checkpoints) before
        # deciding, so "create" can never restart version numbering over published adapters.
        await rebuild.rebuild_run_if_in_bucket(ctx, run)
    created, changed = await runs.put_spec(ctx.redis, run, spec)
    if created or changed or not await asyncio.to_thread(ctx.store.exists, run_json_key(run)):
        # The bound's marker before run.json: a rebuild that finds the spec finds the bound it raised.
        marker = runs.bound_marker_key(run, spec.sampling.max_new_tokens)
        await asyncio.to_thread(ctx.store.put_bytes, marker, b"")
        await _store_spec(ctx, run, spec)
    if created:
        response.status_code = 201
        log.info("run %s created", run)
    return RunInfo(
        run=run, spec=(await runs.get_spec(ctx.redis, run)) or spec, state=await runs.get_state(ctx.redis, run)
    )


async def _store_spec(ctx: ProxyContext, run: str, spec: RunSpec) -> None:
    """Write Redis' spec to ``run.json``, again while it changed meanwhile: a slow write of an older spec that
    lands after a newer one is followed by its writer's check, so the bucket never keeps the older spec (what a
    rebuild would restore)."""
    written = None
    stored = await runs.get_spec(ctx.redis, run) or spec
    while stored != written:
        await asyncio.to_thread(dirs.put_json, ctx.store, run_json_key(run), stored)
        written, stored = stored, await runs.get_spec(ctx.redis, run) or stored


@router.get(
    "/{run}",
    response_model=RunInfo,
    summary="The run's spec and state (latest version, trainer epoch and step).",
    responses=responses(401, 404, 422, 503),
)
async def get_run(ctx: CtxDep, _: AnyRole, ref: RunDep) -> RunInfo:
    return RunInfo(run=ref.run, spec=ref.spec, state=await runs.get_state(ctx.redis, ref.run))


@router.post(
    "/{run}/trainer",
    response_model=TrainerRegistration,
    summary="Register a trainer: a new, larger fencing epoch. Older epochs are fenced from now on.",
    description=(
        "Every later trainer write carries `X-Trainer-Epoch: <epoch>`; a write with an older epoch gets 409 `fenced`. "
        "Registration also makes every claimed-but-unacked rollout delivery immediately re-claimable."
    ),
    responses=responses(401, 403, 404, 413, 422, 503),
    openapi_extra=body.openapi_body(TrainerRegisterRequest, msgpack_too=False),
)
async def register_trainer(
    ctx: CtxDep,
    _: TrainerRole,
    ref: RunDep,
    req: Annotated[TrainerRegisterRequest, Depends(body.decoded(TrainerRegisterRequest))],
) -> TrainerRegistration:
    epoch, new = await runs.register_trainer_once(ctx.redis, ref.run, req.request_id)
    # Recorded in the bucket before the trainer may use it: a rebuild after a Redis wipe restores the epoch
    # from it even if this trainer has not published anything yet (else its writes would be "never issued").
    # A replay answers once the record exists (its first attempt's write may still be under way: it writes
    # the same bytes again rather than answer before the record is there).
    record = runs.epoch_record_key(ref.run, epoch)
    if new or not await asyncio.to_thread(ctx.store.exists, record):
        await asyncio.to_thread(ctx.store.put_bytes, record, req.worker_id.encode())
    if new:
        log.info("run %s: trainer %s registered with epoch %d", ref.run, req.worker_id, epoch)
    await claim.on_trainer_registered(ctx.redis, ref.run, epoch, ctx.settings.redelivery_timeout_s)
    if new and await pool.unfinish(ctx.redis, ref.run):  # a trainer again: it trains past its old max_steps
        await asyncio.to_thread(ctx.store.delete, [rebuild.paused_marker_key(ref.run)])
        log.info("run %s: finished no more (trainer %s registered)", ref.run, req.worker_id)
    return TrainerRegistration(
        epoch=epoch,
        latest_version=await runs.latest_version(ctx.redis, ref.run),
        latest_checkpoint_step=await checkpoints.latest_step(ctx.redis, ref.run),
    )
