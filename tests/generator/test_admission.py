"""Admission control's arithmetic (bucketrl/generator/admission.py), on a clock the test moves: the capacity split
max-min fair between the run's environment and its agents, the version hold, the own share from the proxy's counts,
and the refusal an agent gets."""

from __future__ import annotations

import pytest

from bucketrl.generator.admission import ENV, Admission, Limits, OpenGroup, agent_source, fair_shares

LIMITS = Limits(group_size=4, groups_per_step=2, max_staleness=4, target=8)  # capacity 2 x 4 = 8 groups
A, B = agent_source(None), agent_source("b")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def groups(*specs: tuple[str, int, float]) -> list[OpenGroup]:
    return [OpenGroup(source, version, age) for source, version, age in specs]


def room(a: Admission, source: str, open_groups: list[OpenGroup], newest: int = 5, limits: Limits = LIMITS) -> int:
    return a.room(source, open_groups, newest, newest, limits, has_env=True)


def test_fair_shares_are_max_min() -> None:
    # Who asks for less than an equal part gets it; the rest is split evenly; ties go to the first in order.
    assert fair_shares(8, {"a": 1, ENV: 10}, ["a", ENV]) == {"a": 1, ENV: 7}
    assert fair_shares(8, {"a": 5, "b": 5, ENV: 10}, ["a", "b", ENV]) == {"a": 3, "b": 3, ENV: 2}
    assert fair_shares(3, {"a": 2, ENV: 2}, [ENV, "a"]) == {"a": 1, ENV: 2}
    assert fair_shares(8, {"a": 2}, ["a"]) == {"a": 2}


def test_a_waiting_agent_gets_the_next_free_slot_and_its_wait_is_counted() -> None:
    clock = Clock()
    a = Admission(clock=clock)
    a.on_version(6, 2, 4)
    env8 = groups(*[(ENV, 6, 1.0)] * 8)
    assert room(a, ENV, env8[:7], newest=6) == 1  # no agent asks: the environment runs its target
    a.on_handed(ENV, 6, 3.0, 0)  # its groups live about 3 s
    a.on_version(6, 2, 4)
    no = a.refuse(A, env8, 6, 6, LIMITS, has_env=True)  # all 8 slots are the environment's: the agent waits
    assert no.retry_after_s == pytest.approx(2.0)  # 2 must end (8 open, 1 not trained): each ~3 s, 1 s old
    assert "env 9" in no.reason and "capacity 8" in no.reason and "(agent 1, env 7)" in no.reason  # the shares
    # Environment groups end and are trained (the trainer stepped): their slots are kept for the agent; with
    # the open ones a version older, the window holds 2 x 3 groups, so 3 must end before the agent's starts.
    clock.t += 2.0
    a.on_version(7, 2, 4)
    assert a.pending == 0
    assert room(a, ENV, env8[:7], newest=7) <= 0 and room(a, A, env8[:7], newest=7) <= 0
    assert room(a, ENV, env8[:5], newest=7) == 0  # the environment does not take the slot back
    assert room(a, A, env8[:5], newest=7) == 1
    a.admitted(A)
    src = a.sources[A]
    assert (src.admitted, src.refused, src.waits) == (1, 1, 1) and src.wait_s == pytest.approx(2.0)
    gauges = a.gauges()
    assert gauges["admission/agent/admitted_total"] == 1 and gauges["admission/agent/wait_s_mean"] == pytest.approx(2)
    # Once the agent stops asking (its Retry-After and a grace passed), the environment has its target again.
    assert room(a, ENV, [*env8[:5], OpenGroup(A, 7, 0.0)], newest=7) == 0  # the agent's group holds the window
    b = Admission(clock=clock)
    b.refuse(A, env8, 6, 6, LIMITS, has_env=True)
    clock.t += 60.0
    assert room(b, ENV, env8[:5], newest=6) == 3


