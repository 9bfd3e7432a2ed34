"""Constrained identifiers and bounds shared by several wire models.

Run ids and worker ids end up in bucket keys and Redis keys, so they are restricted to a
charset that can never escape a prefix (no ``/``, no ``..``, no whitespace).

Every model on the wire refuses NaN/infinity, is validated strictly where it enters the proxy
(``proxy/body.py``: a boolean is not a number, ``"1"`` is not an integer; code building models in Python stays
lax), and every list on it has a length bound: static caps here (what no legal run can exceed),
tightened per run where the spec says more (``proxy/state/validation.validate_batch``). Lists validate
``fail_fast``: a list of two million bad items costs one error, not two million materialised ones.
"""

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# Versions, steps, epochs, prompt indices: integers Redis's Lua (doubles printed with %.14g) round-trips
# exactly. 10^14 and beyond came back as "1e+14" and broke the proxy; 10^12 is ~30,000 years of a version
# a second.
MAX_WIRE_INT = 10**12
# The longest token sequence a completion may have (SamplingSpec.max_new_tokens' upper bound) and a prompt.
MAX_COMPLETION_TOKENS = 65_536
MAX_PROMPT_TOKENS = 262_144
# Multi-turn trajectories (wire/rollouts.py): the most model turns an episode may take (EpisodeSpec.max_turns'
# upper bound) and the most tokens one training sample's segments may hold.
MAX_TURNS = 256
MAX_EPISODE_TOKENS = 262_144
# Resident adapter versions a generator may report (max_staleness <= 64, plus the current and a loading one).
MAX_LOADED_VERSIONS = 256

WireInt = Annotated[int, Field(ge=0, le=MAX_WIRE_INT)]
Version = Annotated[int, Field(ge=1, le=MAX_WIRE_INT)]
ShortStr = Annotated[str, StringConstraints(min_length=1, max_length=200)]

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"

RunId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
WorkerId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
LeaseId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
# A client-chosen id, the same on every retry of one request: a replay answers what its first attempt did.
RequestId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class WireModel(BaseModel):
    """Base for wire models: unknown fields are ignored so newer clients can add fields."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, allow_inf_nan=False)


class StrictWireModel(BaseModel):
    """Base for specs where a typo in a field name must be an error, not a silent default."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)
