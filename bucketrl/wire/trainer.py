"""Trainer registration: the fencing epoch."""

from pydantic import Field

from bucketrl.wire.common import RequestId, WireModel, WorkerId


class TrainerRegisterRequest(WireModel):
    worker_id: WorkerId
    request_id: RequestId | None = Field(
        None,
        description="Unique per registration, the same on its retries: a replay answers the epoch its first "
        "attempt took instead of taking a newer one (which would fence the trainer that sent it).",
    )


class TrainerRegistration(WireModel):
    epoch: int
    latest_version: int
    latest_checkpoint_step: int | None = None
