"""Rollout batches (generator -> proxy) and deliveries (proxy -> trainer)."""

import math
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from bucketrl.wire.common import (
    MAX_COMPLETION_TOKENS,
    MAX_PROMPT_TOKENS,
    LeaseId,
    RequestId,
    Version,
    WireInt,
    WireModel,
    WorkerId,
)
from bucketrl.wire.runs import SamplingSpec

FinishReason = Literal["stop", "length", "abort"]


class Completion(WireModel):
    # At most the batch's sampling.max_new_tokens (checked per run in validate_batch); this is the static cap.
    token_ids: list[int] = Field(..., min_length=1, max_length=MAX_COMPLETION_TOKENS, fail_fast=True)
    # logprobs[i] is the behaviour logprob of token_ids[i] (temperature applied before log-softmax).
    logprobs: list[float] = Field(..., min_length=1, max_length=MAX_COMPLETION_TOKENS, fail_fast=True)
    # None = the reward function could not score this completion.
    reward: float | None
    finish_reason: FinishReason = "stop"

    @model_validator(mode="after")
    def _consistent(self) -> "Completion":
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"logprobs has {len(self.logprobs)} entries but token_ids has {len(self.token_ids)}")
        if not _all_finite_non_positive(self.logprobs):
            for i, lp in enumerate(self.logprobs):  # the slow walk only to name the bad entry
                if not math.isfinite(lp) or lp > 0.0:
                    raise ValueError(f"logprobs[{i}] = {lp!r} is not a finite value <= 0")
        if min(self.token_ids) < 0:
            raise ValueError("token_ids must be >= 0")
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError("reward must be finite or null")
        return self


def _all_finite_non_positive(values: list[float]) -> bool:
    """True iff every value is finite and <= 0, in C-speed passes (this runs on every completion the proxy
    receives and the trainer claims: 8 x 256 values a group). A NaN or an infinity makes the sum non-finite
    (so does a sum overflowing, in which case the caller's exact walk decides); with none of them, ``max``
    orders the values correctly."""
    return math.isfinite(sum(values)) and max(values) <= 0.0


class RolloutGroup(WireModel):
    prompt_id: str = Field(..., min_length=1, max_length=200)
    prompt_index: WireInt
    prompt_token_ids: list[int] = Field(..., min_length=1, max_length=MAX_PROMPT_TOKENS, fail_fast=True)
    # Exactly the run's group_size (checked per run); 1024 is group_size's upper bound.
    completions: list[Completion] = Field(..., min_length=1, max_length=1024, fail_fast=True)
    # Why completions have ``reward: null``: the first message of each failure kind in this group
    # (exception, timeout, non_numeric, non_finite, none). The trainer counts and reports them.
    reward_errors: dict[str, str] = Field(default_factory=dict, max_length=8)

    @field_validator("reward_errors")
    @classmethod
    def _short_messages(cls, v: dict[str, str]) -> dict[str, str]:
        return {k[:32]: m[:500] for k, m in v.items()}

    @field_validator("prompt_token_ids")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if v and min(v) < 0:  # an empty list is refused by min_length, with its own message
            raise ValueError("prompt_token_ids must be >= 0")
        return v

    def max_token_id(self) -> int:
        return max([*self.prompt_token_ids, *(t for c in self.completions for t in c.token_ids)])


class RolloutBatch(WireModel):
    worker_id: WorkerId
    lease_id: LeaseId
    version: Version
    # At most the run's queue_capacity_groups (checked per run); 4096 is a prompt lease's upper bound.
    groups: list[RolloutGroup] = Field(..., min_length=1, max_length=4096, fail_fast=True)
    # The behaviour policy is the adapter version AND the sampling settings: the trainer recomputes each
    # group's logprobs with the settings it was sampled with, even after the run's spec changed them.
    sampling: SamplingSpec | None = Field(
        None,
        description="The sampling settings the groups were generated with (default: the run's at submit time).",
    )


class SubmitResponse(WireModel):
    batch_id: str
    accepted_groups: int
    # True when the Idempotency-Key was seen before: nothing new was enqueued.
    duplicate: bool = False


class ClaimRequest(WireModel):
    consumer: WorkerId
    max_groups: int = Field(8, ge=1, le=4096)
    wait_s: float = Field(0.0, ge=0.0, le=300.0)
    # Drop groups older than this too (dropped and counted like every stale group): the trainer passes the
    # version its policy will have when it trains on this claim, minus max_staleness. It claims ahead and
    # publishes asynchronously, so that version can be ahead of the proxy's latest; without this floor a group
    # that passed ``latest - max_staleness`` at claim time could be trained with a staleness > max_staleness.
    min_version: WireInt | None = Field(
        None,
        description="Drop groups older than this too (counted in dropped_stale): the trainer passes the version "
        "its policy will have when it trains on this claim, minus max_staleness.",
    )
    # Pacing: the proxy's admission control predicts from these the version a group leased now is trained with.
    train_version: Version | None = Field(
        None,
        description="The policy version the trainer will train this claim's groups with (admission control uses it "
        "to pace prompt leases so that their groups are trained within max_staleness).",
    )
    sync_every: int = Field(1, ge=1, le=1_000_000, description="The trainer publishes a version every N steps.")
    # Exactly-once: a retry of a claim whose answer was lost carries the same request_id and gets the same
    # deliveries again (a claim's deliveries are never redelivered to the epoch that holds them).
    request_id: RequestId | None = Field(
        None,
        description="Unique per claim, the same on its retries: a replay answers the first attempt's deliveries.",
    )
    release: list[str] = Field(
        default_factory=list,
        max_length=4096,
        description="Delivery ids this trainer gives back untrained (held back as too stale): claimable again now.",
    )


class Delivery(WireModel):
    delivery_id: str
    version: int
    groups: list[RolloutGroup]
    worker_id: str = ""
    batch_id: str = ""
    # How many times this delivery was handed out (1 = first delivery).
    attempt: int = 1
    # The sampling settings the group was generated with (None: recorded by an older proxy; use the run's).
    sampling: SamplingSpec | None = None


class ClaimResponse(WireModel):
    deliveries: list[Delivery]
    dropped_stale: int = 0
    # Exactly-once acks across a Redis wipe: a rebuild re-queues groups the trainer may have trained already
    # (unacked until its checkpoint, or acked after the last snapshot). When such a re-queued group is dropped
    # as stale, its id is listed here; a trainer that trained it acks it (the ack moves it from dropped to acked).
    dropped_rebuilt: list[str] = Field(
        default_factory=list,
        description="Ids of re-queued (rebuilt after a Redis wipe) deliveries dropped as stale by this claim: "
        "a trainer that already trained one acks it, and it is then counted acked, not dropped.",
    )


class AckRequest(WireModel):
    # A delivery id is "b<32 hex>:<group>" (40 characters at most); 100,000 of them is ~4.3 MB of JSON.
    delivery_ids: list[Annotated[str, StringConstraints(max_length=64)]] = Field(
        ..., max_length=100_000, fail_fast=True
    )


class AckResponse(WireModel):
    acked: int
