"""Trainer registration: the fencing epoch."""

from pydantic import Field

from bucketrl.wire.common import WireModel, WorkerId


class TrainerRegisterRequest(WireModel):
    worker_id: WorkerId
    request_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="Unique per registration, the same on its retries: a replay answers the epoch its first "
        "attempt took instead of taking a newer one (which would fence the trainer that sent it).",
    )


class TrainerRegistration(WireModel):
    epoch: int
    latest_version: int
    latest_checkpoint_step: int | None = None
