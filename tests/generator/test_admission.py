"""Admission control's arithmetic (bucketrl/generator/admission.py), on a clock the test moves: the version hold,
Little's-law cap from the measured group life and step rate, the refusal an agent gets and the operator's warning."""

from __future__ import annotations

import pytest

from bucketrl.generator.admission import Admission


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def room(a: Admission, open_versions: list[int], newest: int, *, gps: int = 2, ms: int = 2) -> int:
    return a.room(open_versions, newest, newest, group_size=4, groups_per_step=gps, max_staleness=ms)


def test_an_old_open_group_stops_new_ones_until_it_is_done() -> None:
    a = Admission(clock=Clock())
    # Fresh: groups_per_step * max_staleness groups may be open (one group of slack for the one starting).
    assert room(a, [], 5) == 4
    assert room(a, [5, 5, 5], 5) == 1
    # One group of v5 while the trainer is at v6: 2 * 1 others may complete before it, it is one of them.
    assert room(a, [5], 6) == 1
    assert room(a, [5, 6], 6) == 0
    # At the edge of the window nothing new starts: the trainer must wait for the v5 group.
    assert room(a, [5], 7) == 0
    # Groups handed over and not yet trained count as work ahead of it too.
    a.on_handed(None)
    assert room(a, [5], 6) == 0


def test_nothing_open_always_admits_one_group() -> None:
    a = Admission(clock=Clock())
    assert room(a, [], 5, ms=0) == 1  # strict on-policy: one at a time, never none (the run would stall)


def test_pending_groups_are_trained_off_as_versions_arrive() -> None:
    clock = Clock()
    a = Admission(clock=clock)
    a.on_version(5, 2)
    for _ in range(4):
        a.on_handed(3.0)
    assert a.pending == 4
    clock.t += 2.0
    a.on_version(7, 2)  # two steps: 4 groups trained, all of them this generator's
    assert a.pending == 0
    assert a.step_s.value == pytest.approx(1.0)
    assert a.own_share.value == pytest.approx(1.0)
    assert a.other_steps_per_group() == 0.0
    assert a.cap_groups(4, 2, 4) == 8  # Little's law with nothing else feeding the trainer: gps * max_staleness


def test_a_trainer_fed_by_others_caps_the_open_groups_and_warns_with_the_numbers() -> None:
    clock = Clock()
    a = Admission(clock=clock)
    a.on_version(1, 2)
    a.on_handed(20.0)  # an agent's group lived 20 s
    for v in range(2, 12):  # ten steps, one a second, fed by someone else but for that one group
        clock.t += 1.0
        a.on_version(v, 2)
    assert a.other_steps_per_group() > 15
    assert a.cap_groups(4, 2, 4) == 1
    warning = a.too_slow(max_staleness=4, episode_timeout_s=60.0)
    assert warning is not None
    assert "20.0 s" in warning and "max_staleness 4" in warning and "episode.episode_timeout_s 60 s" in warning
    assert "at least" in warning
    assert Admission().too_slow(4, 60.0) is None  # nothing measured: no warning


def test_the_explicit_limit_counts_whole_groups() -> None:
    a = Admission(max_open_episodes=9)
    assert a.cap_groups(4, 2, 4) == 2
    assert room(a, [5, 5], 5, ms=4) == 0
    assert Admission(max_open_episodes=1).cap_groups(4, 2, 4) == 1


def test_a_refusal_says_why_and_when_a_slot_frees() -> None:
    a = Admission(max_open_episodes=8)
    a.on_handed(12.0)
    no = a.refusal([5.0, 1.0], 8, 2)
    assert no.retry_after_s == pytest.approx(7.0)  # the oldest group (5 s) ends ~12 s after it started
    assert "2 group(s) (8 episodes)" in no.reason and "BUCKETRL_MAX_OPEN_EPISODES=8" in no.reason
    assert a.refused == 1
    assert Admission().refusal([], 0, 1).retry_after_s == 1.0
