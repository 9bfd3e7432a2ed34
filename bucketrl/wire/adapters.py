"""Adapter versions: the long-poll answer and adapter metadata."""

from pydantic import Field

from bucketrl.wire.common import WireModel
from bucketrl.wire.runs import ShippedDtype


class AdapterVersionInfo(WireModel):
    version: int = Field(..., ge=1)
    sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(..., ge=0)
    published_at: float
    # The dtype of the adapter's weights as stored and shipped (versions from before the field: float32).
    dtype: ShippedDtype = "float32"
