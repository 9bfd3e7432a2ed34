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


class StagedUpload(WireModel):
    """An adapter upload under way at the home proxy, its bytes readable by a relay before its commit."""

    run: str
    version: int = Field(..., ge=1)
    upload_id: str = Field(..., pattern=r"^[0-9a-f]{32}$")
    sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$")  # what the trainer declared; the relay checks it
    bytes: int = Field(..., ge=0)
    seq: int = Field(..., ge=1)


class StagingList(WireModel):
    """The answer to a relay's long-poll for staged uploads: those after its ``after`` (in this ``instance``)."""

    instance: str  # the proxy process: a restarted one counts its uploads from 1 again
    seq: int = Field(..., ge=0)  # the last upload staged here; the relay's next ``after``
    uploads: list[StagedUpload] = Field(default_factory=list)
