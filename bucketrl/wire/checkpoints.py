"""Checkpoint metadata."""

from pydantic import Field

from bucketrl.wire.common import WireModel


class CheckpointInfo(WireModel):
    step: int = Field(..., ge=0)
    sha256: str
    bytes: int
    created_at: float
    epoch: int = 0
