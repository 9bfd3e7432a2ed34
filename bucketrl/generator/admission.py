"""Admission control of a generator's episode groups, so that a slow agent's work is not dropped as stale
(docs/multi-turn.md "Slow agents").

A group handed out at version ``v`` is trained only if it is submitted before the trainer publishes
``v + max_staleness + 1``. The trainer steps once per ``groups_per_step`` groups, so what decides whether an open
group stays in the window is how many *other* groups can complete before it does. Two rules bound that:

- **The version hold** (exact when this generator feeds the trainer): a new group is admitted only while, for
  every open group ``g``, the groups that could complete before it (the other open ones, the new one, and the
  ones handed over but not yet trained) stay below ``groups_per_step * (v_g + max_staleness - newest)``, one group
  of slack. An open group thus holds its version for its whole life: once it is old, no new group starts, the
  trainer runs out of work and waits for it.
- **Little's law**, measured per run: with the groups' life ``D`` (EWMA, from hand-out to the last episode's end)
  and the trainer's step rate ``r`` (EWMA), ``L`` open groups feed ``L / D`` groups per second, and a group sees
  ``r * D`` steps. The part of ``r`` fed by other sources (other generators, a mixed run's own environment) does not
  slow down when this generator admits fewer, so the cap is ``groups_per_step * (max_staleness - r_other * D)``
  groups (``BUCKETRL_MAX_OPEN_EPISODES`` overrides it); when even one group would see more than the window, the
  driver logs :meth:`Admission.too_slow`, with the numbers and the setting to change.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

ALPHA = 0.3  # EWMA weight of the newest sample: a few groups move it, one outlier does not
SLACK_GROUPS = 1  # the trainer's claims and the generator's view of newest are not in lockstep
MAX_RETRY_AFTER_S = 30.0


class Ewma:
    def __init__(self, alpha: float = ALPHA) -> None:
        self.alpha = alpha
        self.value: float | None = None
        self.samples = 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value
        self.samples += 1


@dataclass(frozen=True)
class Refusal:
    """Why no new group is admitted now, and when to ask again (the agent's 429 and Retry-After)."""

    reason: str
    retry_after_s: float


class Admission:
    """Measurements (fed by the driver's loop) and the admission decision (asked before a group starts)."""

    def __init__(self, max_open_episodes: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_open_episodes = max_open_episodes
        self.clock = clock
        self.group_life_s = Ewma()  # an external group's life, hand-out to the last episode's end
        self.step_s = Ewma()  # seconds per trainer step (policy versions as this generator learns of them)
        self.own_share = Ewma()  # the fraction of the trainer's groups this generator handed over
        self.pending = 0  # groups handed over and not yet trained, as far as the step count tells
        self.refused = 0
        self._newest: int | None = None
        self._since = clock()
        self._handed_since = 0

    # -- measurements --------------------------------------------------------------------------------

    def on_version(self, newest: int, groups_per_step: int) -> None:
        now = self.clock()
        if self._newest is None or newest <= self._newest:
            if self._newest is None:
                self._newest, self._since = newest, now
            return
        steps = newest - self._newest
        self.step_s.add((now - self._since) / steps)
        self.own_share.add(min(1.0, self._handed_since / (groups_per_step * steps)))
        self.pending = max(0, self.pending - groups_per_step * steps)
        self._newest, self._since, self._handed_since = newest, now, 0

    def on_handed(self, life_s: float | None) -> None:
        """A group went to the submitter; ``life_s``: an external group's life (None for the run's own env)."""
        self.pending += 1
        self._handed_since += 1
        if life_s is not None:
            self.group_life_s.add(life_s)

    def other_steps_per_group(self) -> float:
        """Trainer steps one group's life sees that other sources fed (0 until measured)."""
        life, step = self.group_life_s.value, self.step_s.value
        if life is None or step is None or step <= 0 or self.own_share.value is None:
            return 0.0
        return life / step * (1.0 - self.own_share.value)

    # -- the decision --------------------------------------------------------------------------------

    def cap_groups(self, group_size: int, groups_per_step: int, max_staleness: int) -> int:
        """Little's law: the open groups this generator may hold (at least 1)."""
        if self.max_open_episodes is not None:
            return max(1, self.max_open_episodes // group_size)
        return max(1, math.floor(groups_per_step * (max_staleness - self.other_steps_per_group())))

    def room(
        self,
        open_versions: list[int],
        new_version: int,
        newest: int,
        *,
        group_size: int,
        groups_per_step: int,
        max_staleness: int,
    ) -> int:
        """How many new groups at ``new_version`` may start now (``open_versions``: this generator's open groups)."""
        headroom = min(v + max_staleness - newest for v in [*open_versions, new_version])
        held = groups_per_step * headroom - SLACK_GROUPS + 1 - self.pending - len(open_versions)
        capped = self.cap_groups(group_size, groups_per_step, max_staleness) - len(open_versions)
        room = min(held, capped)
        return max(room, 1) if not open_versions and capped > 0 else max(room, 0)

    def refusal(self, open_ages_s: list[float], open_episodes: int, limit_groups: int) -> Refusal:
        """What an agent is told when :meth:`room` is 0 (counted)."""
        self.refused += 1
        life = self.group_life_s.value
        # A slot frees when the oldest open group ends: about one group life after it was handed out.
        retry = 1.0 if life is None or not open_ages_s else life - max(open_ages_s)
        retry = min(MAX_RETRY_AFTER_S, max(1.0, retry))
        why = (
            f"admission control: {len(open_ages_s)} group(s) ({open_episodes} episodes) are open, the most this "
            f"generator hands out now (limit {limit_groups} groups"
            + (f", BUCKETRL_MAX_OPEN_EPISODES={self.max_open_episodes}" if self.max_open_episodes else "")
            + "), so that each finishes within the staleness window and is trained; retry after "
            f"{retry:.0f} s (or finish the episodes you hold)"
        )
        return Refusal(why, retry)

    def too_slow(self, max_staleness: int, episode_timeout_s: float) -> str | None:
        """The operator's warning when even one open group sees more steps than the window (else None)."""
        other = self.other_steps_per_group()
        if other <= max_staleness - SLACK_GROUPS:
            return None
        life, step = self.group_life_s.value or 0.0, self.step_s.value or 0.0
        share = 1.0 - (self.own_share.value or 0.0)
        return (
            f"the agents' groups take {life:.1f} s (EWMA over {self.group_life_s.samples}), while the trainer steps "
            f"every {step:.2f} s, {100 * share:.0f} % of it on groups other sources fed: a group sees ~{other:.1f} "
            f"steps it cannot hold back, over max_staleness {max_staleness} - {SLACK_GROUPS}, so its work may be "
            f"dropped as stale even at one open group. Raise the run spec's max_staleness to at least "
            f"{math.ceil(other) + SLACK_GROUPS}, or make episodes shorter (episode.episode_timeout_s "
            f"{episode_timeout_s:g} s)"
        )

    def gauges(self) -> dict[str, float]:
        return {
            "admission/group_life_s": self.group_life_s.value or 0.0,
            "admission/step_s": self.step_s.value or 0.0,
            "admission/own_share": self.own_share.value or 0.0,
            "admission/pending_groups": float(self.pending),
        }
