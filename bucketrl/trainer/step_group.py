"""What the trainer trains on in a step: a claimed group and where it came from (shared by the learner and the
ranks, which send a step's groups from rank 0 to the others)."""

from __future__ import annotations

from dataclasses import dataclass

from bucketrl.wire.rollouts import RolloutGroup
from bucketrl.wire.runs import SamplingSpec


@dataclass(frozen=True)
class StepGroup:
    """A claimed group and where it came from (its delivery's version and generator)."""

    group: RolloutGroup
    version: int
    worker_id: str = ""
    # What the group was sampled with (None: the run's sampling settings).
    sampling: SamplingSpec | None = None
