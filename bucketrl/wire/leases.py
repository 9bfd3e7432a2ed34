"""Version leases (keep an adapter from garbage collection) and prompt leases (work items)."""

from pydantic import Field

from bucketrl.wire.common import LeaseId, WireModel, WorkerId


class VersionLeaseRequest(WireModel):
    worker_id: WorkerId
    # None means "the latest published version".
    version: int | None = Field(None, ge=1)
    ttl_s: float = Field(60.0, gt=0.0, le=3600.0)


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


class PromptLeaseItem(WireModel):
    prompt_id: str
    index: int = Field(..., ge=0)
    pass_: int = Field(..., ge=0, alias="pass")


class PromptLease(WireModel):
    prompts: list[PromptLeaseItem]
    expires_at: float


class PromptReleaseRequest(WireModel):
    """Give prompts back before their lease expires (graceful shutdown) or extend them (renew)."""

    worker_id: WorkerId
    prompt_ids: list[str] = Field(..., max_length=4096)
    ttl_s: float = Field(300.0, gt=0.0, le=86_400.0)
