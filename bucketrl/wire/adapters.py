"""Adapter versions: the long-poll answer and adapter metadata."""

from pydantic import Field

from bucketrl.wire.common import WireModel


class AdapterVersionInfo(WireModel):
    version: int = Field(..., ge=1)
    sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(..., ge=0)
    published_at: float
