"""Prices and the live cost of a run (issue 25; docs/cost.md defines every figure).

The default prices are ESTIMATES: public on-demand list prices (late 2025) of one GPU (or a small CPU instance) per
hour, of object-storage requests and of internet egress. Every one is overridable (``BUCKETRL_PRICES``) and a
worker may declare its own hourly price (``BUCKETRL_USD_PER_HOUR``), which then wins over the table.
"""

from __future__ import annotations

import re

from pydantic import ConfigDict, Field, field_validator

from bucketrl.wire.common import WireModel

# USD per hour of one accelerator of the class, on demand, from public price lists (GPU clouds such as Lambda and
# RunPod for the data-centre GPUs; AWS g5/g6/g4dn single-GPU instances for a10g, l4 and t4; a 4-vCPU instance
# for cpu). Estimates: spot, reserved and negotiated prices are lower, hyperscaler 8-GPU instances higher.
DEFAULT_GPU_USD_PER_HOUR: dict[str, float] = {
    "h200": 3.79,
    "h100": 2.99,
    "a100": 1.79,
    "l40s": 1.19,
    "a10g": 1.01,
    "l4": 0.80,
    "t4": 0.53,
    "cpu": 0.17,
    # A worker that declares no class and whose class could not be detected costs nothing: the cost shows it
    # (``workers`` by class) rather than inventing a price.
    "unknown": 0.0,
}
# S3 Standard list prices per 1,000 requests: PUT, POST, LIST; and GET, HEAD.
DEFAULT_USD_PER_1K_REQUESTS = 0.005
DEFAULT_USD_PER_1K_READS = 0.0004
# AWS internet egress, first 10 TB per month, per GB.
DEFAULT_USD_PER_GB_EGRESS = 0.09

GPU_CLASS_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,31}$"


class Prices(WireModel):
    """The prices a cost is computed with. Overrides merge into the default table class by class."""

    # Refuse a misspelt field: a price silently ignored would make every figure quietly wrong.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    gpu_usd_per_hour: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_GPU_USD_PER_HOUR))
    usd_per_1k_requests: float = Field(DEFAULT_USD_PER_1K_REQUESTS, ge=0.0)  # bucket writes and listings
    usd_per_1k_reads: float = Field(DEFAULT_USD_PER_1K_READS, ge=0.0)
    # The proxy -> workers link (adapters, checkpoints, datasets served): internet egress when workers are elsewhere.
    usd_per_gb_egress: float = Field(DEFAULT_USD_PER_GB_EGRESS, ge=0.0)
    # The bucket -> proxy link: free with the proxy in the bucket's region; set it when the bucket is elsewhere.
    usd_per_gb_bucket_egress: float = Field(0.0, ge=0.0)
    estimate: bool = Field(
        True,
        description="Whether the prices are estimates: true for the defaults; whoever sets real prices says false.",
    )

    @field_validator("gpu_usd_per_hour")
    @classmethod
    def _merged(cls, v: dict[str, float]) -> dict[str, float]:
        for name, price in v.items():
            if not re.match(GPU_CLASS_PATTERN, name):
                raise ValueError(f"GPU class {name[:40]!r}: lower-case letters, digits, '_', '.', '-' (1..32)")
            if not price >= 0.0:  # also refuses NaN
                raise ValueError(f"gpu_usd_per_hour[{name!r}] = {price!r}: a price is a number >= 0")
        return {**DEFAULT_GPU_USD_PER_HOUR, **v}

    def gpu_price(self, gpu_class: str) -> float:
        return self.gpu_usd_per_hour.get(gpu_class, self.gpu_usd_per_hour.get("unknown", 0.0))


class ClassUsage(WireModel):
    """One GPU class of the run: time its workers were up, what they cost and their throughput per worker."""

    gpu_class: str
    role: str
    workers_live: int = 0
    worker_s: float = 0.0
    idle_s: float = 0.0
    usd: float = 0.0
    # Per worker of the class, over the live workers' up time: comparable across classes.
    tokens_per_s: float | None = None
    groups_per_s: float | None = None


class RunCost(WireModel):
    """The run's cost so far (``status.cost``); every ``usd_per_*`` is null until its denominator is > 0."""

    usd_total: float = 0.0
    usd_gpu: float = 0.0
    usd_requests: float = 0.0
    usd_egress: float = 0.0
    usd_per_step: float | None = None
    usd_per_trained_token: float | None = None
    usd_per_accepted_group: float | None = None
    waste_usd: float = 0.0
    waste_fraction: float = 0.0
    trainer_steps: int = 0
    trained_tokens: float = 0.0
    accepted_groups: int = 0
    wasted_groups: int = 0
    bucket_requests: int = 0  # writes and listings
    bucket_reads: int = 0
    egress_gb: float = 0.0  # the proxy -> workers link
    bucket_egress_gb: float = 0.0  # the bucket -> proxy link
    classes: list[ClassUsage] = Field(default_factory=list)
    prices: Prices = Field(default_factory=Prices)
