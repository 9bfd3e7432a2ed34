"""Evaluation during training: eval prompt leases and results (generators -> proxy), per-version results."""

import math

from pydantic import Field, field_validator

from bucketrl.wire.common import RequestId, WireModel, WorkerId


class EvalLeaseRequest(WireModel):
    worker_id: WorkerId
    # The adapter versions the caller has loaded: it is given eval prompts of one of them.
    versions: list[int] = Field(..., min_length=1, max_length=256)
    n: int = Field(8, ge=1, le=1024)
    ttl_s: float = Field(120.0, ge=1.0, le=3600.0)
    request_id: RequestId | None = Field(
        None,
        description="Unique per lease, the same on its retries: a replay answers the prompts the first attempt "
        "leased instead of leasing more.",
    )


class EvalLeaseItem(WireModel):
    version: int
    index: int


class EvalLease(WireModel):
    # Empty: nothing to evaluate for the caller's versions right now.
    items: list[EvalLeaseItem] = Field(default_factory=list)


class EvalSample(WireModel):
    # None: the reward function could not score it.
    reward: float | None
    length: int = Field(..., ge=0)

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("reward must be finite or null")
        return v


class EvalResult(WireModel):
    version: int = Field(..., ge=1)
    index: int = Field(..., ge=0)
    samples: list[EvalSample] = Field(..., min_length=1, max_length=64)


class EvalSubmit(WireModel):
    worker_id: WorkerId
    results: list[EvalResult] = Field(..., min_length=1, max_length=1024)


class EvalSubmitResponse(WireModel):
    accepted: int
    # Results for prompts already counted (a retried submit, a lease that expired and was done twice).
    duplicates: int = 0


class EvalVersionResult(WireModel):
    """One evaluated version (``runs/{run}/eval/v{version}.json`` in the bucket)."""

    version: int
    prompts: int
    samples: int
    k: int
    reward_mean: float | None
    pass_at_1: float
    pass_at_k: float
    mean_length: float
    unscorable_frac: float
    completed_at: float
