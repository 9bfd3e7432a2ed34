"""Admission control of a generator's episode groups: fair between the run's sources, and inside the staleness window
(docs/multi-turn.md "Slow agents").

**Sources.** The run's own environment is one source (:data:`ENV`); each agent calling the endpoint is another (the
name it sends with ``POST /v1/episodes``; agents that send none share the source ``agent``: they all hold the one
token). A source *asks* while it has groups open or handed over and not yet trained, or while it waits for a group
it was refused (until its Retry-After has passed and a little more). The environment asks all the time.

**Capacity.** A group handed out at version ``v`` is trained only if it is submitted before the trainer publishes
``v + max_staleness + 1``, and the trainer steps once per ``groups_per_step`` groups. So a generator may hold at
most ``C = groups_per_step * max_staleness`` groups open or not yet trained: with more, the last of them would see
the window close before the others are trained. Steps that other generators feed do not slow down when this one
admits fewer; with ``r_other`` the trainer's step rate times the share of the run's trained groups that were not
this generator's (counted by the proxy, answered with each submit) and ``D`` an agent group's measured life,
Little's law leaves ``C = groups_per_step * (max_staleness - r_other * D)`` (``BUCKETRL_MAX_OPEN_EPISODES``
overrides it). Groups handed over are counted off as the trainer steps (this generator's share of
``groups_per_step`` a version, oldest first: the proxy's queue is FIFO), and a group past its window is trained or
dropped by then. (The proxy's count of trained groups is not used for that: the trainer acks a group only with the
checkpoint that holds it, so the count lags the training by up to a checkpoint interval.)

**Fair share.** ``C`` is divided max-min fair among the sources that ask (:func:`fair_shares`): a source that wants
less than an equal part gets what it wants, the rest is split evenly, a tie goes to the source that has waited
longest. A source may start a group while its groups (open + not yet trained) are fewer than its share. A group
over a share is never taken back, only not replaced when it ends: a waiting agent gets the next free slot, and an
agent cannot take more than its share from the environment either. While no agent asks, the environment runs up
to its ``BUCKETRL_EPISODE_GROUPS`` under the version hold alone.

**The version hold** (every source's groups): a new group is admitted only while, for every open group ``g``, the
groups that could complete before it (the other open ones, the new one, and the ones handed over but not yet
trained) stay below ``groups_per_step * (v_g + max_staleness - newest)``, one group of slack. An open group thus
holds its version for its whole life: once it is old, no new group starts, the trainer runs out of work and waits
for it. The room a waiting agent's share is owed is not another source's to take.

A refused agent is told (429, Retry-After) when the slot it waits for should free: the expected end of the groups
that must end first, from each source's measured group life, plus a trainer step. With nothing open and no agent
waiting, one group always starts, so that the trainer is never left without work by books that are off.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from bucketrl.wire.runs import versions_left

ALPHA = 0.3  # EWMA weight of the newest sample: a few groups move it, one outlier does not
SLACK_GROUPS = 1  # the trainer's claims and the generator's view of newest are not in lockstep
MAX_RETRY_AFTER_S = 30.0
ASKING_GRACE_S = 5.0  # a refused agent still asks this long after its Retry-After
ENV = "env"  # the run's own environment, as a source
AGENT = "agent"  # agents that send no name
AGENT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
MAX_SOURCES = 16  # sources kept (and reported), the most recently active: agent names are the callers' to choose
SHARE_WINDOW = 64  # the run's trained groups the own share is measured over


class Ewma:
    def __init__(self, alpha: float = ALPHA) -> None:
        self.alpha = alpha
        self.value: float | None = None
        self.samples = 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value
        self.samples += 1


def agent_source(name: str | None) -> str:
    """The source of an agent that sent ``name`` (None: the unnamed agents' one); ValueError for a bad name."""
    if name is None:
        return AGENT
    if not AGENT_NAME.match(name):
        raise ValueError(f"agent name {name!r}: 1-32 characters of letters, digits, '_', '.', '-'")
    return f"{AGENT}:{name}"


def fair_shares(capacity: int, demands: dict[str, int], order: list[str]) -> dict[str, int]:
    """Max-min fair integer shares of ``capacity`` (progressive filling: each slot to the asking source that holds
    the fewest so far, ties to the first in ``order``)."""
    alloc = dict.fromkeys(demands, 0)
    for _ in range(capacity):
        hungry = [s for s in order if alloc[s] < demands[s]]
        if not hungry:
            break
        alloc[min(hungry, key=lambda s: alloc[s])] += 1
    return alloc


@dataclass
class Source:
    """One source's books: what it got, what it was refused, how long it waited, how long its groups live."""

    admitted: int = 0
    refused: int = 0
    wait_s: float = 0.0  # summed over its admissions that were refused first
    waits: int = 0
    wait_max_s: float = 0.0
    waiting_since: float | None = None  # its first refused ask not yet admitted
    asks_until: float = -math.inf  # a refused source counts as asking until then
    life: Ewma = field(default_factory=Ewma)  # its groups' life, hand-out to the last episode's end
    seen: float = 0.0


@dataclass(frozen=True)
class OpenGroup:
    source: str
    version: int
    age_s: float


@dataclass(frozen=True)
class Limits:
    group_size: int
    groups_per_step: int
    max_staleness: int
    target: int  # the environment's groups at once (BUCKETRL_EPISODE_GROUPS)


@dataclass(frozen=True)
class Refusal:
    """Why no new group is admitted now, and when to ask again (the agent's 429 and Retry-After)."""

    reason: str
    retry_after_s: float


class Admission:
    """The sources' books, the measurements the driver's loop feeds, and the decision asked before a group starts."""

    def __init__(self, max_open_episodes: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_open_episodes = max_open_episodes
        self.clock = clock
        self.sources: dict[str, Source] = {}
        self.step_s = Ewma()  # seconds per trainer step (policy versions as this generator learns of them)
        self.own_share: float | None = None  # this generator's share of the run's trained groups (proxy's count)
        self._counts: deque[tuple[int, int]] = deque()  # (run's trained, this generator's trained), oldest first
        # (source, version) of the groups handed over and not yet trained, oldest first (the proxy's queue is FIFO)
        self._pending: deque[tuple[str, int]] = deque()
        self._trained_credit = 0.0
        self._agent_staleness: deque[int] = deque(maxlen=8)
        self._newest: int | None = None
        self._since = clock()

    # -- measurements --------------------------------------------------------------------------------

    def source(self, name: str) -> Source:
        src = self.sources.get(name)
        if src is None:
            if len(self.sources) >= MAX_SOURCES:  # forget the longest idle agent (never the environment)
                idle = min((s for s in self.sources if s != ENV), key=lambda s: self.sources[s].seen)
                del self.sources[idle]
            src = self.sources[name] = Source(seen=self.clock())
        return src

    @property
    def pending(self) -> int:
        return len(self._pending)

    def pending_sources(self) -> list[str]:
        return [s for s, _ in self._pending]

    def on_version(self, newest: int, groups_per_step: int, max_staleness: int) -> None:
        now = self.clock()
        if self._newest is None or newest <= self._newest:
            if self._newest is None:
                self._newest, self._since = newest, now
            return
        steps = newest - self._newest
        self.step_s.add((now - self._since) / steps)
        self._trained_credit += groups_per_step * steps * (1.0 if self.own_share is None else self.own_share)
        while self._pending and self._trained_credit >= 1.0:
            self._pending.popleft()
            self._trained_credit -= 1.0
        if not self._pending:
            self._trained_credit = 0.0
        # Past its window a group is trained or dropped by now, whatever the counts say (they restart with Redis).
        while self._pending and versions_left(self._pending[0][1], newest, max_staleness) < 0:
            self._pending.popleft()
        self._newest, self._since = newest, now

    def on_handed(self, source: str, version: int, life_s: float, staleness: int) -> None:
        """A group of ``source`` at ``version`` went to the submitter after ``life_s`` s, ``staleness`` versions old."""
        self._pending.append((source, version))
        src = self.source(source)
        src.life.add(life_s)
        src.seen = self.clock()
        if source != ENV:
            self._agent_staleness.append(staleness)

    def handed_staleness(self) -> list[int]:
        """How many versions old the agents' last groups were when handed over (oldest first)."""
        return list(self._agent_staleness)

    def on_trained(self, run_trained: int, mine: int) -> None:
        """The proxy's counts (with each submit): the run's trained groups and this generator's."""
        if self._counts and (run_trained < self._counts[-1][0] or mine < self._counts[-1][1]):
            self._counts.clear()  # the proxy's Redis was rebuilt (its per-worker counts are not kept): start again
        self._counts.append((run_trained, mine))
        while len(self._counts) > 2 and run_trained - self._counts[1][0] >= SHARE_WINDOW:
            self._counts.popleft()
        (run0, mine0), (run1, mine1) = self._counts[0], self._counts[-1]
        if run1 > run0:
            self.own_share = min(1.0, max(0.0, (mine1 - mine0) / (run1 - run0)))

    def other_steps_per_group(self, life_s: float | None) -> float:
        """Trainer steps a group living ``life_s`` sees that other generators fed (0 until measured)."""
        step = self.step_s.value
        if life_s is None or step is None or step <= 0 or self.own_share is None:
            return 0.0
        return life_s / step * (1.0 - self.own_share)

    # -- the decision --------------------------------------------------------------------------------

    def capacity(self, limits: Limits) -> int:
        """Groups this generator may hold open or not yet trained (at least 1)."""
        if self.max_open_episodes is not None:
            return max(1, self.max_open_episodes // limits.group_size)
        lives = [s.life.value for n, s in self.sources.items() if n != ENV and s.life.value is not None]
        other = self.other_steps_per_group(max(lives, default=None))
        return max(1, math.floor(limits.groups_per_step * (limits.max_staleness - other)))

    def waiting(self, source: str) -> bool:
        """An agent refused and not admitted since, whose Retry-After (and a little more) has not run out."""
        src = self.sources.get(source)
        return src is not None and src.waiting_since is not None and src.asks_until > self.clock()

    def asking(self, open_groups: list[OpenGroup], has_env: bool) -> list[str]:
        """The sources asking now: agents, those waiting longest first, then the environment (if the run has one)."""
        busy = (
            {g.source for g in open_groups} | set(self.pending_sources()) | {n for n in self.sources if self.waiting(n)}
        )
        since = {n: s.waiting_since or math.inf for n, s in self.sources.items()}
        agents = sorted(busy - {ENV}, key=lambda n: (since.get(n, math.inf), n))
        return [*agents, *([ENV] if has_env else [])]

    def usage(self, open_groups: list[OpenGroup]) -> dict[str, int]:
        """Each source's groups open or handed over and not yet trained."""
        used: dict[str, int] = {}
        for s in [g.source for g in open_groups] + self.pending_sources():
            used[s] = used.get(s, 0) + 1
        return used

    def shares(self, open_groups: list[OpenGroup], limits: Limits, asker: str, has_env: bool) -> dict[str, int]:
        """Each asking source's share of the capacity: it asks for one group more than it holds when it is
        ``asker`` or waiting; the environment for ``target`` open."""
        order = self.asking(open_groups, has_env)
        if asker not in order:
            order.insert(0, asker)
        used = self.usage(open_groups)
        demands = {s: used.get(s, 0) + int(s == asker or self.waiting(s)) for s in order}
        if has_env:
            demands[ENV] = max(demands[ENV], self.pending_sources().count(ENV) + limits.target)
        return fair_shares(self.capacity(limits), demands, order)

    def held(self, open_groups: list[OpenGroup], new_version: int, newest: int, limits: Limits) -> int:
        """The version hold: new groups at ``new_version`` that leave every open group inside the window."""
        versions = [*(g.version for g in open_groups), new_version]
        headroom = min(versions_left(v, newest, limits.max_staleness) for v in versions)
        room = limits.groups_per_step * headroom - SLACK_GROUPS + 1 - self.pending - len(open_groups)
        # Nothing open: one group always starts (a trainer short of a step's groups would otherwise wait forever).
        return max(room, 1) if not open_groups else room

    def room(
        self, source: str, open_groups: list[OpenGroup], new_version: int, newest: int, limits: Limits, *, has_env: bool
    ) -> int:
        """How many new groups of ``source`` at ``new_version`` may start now (negative: how many must end first)."""
        env_room = limits.target - sum(g.source == ENV for g in open_groups)
        held = self.held(open_groups, new_version, newest, limits)
        if source == ENV and not [s for s in self.asking(open_groups, has_env) if s != ENV]:
            return min(env_room, held)  # no agent asks: its target, inside its own groups' window
        share, used = self.shares(open_groups, limits, source, has_env), self.usage(open_groups)
        fair = share[source] - used.get(source, 0)
        if source == ENV:
            fair = min(fair, env_room)
        # The hold's room that agents waiting for a slot of their share are owed is not this source's to take.
        owed = sum(1 for s in share if s not in (source, ENV) and self.waiting(s) and share[s] > used.get(s, 0))
        room = min(fair, held - owed)
        # Nothing open and nobody else waiting: one group starts whatever the books say, so that a count that is off
        # (a group counted as not yet trained that was) never leaves the trainer without work.
        return max(room, 1) if not open_groups and not owed else room

    # -- an agent's ask ------------------------------------------------------------------------------

    def admitted(self, source: str) -> None:
        """A group of ``source`` starts (a wait that began with a refusal ends)."""
        src, now = self.source(source), self.clock()
        src.admitted += 1
        src.seen = now
        if src.waiting_since is not None:
            waited = now - src.waiting_since
            src.wait_s += waited
            src.waits += 1
            src.wait_max_s = max(src.wait_max_s, waited)
            src.waiting_since = None
        src.asks_until = -math.inf

    def deferred(self, source: str) -> None:
        """``source`` (the environment) wanted a group and got none: a waiting spell starts (counted once)."""
        src = self.source(source)
        if src.waiting_since is None:
            src.waiting_since = self.clock()
            src.refused += 1

    def refuse(
        self, source: str, open_groups: list[OpenGroup], new_version: int, newest: int, limits: Limits, *, has_env: bool
    ) -> Refusal:
        """What ``source`` is told when :meth:`room` is not positive (counted; it asks until its Retry-After)."""
        short = 1 - self.room(source, open_groups, new_version, newest, limits, has_env=has_env)
        src, now = self.source(source), self.clock()
        src.refused += 1
        src.seen = now
        if src.waiting_since is None:
            src.waiting_since = now
        retry = self.expected_wait(open_groups, max(1, short))
        src.asks_until = now + retry + ASKING_GRACE_S
        share = self.shares(open_groups, limits, source, has_env)
        held = ", ".join(f"{s} {n}" for s, n in sorted(self.usage(open_groups).items()))
        why = (
            f"admission control: this generator holds {held or 'no'} group(s) open or not yet trained, capacity "
            f"{self.capacity(limits)} groups"
            + (f" (BUCKETRL_MAX_OPEN_EPISODES={self.max_open_episodes})" if self.max_open_episodes else "")
            + f", shared fairly ({', '.join(f'{s} {n}' for s, n in share.items())}), each group to finish within "
            f"the staleness window; {max(1, short)} group(s) must end before yours starts: retry after {retry:.0f} s"
        )
        return Refusal(why, retry)

    def expected_wait(self, open_groups: list[OpenGroup], groups: int = 1) -> float:
        """Seconds until ``groups`` open groups should have ended (each by its source's measured life), then about
        one trainer step for them to be trained."""
        ends = []
        for g in open_groups:
            life = self.sources[g.source].life.value if g.source in self.sources else None
            if life is not None:
                ends.append(max(0.0, life - g.age_s))
        ends.sort()
        step = self.step_s.value or 0.0
        wait = (ends[min(groups, len(ends)) - 1] if ends else 0.0) + step
        return min(MAX_RETRY_AFTER_S, max(1.0, wait))

    def gauges(self) -> dict[str, float]:
        out = {
            "admission/step_s": self.step_s.value or 0.0,
            "admission/pending_groups": float(self.pending),
        }
        if self.own_share is not None:
            out["admission/own_share"] = self.own_share
        for name, s in self.sources.items():
            out[f"admission/{name}/admitted_total"] = float(s.admitted)
            out[f"admission/{name}/refused_total"] = float(s.refused)
            out[f"admission/{name}/wait_s_mean"] = s.wait_s / s.waits if s.waits else 0.0
            out[f"admission/{name}/wait_s_max"] = s.wait_max_s
            out[f"admission/{name}/group_life_s"] = s.life.value or 0.0
        return out
