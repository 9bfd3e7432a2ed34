"""Version leases (keep an adapter from garbage collection) and prompt leases (work items)."""

from pydantic import Field

from bucketrl.wire.common import LeaseId, RequestId, ShortStr, Version, WireInt, WireModel, WorkerId


class VersionLeaseRequest(WireModel):
    worker_id: WorkerId
    # None means "the latest published version".
    version: Version | None = None
    ttl_s: float = Field(60.0, gt=0.0, le=3600.0)
    request_id: RequestId | None = Field(
        None,
        description="Unique per lease, the same on its retries: a replay answers the lease the first attempt "
        "created (same lease_id, version and expiry) instead of creating a second one.",
    )


class VersionLease(WireModel):
    lease_id: LeaseId
    version: int
    expires_at: float


class LeaseRenewRequest(WireModel):
    ttl_s: float = Field(60.0, gt=0.0, le=3600.0)


class PromptLeaseRequest(WireModel):
    worker_id: WorkerId
    n: int = Field(1, ge=1, le=4096)
    ttl_s: float = Field(300.0, gt=0.0, le=86_400.0)
    version: Version | None = Field(
        None,
        description="The policy version the caller will sample these prompts with (default: the latest). Admission "
        "control grants only prompts whose groups the trainer will reach within max_staleness of it.",
    )
    wait_s: float = Field(
        0.0,
        ge=0.0,
        le=60.0,
        description="Long-poll: wait up to this long for admission instead of answering 429 at once. A 429 after "
        "a wait carries Retry-After 0: retry straight away (with the version loaded meanwhile).",
    )
    request_id: RequestId | None = Field(
        None,
        description="Unique per lease, the same on its retries: a replay answers the prompts the first attempt "
        "leased (those the worker still holds) instead of leasing more.",
    )


class PromptLeaseItem(WireModel):
    prompt_id: str
    index: WireInt
    pass_: WireInt = Field(..., alias="pass")


class PromptLease(WireModel):
    prompts: list[PromptLeaseItem]
    expires_at: float
    # How long a long-polled lease waited for admission control (backpressure the caller felt).
    waited_s: float = 0.0


class PromptReleaseRequest(WireModel):
    """Give prompts back before their lease expires (graceful shutdown) or extend them (renew)."""

    worker_id: WorkerId
    prompt_ids: list[ShortStr] = Field(..., max_length=4096, fail_fast=True)
    ttl_s: float = Field(300.0, gt=0.0, le=86_400.0)
