"""The rollout queue over HTTP: generators submit group batches, the trainer claims and acks them.

``POST /v1/runs/{run}/rollouts``        generator  submit (JSON or msgpack, ``Idempotency-Key``) -> 202; may lease
                                                   the next prompts
``POST /v1/runs/{run}/rollouts/claim``  trainer    claim up to ``max_groups`` (long-poll ``wait_s``), fenced; may
                                                   carry the previous claim's ack
``POST /v1/runs/{run}/rollouts/ack``    trainer    acknowledge delivery ids (idempotent), fenced

The logic and its invariants live in ``bucketrl.proxy.state.queue`` and its stage modules (``submit``,
``claim``, ``ack``). This module also adds a scrape-time refresh of the queue-depth gauge
(``Telemetry.scrape_hooks``, added per app on first use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request, Response

from bucketrl import errors
from bucketrl.proxy import body, rollout_body
from bucketrl.proxy.deps import (
    CtxDep,
    EpochDep,
    EpochHeaderDep,
    GeneratorRole,
    RunDep,
    RunId,
    TrainerRole,
    resolve_run,
    resolve_run_and_epoch,
)
from bucketrl.proxy.errors import responses
from bucketrl.proxy.routes import prompts as prompt_routes
from bucketrl.proxy.state import accounting, runs
from bucketrl.proxy.state import ack as ack_stage
from bucketrl.proxy.state import claim as claim_stage
from bucketrl.proxy.state import submit as submit_stage
from bucketrl.proxy.state.queue import SpecLoader
from bucketrl.wire import (
    AckRequest,
    AckResponse,
    ClaimRequest,
    ClaimResponse,
    PromptLease,
    PromptLeaseRequest,
    RolloutBatch,
    RunSpec,
    SubmitResponse,
)


async def _scrape_queue_depth(ctx: Any) -> None:
    for run in await runs.list_runs(ctx.redis):
        spec = await runs.get_spec(ctx.redis, run)
        if spec is not None:
            st = await accounting.queue_status(ctx.redis, run, spec)
            ctx.telemetry.queue_depth.labels(run=run).set(st.groups + st.pending)


def _install_scrape_hook(ctx: Any) -> None:
    # Telemetry is per app; the first queue request on an app adds the refresher (idempotent). Called by
    # each route (a router dependency would cost a dependency solve on every request).
    if _scrape_queue_depth not in ctx.telemetry.scrape_hooks:
        ctx.telemetry.scrape_hooks.append(_scrape_queue_depth)


router = APIRouter(prefix="/v1/runs/{run}/rollouts", tags=["rollouts"])

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        description="Unique per batch (1..200 visible ASCII). A retry with the same key is a no-op that answers "
        "the first batch_id with duplicate=true.",
    ),
]


@router.post(
    "",
    status_code=202,
    response_model=SubmitResponse,
    summary="Submit a batch of complete groups (JSON or msgpack); Idempotency-Key required.",
    description=(
        "msgpack bodies may carry numeric arrays (token ids, logprobs) packed: a msgpack ext object of type 17 "
        "(little-endian int32), 18 (float32) or 19 (float64) in place of the list (`bucketrl.wire.packed`). "
        "Validated (422 naming the field: token ids < vocab_size, logprobs finite and <= 0 and one per token, "
        "exactly group_size completions per group, prompt ids that were leased, version <= latest, the version "
        "lease's version), then written to the bucket, then enqueued atomically. 409 `stale` when version < latest - "
        "max_staleness; 429 + Retry-After when the queue is at queue_capacity_groups. Accepting a group completes "
        "its prompt. A batch with `next_prompts` also leases prompts once accepted (one request per call instead of "
        "two): the answer's `prompts` (empty under admission control, with `prompts_retry_after`; null if not leased)."
    ),
    responses=responses(401, 403, 404, 409, 413, 415, 422, 429, 503),
    openapi_extra=body.openapi_body(RolloutBatch),
)
async def submit(
    ctx: CtxDep,
    _: GeneratorRole,
    run: RunId,
    submitted: Annotated[rollout_body.SubmittedBatch, Depends(rollout_body.decoded)],
    idempotency_key: IdempotencyKey = None,
) -> SubmitResponse:
    _install_scrape_hook(ctx)
    # The spec comes with the queue's pre-check (one round trip); resolve_run only for an unknown run.
    answer = await submit_stage.submit(
        ctx.redis,
        ctx.store,
        run,
        _spec_loader(ctx, run),
        submitted.batch,
        idempotency_key,
        submitted.groups_msgpack,
        submitted.digest,
    )
    nxt = submitted.batch.next_prompts
    if nxt is None:
        return answer
    return await _with_next_prompts(ctx, run, answer, nxt)


async def _with_next_prompts(ctx: Any, run: str, answer: SubmitResponse, req: PromptLeaseRequest) -> SubmitResponse:
    """The accepted submit's answer with the prompts its batch asked to lease (``RolloutBatch.next_prompts``).

    The batch is committed by now, so nothing here may turn its 202 into an error: a refused or failed lease
    answers ``prompts`` empty (admission control, with its Retry-After) or null (anything else: the worker
    leases on its own). A replay (same Idempotency-Key, same body) carries the same request_id and so answers
    the prompts its first attempt leased, as a replayed lease does."""
    req = req.model_copy(update={"wait_s": 0.0})  # never hold a submit's answer back for admission
    try:
        lease = await prompt_routes.lease_cached(ctx, await prompt_routes.spec_of(ctx, run), req)
    except errors.Backpressure as exc:
        return answer.model_copy(
            update={"prompts": PromptLease(prompts=[], expires_at=0.0), "prompts_retry_after": exc.retry_after}
        )
    except errors.BucketRLError:
        return answer
    return answer.model_copy(update={"prompts": lease})


@router.post(
    "/claim",
    response_model=ClaimResponse,
    summary="Claim up to max_groups groups (long-poll wait_s); stale groups are dropped and counted.",
    description=(
        "Redeliveries (claimed but unacked for redelivery_timeout_s, or claimed under an older trainer epoch) come "
        "first, then new groups, oldest first. Each delivery holds one group and a stable delivery_id to ack. A group "
        "whose version < max(latest - max_staleness, min_version) is dropped (`dropped_stale` in the answer and in the "
        "run's counters; min_version is optional: the trainer's floor for the version it will train with). "
        "train_version and sync_every (optional) tell admission control the trainer's pace. "
        "Epoch-fenced: X-Trainer-Epoch must be the current epoch (409 `fenced`). With `Accept: application/msgpack` "
        "the answer is msgpack, its numeric arrays packed as in a submit (the groups as they were submitted). "
        "`ack` acknowledges delivery ids first, as POST rollouts/ack does (one request per claim instead of two): "
        "the answer's `acked` counts them."
    ),
    responses={
        200: {"content": {claim_stage.MSGPACK: {"schema": {"$ref": "#/components/schemas/ClaimResponse"}}}},
        **responses(401, 403, 404, 409, 413, 422, 503),
    },
    openapi_extra=body.openapi_body(ClaimRequest),
)
async def claim(
    request: Request,
    ctx: CtxDep,
    _: TrainerRole,
    ref: RunDep,
    epoch: EpochDep,
    req: Annotated[ClaimRequest, Depends(body.decoded(ClaimRequest))],
) -> Response:
    _install_scrape_hook(ctx)
    acked: int | None = None
    if req.ack:  # the previous claim's ack, first (a replay acks nothing more: counted 0, as a second ack)
        acked = await ack_stage.ack(
            ctx.redis, ctx.store, ref.run, ref.spec, epoch=epoch, delivery_ids=req.ack, cleaner=ctx.cleaner
        )
    out = await claim_stage.claim(
        ctx.redis,
        ctx.store,
        ref.run,
        ref.spec,
        epoch=epoch,
        consumer=req.consumer,
        max_groups=req.max_groups,
        wait_s=min(req.wait_s, ctx.settings.max_wait_s),
        redelivery_timeout_s=ctx.settings.redelivery_timeout_s,
        min_version=req.min_version,
        train_version=req.train_version,
        sync_every=req.sync_every,
        cleaner=ctx.cleaner,
        request_id=req.request_id,
        release=req.release,
        hold_rebuilt=req.hold_rebuilt,
    )
    if acked is not None:
        out = _Acked(out.claimed, out.dropped, out.lost, out.dropped_rebuilt, acked=acked)
    # The answer spliced from the groups' stored bytes (response_model above documents it): decoding 8 x 256
    # tokens and logprobs per group only to encode them again was most of a claim's CPU.
    if claim_stage.MSGPACK in request.headers.get("accept", ""):
        return Response(out.response_msgpack(), media_type=claim_stage.MSGPACK)
    return Response(out.response_json(), media_type="application/json")


@dataclass
class _Acked(claim_stage.ClaimOutcome):
    """A claim's outcome whose answer also says how many of the claim's ``ack`` were acked."""

    acked: int = 0

    def _envelope(self) -> ClaimResponse:
        return super()._envelope().model_copy(update={"acked": self.acked})


@router.post(
    "/ack",
    response_model=AckResponse,
    summary="Acknowledge delivery ids (trained); idempotent. `acked` counts the ids acked by this call.",
    description=(
        "Unknown or already acked ids count 0. When every group of a batch is settled, its bucket object is "
        "deleted (a rebuild cannot enqueue it again). Epoch-fenced (409 `fenced`)."
    ),
    responses=responses(401, 403, 404, 409, 413, 422, 503),
    openapi_extra=body.openapi_body(AckRequest),
)
async def ack(
    ctx: CtxDep,
    _: TrainerRole,
    run: RunId,
    epoch: EpochHeaderDep,
    req: Annotated[AckRequest, Depends(body.decoded(AckRequest))],
) -> AckResponse:
    _install_scrape_hook(ctx)
    if not req.delivery_ids:  # nothing for the script to fence: the run and epoch are checked here
        _ref, current = await resolve_run_and_epoch(ctx, run)
        runs.check_epoch(run, epoch, current)
    # The ack script fences the epoch atomically; the spec is needed only to restore a wiped queue or to
    # persist prompts, so it is looked up only then (one round trip less per ack).
    n = await ack_stage.ack(
        ctx.redis,
        ctx.store,
        run,
        _spec_loader(ctx, run),
        epoch=epoch,
        delivery_ids=req.delivery_ids,
        cleaner=ctx.cleaner,
    )
    return AckResponse(acked=n)


def _spec_loader(ctx: Any, run: str) -> SpecLoader:
    async def load() -> RunSpec:
        return (await resolve_run(ctx, run)).spec

    return load