def test_an_agent_cannot_starve_the_environment_either() -> None:
    a = Admission(clock=Clock())
    a.refuse(B, [], 5, 5, LIMITS, has_env=True)  # two agents ask
    open_groups = groups(*[(A, 5, 1.0)] * 3, *[(B, 5, 1.0)] * 2, (ENV, 5, 1.0))
    # 8 slots: the environment wants 8, the agents one more each: 3 / 3 / 2 (the agents' groups are not taken back).
    assert room(a, A, open_groups) == 0
    assert room(a, B, open_groups) == 1
    assert room(a, ENV, open_groups) == 1
    assert room(a, ENV, open_groups[:-1]) == 2  # its share is 2 (what the agents hold is not taken back)


def test_agents_of_different_speeds_share_max_min_fair() -> None:
    """A fast agent that asks again and again and a slow one (groups of 20 s, one at a time) beside the environment:
    the slow one gets the next free slot though the fast one asks more often, and the fast one keeps no more than
    its part (tests/envs/test_fair_agents.py shows it end to end)."""
    clock = Clock()
    a = Admission(clock=clock)
    a.on_version(5, 2, 4)
    a.on_handed(A, 5, 20.0, 0)  # the slow agent's groups live 20 s
    a.on_handed(B, 5, 1.0, 0)  # the fast agent's 1 s
    a.on_version(6, 2, 4)  # both trained
    full = groups(*[(B, 6, 0.5)] * 4, *[(ENV, 6, 0.5)] * 4)  # all 8 slots taken while the slow agent worked
    a.refuse(A, full, 6, 6, LIMITS, has_env=True)  # the slow one asks for its next group: it waits
    # Max-min fair: the slow agent wants 1, less than an equal part: it gets it; the rest is split evenly.
    share = a.shares(full, LIMITS, B, has_env=True)
    assert share[A] == 1 and share[B] + share[ENV] == 7 and abs(share[B] - share[ENV]) <= 1
    # A fast group ends: its slot is the slow agent's, not the fast one's that asks again, nor the environment's.
    clock.t += 1.0
    freed = full[1:]
    assert room(a, B, freed, newest=6) <= 0 and room(a, ENV, freed, newest=6) <= 0
    assert room(a, A, freed, newest=6) == 1
    a.admitted(A)
    # An environment group ends: the fast agent holds its part (4 of the 7 the slow one leaves), the environment
    # gets the slot.
    freed = [*groups(*[(B, 6, 0.5)] * 4, *[(ENV, 6, 0.5)] * 2), OpenGroup(A, 6, 0.0)]
    assert room(a, B, freed, newest=6) <= 0
    assert room(a, ENV, freed, newest=6) == 1
    gauges = a.gauges()
    assert gauges["admission/agent/refused_total"] == 1 and gauges["admission/agent/admitted_total"] == 1
    assert gauges["admission/agent:b/group_life_s"] == 1.0 and gauges["admission/agent/group_life_s"] == 20.0


def test_an_old_open_agent_group_stops_new_groups_until_it_is_done() -> None:
    a = Admission(clock=Clock())
    limits = Limits(group_size=4, groups_per_step=2, max_staleness=2, target=8)
    # One agent group of v5 while the trainer is at v6: 2 * 1 others may complete before it, it is one of them.
    assert room(a, A, groups((A, 5, 1.0)), newest=6, limits=limits) == 1
    assert room(a, ENV, groups((A, 5, 1.0), (ENV, 6, 0.0)), newest=6, limits=limits) == 0
    # At the edge of the window nothing new starts, the environment's neither: the trainer must wait for it.
    assert room(a, ENV, groups((A, 5, 1.0)), newest=7, limits=limits) <= 0
    # No agent asks: the environment's own groups are held the same way (none of them is dropped as stale).
    assert room(a, ENV, groups((ENV, 5, 1.0), (ENV, 6, 1.0)), newest=6, limits=limits) == 0
    assert room(a, ENV, groups((ENV, 6, 1.0)), newest=6, limits=limits) == 3  # 2 x 2 - 1
    # Groups handed over and not yet trained count as work ahead of it too.
    a.on_handed(ENV, 6, 1.0, 0)
    assert room(a, A, groups((A, 5, 1.0)), newest=6, limits=limits) == 0
    # Nothing open: one group always starts (strict on-policy too: never none, or the run would stall).
    strict = Limits(group_size=4, groups_per_step=2, max_staleness=0, target=8)
    assert room(Admission(clock=Clock()), A, [], limits=strict) == 1


