"""Trainer registration: the fencing epoch."""

from bucketrl.wire.common import WireModel, WorkerId


class TrainerRegisterRequest(WireModel):
    worker_id: WorkerId


class TrainerRegistration(WireModel):
    epoch: int
    latest_version: int
    latest_checkpoint_step: int | None = None
