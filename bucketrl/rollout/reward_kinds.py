"""A reward's result classified: a usable finite number, or the kind of failure and a message saying why not.

Shared by the reward pool (:mod:`bucketrl.rewards`), the environments that score their own episodes
(:mod:`bucketrl.rollout.episodes`), the generator's metrics and the checks before a run starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def coerce_reward(value: Any) -> float | None:
    """A reward function's result as a finite float, or None (bool counts as 0/1; anything else is None)."""
    return classify_reward(value)[0]


# Why a completion could not be scored (``reward: null``): the kinds counted per step and shown with the first
# message of each (live view, dashboard, status, summary).
FAILURE_KINDS = ("exception", "timeout", "non_numeric", "non_finite", "none")


def classify_reward(value: Any) -> tuple[float | None, str | None, str | None]:
    """``(reward, None, None)`` for a usable value, else ``(None, kind, message)``. A string such as ``"1.0"``
    is an error (``non_numeric``), never silently read as a number or dropped."""
    if value is None:
        return None, "none", "the reward function returned None (cannot score)"
    if isinstance(value, bool):
        return float(value), None, None
    if isinstance(value, int | float) or type(value).__name__ in ("float16", "float32", "float64", "int32", "int64"):
        f = float(value)
        if math.isfinite(f):
            return f, None, None
        return None, "non_finite", f"the reward function returned {f!r}"
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return None, "non_numeric", f"the reward function returned {type(value).__name__} {shown}, not a number"


@dataclass(frozen=True)
class Scored:
    """One completion's outcome: ``value``, or ``kind`` + ``message`` saying why there is none."""

    value: float | None
    kind: str | None = None
    message: str | None = None
