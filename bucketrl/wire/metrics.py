"""Metrics a worker pushes; the push doubles as its heartbeat."""

import math

from pydantic import Field, field_validator

from bucketrl.wire.common import MAX_LOADED_VERSIONS, LeaseId, ShortStr, Version, WireInt, WireModel, WorkerId
from bucketrl.wire.cost import GPU_CLASS_PATTERN
from bucketrl.wire.leases import PromptLease, VersionLease


class Renewals(WireModel):
    """Leases a heartbeat renews (issue 21: the keeper's renewals ride on the push it makes anyway), as POST
    leases/{id}/renew and POST prompts/renew would; renewing is idempotent, so a replayed push renews again."""

    version_leases: list[LeaseId] = Field(default_factory=list, max_length=64)
    version_ttl_s: float = Field(60.0, gt=0.0, le=3600.0)
    prompt_ids: list[ShortStr] = Field(default_factory=list, max_length=4096, fail_fast=True)
    prompt_ttl_s: float = Field(300.0, gt=0.0, le=86_400.0)


class DrainRequest(WireModel):
    """``POST /v1/runs/{run}/workers/{worker_id}/drain`` (issue 25): the worker will be reclaimed in ``notice_s``
    (a spot-notice watcher's call). It stops taking work, finishes what completes in time, hands the rest back."""

    notice_s: float = Field(..., gt=0.0, le=3600.0)


class DrainNotice(WireModel):
    """A pending drain: the answer to the drain call, and carried by the worker's next heartbeat answer."""

    worker_id: WorkerId
    # Seconds left of the notice when this was sent (the proxy's clock: no clock skew between machines).
    notice_s: float = Field(..., ge=0.0, le=3600.0)


class Renewed(WireModel):
    """What a push's :class:`Renewals` renewed (200; a push without renewals is answered 204 unless a drain is
    pending for the worker, which is then answered 200 with ``drain`` and nothing renewed)."""

    # lease_id -> the renewed lease, or null when it had expired (410 lease_expired on its own route).
    versions: dict[str, VersionLease | None] = Field(default_factory=dict)
    # The prompt leases renewed (those the worker still held); empty when it held none of them.
    prompts: PromptLease | None = None
    # A drain pending for the pushing worker (issue 25): it winds down within ``drain.notice_s``.
    drain: DrainNotice | None = None


class SampleCompletion(WireModel):
    """One generated completion as text, for people watching the run (the dashboard's samples table)."""

    version: int = Field(..., ge=0)
    prompt: str = Field(..., max_length=2000)
    completion: str = Field(..., max_length=4000)
    reward: float | None = None

    @field_validator("reward")
    @classmethod
    def _finite_reward(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("reward must be finite or null")
        return v


class MetricsPush(WireModel):
    worker_id: WorkerId
    step: WireInt | None = None
    metrics: dict[str, float] = Field(default_factory=dict, max_length=512)
    # Generators report the adapter versions resident in their engine (delivery is loud).
    loaded_versions: list[Version] | None = Field(None, max_length=MAX_LOADED_VERSIONS, fail_fast=True)
    # What the worker is doing (loading model, waiting for the first version, generating, training, stopped:
    # configuration error, ...) and short messages for people (the first reward error of each kind, a
    # configuration error): shown by `bucketrl status`, the dashboard and `bucketrl up`'s live view.
    # Generators: a few recent completions with their rewards (the proxy keeps the run's latest SAMPLES_KEPT).
    samples: list[SampleCompletion] | None = Field(None, max_length=8)
    phase: str | None = Field(None, max_length=64)
    notes: dict[str, str] = Field(default_factory=dict, max_length=16)
    # Replays: the pushing process (``session``) numbers its pushes (``seq``, increasing); a push whose seq is not
    # above the last one recorded for that worker and session (a retry, or a late push after a newer one) is
    # answered 204 and recorded no more: no duplicate points, no step or loaded versions going back.
    session: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    seq: int | None = Field(None, ge=1, le=2**53)
    # What the worker runs on and what an hour of it costs (docs/cost.md); a push without them keeps the last
    # declared. usd_per_hour null: the proxy prices the class from its table (BUCKETRL_PRICES).
    gpu_class: str | None = Field(None, pattern=GPU_CLASS_PATTERN)
    usd_per_hour: float | None = Field(None, ge=0.0, le=10_000.0)
    renew: Renewals | None = Field(
        None, description="Leases to renew with this push (the answer is then 200 with what was renewed)."
    )

    @field_validator("notes")
    @classmethod
    def _short_notes(cls, v: dict[str, str]) -> dict[str, str]:
        for name, text in v.items():
            if not (1 <= len(name) <= 64) or len(text) > 1000:
                raise ValueError(f"note {name[:40]!r}: names are 1..64 characters, texts at most 1000")
        return v

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
