"""An uploaded dataset (``PUT /v1/runs/{run}/dataset``): a JSONL file in the run's bucket prefix."""

from pydantic import Field

from bucketrl.wire.common import WireModel


class DatasetInfo(WireModel):
    sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(..., ge=0)
    # Non-empty lines, each a JSON object; prompt index i is row i.
    rows: int = Field(..., ge=0)
    uploaded_at: float
