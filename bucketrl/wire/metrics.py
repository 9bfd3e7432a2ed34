"""Metrics a worker pushes; the push doubles as its heartbeat."""

import math

from pydantic import Field, field_validator

from bucketrl.wire.common import WireModel, WorkerId


class MetricsPush(WireModel):
    worker_id: WorkerId
    step: int | None = Field(None, ge=0)
    metrics: dict[str, float] = Field(default_factory=dict, max_length=512)
    # Generators report the adapter versions resident in their engine (delivery is loud).
    loaded_versions: list[int] | None = None

    @field_validator("metrics")
    @classmethod
    def _finite(cls, v: dict[str, float]) -> dict[str, float]:
        for name, value in v.items():
            if not (1 <= len(name) <= 128):
                raise ValueError(f"metric name {name[:40]!r} must be 1..128 characters")
            if not math.isfinite(value):
                raise ValueError(f"metric {name!r} = {value!r} is not finite")
        return v


class MetricsRecord(WireModel):
    """One stored push, as ``GET /v1/runs/{run}/metrics/recent`` returns them (oldest first)."""

    worker_id: str
    role: str
    ts: float
    step: int | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
