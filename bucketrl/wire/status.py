"""The run status a viewer reads (``GET /v1/runs/{run}/status``)."""

from typing import Any

from pydantic import Field

from bucketrl.wire.common import WireModel
from bucketrl.wire.cost import RunCost
from bucketrl.wire.evals import EvalVersionResult
from bucketrl.wire.metrics import SampleCompletion
from bucketrl.wire.pool import RunPoolStatus


class VersionStatus(WireModel):
    version: int
    leases: int
    published_at: float


class QueueStatus(WireModel):
    groups: int
    capacity: int
    pending: int = 0
    accepted_total: int = 0
    acked_total: int = 0
    dropped_stale_total: int = 0
    rejected_stale_total: int = 0
    backpressure_total: int = 0
    # Accepted groups whose batch object vanished from the bucket (0 unless something deleted it behind the
    # proxy's back). accepted_total == acked_total + dropped_stale_total + lost_total + groups + pending.
    lost_total: int = 0


class WorkerStatus(WireModel):
    worker_id: str
    role: str
    loaded_versions: list[int] = Field(default_factory=list)
    last_seen_s: float
    phase: str | None = None
    notes: dict[str, str] = Field(default_factory=dict)
    # What it declared it runs on (docs/cost.md) and the seconds it has been up (between its pushes).
    gpu_class: str | None = None
    usd_per_hour: float | None = None
    up_s: float = 0.0


class TrainerStatus(WireModel):
    epoch: int
    step: int


class RunStatus(WireModel):
    run: str
    latest_version: int
    versions: list[VersionStatus]
    queue: QueueStatus
    prompts_inflight: int
    workers: list[WorkerStatus]
    trainer: TrainerStatus
    # Latest value of each metric per worker: {worker_id: {name: value}} plus "_step".
    metrics: dict[str, Any] = Field(default_factory=dict)
    gc_versions_total: int = 0
    prompt_cursor: int = 0
    # Evaluation during training: every evaluated version, oldest first.
    eval: list[EvalVersionResult] = Field(default_factory=list)
    # Recent completions with their rewards, newest first (generators push them with their metrics).
    samples: list[SampleCompletion] = Field(default_factory=list)
    # What the run has cost so far, with throughput per GPU class (docs/cost.md); null from an older proxy.
    cost: RunCost | None = None
    # The run's place in the generator pool (docs/pool.md): share, tokens generated, pause, budget.
    pool: RunPoolStatus | None = None
