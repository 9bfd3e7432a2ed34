"""Episodes and groups on one generator: what the endpoint pins, records and closes.

An :class:`Episode` is one of the G episodes of a prompt's :class:`GroupRun`. It is pinned to the policy version
its group started with (the model name ``{run}-v{N}:{episode_id}`` names both, and every call must send exactly
that name), records its model turns (:mod:`bucketrl.rollout.trajectory`) and statistics, and is closed exactly once:
with a reward, with "score me with the run's reward function", or with an error (kind + message, reward null).
An episode that failed (:meth:`Episode.fail`: the agent's error, a timeout, the turn limit, a wrong model name, no
room left in the context; not an environment that raised) is ``abort``: never trained, out of its group's
statistics, and never counted against the reward (its kind is an ``episode/failed_<kind>``, not an unscorable
completion). A reward the episode returned that is not a number is the reward's failure: unscorable, not abort.
Nothing is recorded into a closed episode. A group is done when all of its episodes are closed.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from bucketrl.rollout.example import Example
from bucketrl.rollout.reward_kinds import classify_reward
from bucketrl.rollout.trajectory import TrajectorySample, Turn, build_samples
from bucketrl.wire import PromptLeaseItem, SamplingSpec

# Why an episode has no reward (a group's ``reward_errors`` keys, the metrics' ``episode/failed_<kind>_total``).
# The reward-value kinds of bucketrl.rollout.reward_kinds (non_numeric, non_finite, none) apply too.
EPISODE_FAILURES = ("exception", "timeout", "turn_limit", "model", "context", "agent")


class EndpointError(Exception):
    """A call the endpoint refuses: HTTP ``status``, OpenAI-style ``code``, a message for the agent."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after


@dataclass
class EpisodeStats:
    turns: int = 0
    tool_calls: int = 0  # calls the endpoint parsed out of the model's turns
    tool_errors: int = 0  # calls that failed (reported by the tool runner) + malformed calls
    malformed_calls: int = 0
    gen_s: float = 0.0  # waiting for the engine (queue + sampling)
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    @property
    def wall_s(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    @property
    def env_s(self) -> float:
        """Everything that was not sampling: the environment's, the tools' and the agent's time."""
        return max(0.0, self.wall_s - self.gen_s)


class Episode:
    def __init__(self, group: GroupRun, index: int) -> None:
        self.group = group
        self.index = index
        self.id = uuid.uuid4().hex[:16]
        self.model = f"{group.adapter}:{self.id}"
        self.turns: list[Turn] = []
        self.stats = EpisodeStats()
        self.assigned = False  # external: handed to an agent
        self.deadline: float | None = None
        self.busy = False  # a call is being served (an episode's turns are sequential)
        self.closed = False
        self.reward: float | None = None
        self.needs_scoring = False  # closed without a reward: the run's reward function scores final_text
        self.error: tuple[str, str] | None = None
        self.aborted = False
        self.final_text = ""
        self.timed_out = False

    # -- closing (first one wins) ---------------------------------------------------------------------

    def fail(self, kind: str, message: str, *, abort: bool = True) -> None:
        """The episode failed (not its reward): ``abort``, whatever turns it recorded. ``abort=False`` only for an
        environment that raised, which may be its own reward's failure (verifiers raises for a reward that did)."""
        if self.closed or self.error is not None:
            return
        self.error = (kind, message[:500])
        self.aborted = self.aborted or abort
        self.timed_out = self.timed_out or kind == "timeout"

    def finish(self, value: Any) -> None:
        """The environment's (or agent's) result: a number, or None for "score the final state"."""
        if self.closed or self.error is not None:
            return
        if value is None:
            self.needs_scoring = True
            return
        reward, kind, message = classify_reward(value)
        if kind is not None:
            self.error = (kind, f"the environment returned a bad reward: {message}")
        self.reward = reward

    def close(self) -> bool:
        """Close it (idempotent); True the first time."""
        if self.closed:
            return False
        if self.error is None and self.reward is None and not self.needs_scoring:
            self.needs_scoring = True  # closed without a result (e.g. an external agent's finish without one)
        self.closed = True
        self.stats.ended = time.monotonic()
        return True

    # -- what it trains -------------------------------------------------------------------------------

    @property
    def finish_reason(self) -> str:
        if self.aborted or not self.turns:
            return "abort"
        return self.turns[-1].finish_reason

    def samples(self) -> list[TrajectorySample]:
        return build_samples(self.turns)


class GroupRun:
    """The G episodes of one leased prompt, all pinned to one version and sampled with one setting."""

    def __init__(
        self,
        prompt: PromptLeaseItem,
        example: Example,
        *,
        version: int,
        adapter: str,
        lease_id: str,
        sampling: SamplingSpec,
        group_size: int,
        external: bool,
        source: str = "",
    ) -> None:
        self.prompt = prompt
        self.example = example
        self.version = version
        self.adapter = adapter
        self.lease_id = lease_id
        self.sampling = sampling
        self.external = external
        self.source = source  # whose group it is, for the generator's admission control (env, an agent)
        self.agent: str | None = None  # the name the agent that opened it sent: its free slots are that agent's
        self.created = time.monotonic()
        self.handed = False  # given to the worker (finished) or taken back (aborted): exactly once
        self.episodes = [Episode(self, i) for i in range(group_size)]

    @property
    def done(self) -> bool:
        return all(e.closed for e in self.episodes)

    def unassigned(self) -> Episode | None:
        return next((e for e in self.episodes if not e.assigned and not e.closed), None)


class EpisodeBook:
    """Live groups and episodes by id (thread-safe: the endpoint's thread and the worker's read it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: list[GroupRun] = []
        self._episodes: dict[str, Episode] = {}

    def add(self, group: GroupRun) -> None:
        with self._lock:
            self._groups.append(group)
            self._episodes.update({e.id: e for e in group.episodes})

    def remove(self, group: GroupRun) -> None:
        with self._lock:
            self._groups = [g for g in self._groups if g is not group]
            for e in group.episodes:
                self._episodes.pop(e.id, None)

    def groups(self) -> list[GroupRun]:
        with self._lock:
            return list(self._groups)

    def get(self, episode_id: str) -> Episode | None:
        with self._lock:
            return self._episodes.get(episode_id)

    def episode_for(self, model: str) -> Episode:
        """The live episode a request's ``model`` names, or an EndpointError saying what to send instead."""
        adapter, sep, episode_id = model.rpartition(":")
        ep = self.get(episode_id) if sep else None
        if ep is None:
            raise EndpointError(
                404,
                "model_not_found",
                f"model {model!r} names no live episode of this generator: send the model name your episode was "
                "given ('{run}-v{N}:{episode_id}', from POST /v1/episodes or your environment's context)",
            )
        if adapter != ep.group.adapter:
            ep.fail(
                "model",
                f"a call asked for model {model!r}, but this episode is pinned to {ep.model!r} (policy version "
                f"{ep.group.version}): an episode never switches versions",
            )
            raise EndpointError(409, "model_mismatch", ep.error[1] if ep.error else "model mismatch")
        return ep

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)