def test_the_own_share_is_the_proxys_count_of_trained_groups() -> None:
    clock = Clock()
    a = Admission(clock=clock)
    assert "admission/own_share" not in a.gauges()  # nothing counted yet: nothing claimed
    a.on_trained(10, 10)
    a.on_trained(30, 30)  # alone: every group the run trained was this generator's
    assert a.gauges()["admission/own_share"] == 1.0
    a.on_version(1, 2, 4)
    a.on_handed(A, 1, 20.0, 0)  # an agent's group lives 20 s
    for v in range(2, 12):  # the trainer steps once a second
        clock.t += 1.0
        a.on_version(v, 2, 4)
    assert a.other_steps_per_group(20.0) == 0.0 and a.capacity(LIMITS) == 8
    # Another generator joins and feeds half of the run's groups: a 20 s group sees 10 steps it cannot hold back.
    for run, mine in ((50, 40), (70, 50), (90, 60), (110, 70)):
        a.on_trained(run, mine)
    assert a.own_share == pytest.approx(0.5)
    assert a.other_steps_per_group(20.0) == pytest.approx(10.0)
    assert a.capacity(LIMITS) == 1
    a.on_trained(5, 5)  # the proxy's Redis was rebuilt: measured again from there
    a.on_trained(9, 9)
    assert a.own_share == 1.0


def test_groups_not_yet_trained_are_counted_off_by_steps_or_by_their_window() -> None:
    a = Admission(clock=Clock())
    a.on_version(5, 2, 4)
    for source in (ENV, A, ENV):
        a.on_handed(source, 5, 1.0, 0)
    a.on_version(6, 2, 4)  # a step trains groups_per_step of them, the oldest first
    assert a.pending_sources() == [ENV]
    b = Admission(clock=Clock())
    b.on_trained(10, 5)
    b.on_trained(30, 15)  # half of the run's groups are this generator's: a step trains one of them
    b.on_version(5, 2, 4)
    for source in (ENV, A, ENV):
        b.on_handed(source, 5, 1.0, 0)
    b.on_version(6, 2, 4)
    assert b.pending_sources() == [A, ENV]
    b.on_version(10, 2, 4)  # past its window: trained or dropped by now, whatever the count says
    assert b.pending == 0


def test_nothing_open_always_admits_one_group_unless_an_agent_waits_for_it() -> None:
    a = Admission(clock=Clock())
    for _ in range(8):  # eight groups counted as not yet trained (e.g. the trainer publishes every few steps)
        a.on_handed(A, 5, 1.0, 0)
    assert room(a, ENV, []) == 1 and room(a, A, []) == 1
    a.refuse(B, [], 5, 5, LIMITS, has_env=True)
    assert room(a, ENV, []) == 0 and room(a, B, []) == 1


def test_the_explicit_limit_counts_whole_groups() -> None:
    a = Admission(max_open_episodes=9)
    assert a.capacity(LIMITS) == 2
    assert room(a, A, groups((A, 5, 0.0), (A, 5, 0.0))) <= 0
    assert Admission(max_open_episodes=1).capacity(LIMITS) == 1


def test_retry_after_is_the_soonest_expected_end_and_stays_in_bounds() -> None:
    a = Admission(clock=Clock())
    a.on_handed(A, 5, 12.0, 0)
    assert a.expected_wait(groups((A, 5, 5.0), (A, 5, 1.0))) == pytest.approx(7.0)
    assert a.expected_wait(groups((A, 5, 50.0))) == 1.0  # overdue: ask again soon
    a.on_handed(ENV, 5, 100.0, 0)
    assert a.expected_wait(groups((ENV, 5, 0.0))) == 30.0
    assert Admission().expected_wait([]) == 1.0


def test_agent_names_are_checked() -> None:
    assert agent_source("crawler-1") == "agent:crawler-1"
    with pytest.raises(ValueError, match="agent name"):
        agent_source("two words")
