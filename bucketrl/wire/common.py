"""Constrained identifiers shared by several wire models.

Run ids and worker ids end up in bucket keys and Redis keys, so they are restricted to a
charset that can never escape a prefix (no ``/``, no ``..``, no whitespace).
"""

from typing import Annotated

from pydantic import BaseModel, ConfigDict, StringConstraints

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"

RunId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
WorkerId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
LeaseId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class WireModel(BaseModel):
    """Base for wire models: unknown fields are ignored so newer clients can add fields."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class StrictWireModel(BaseModel):
    """Base for specs where a typo in a field name must be an error, not a silent default."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
