"""The staleness guard's decisions (bucketrl/generator/staleness_guard.py) on a fake clock: a call is abandoned the
step its version leaves the window, a worker whose calls span more versions than the window leases nothing (and
says why, once), and leases again when the versions come slower. The end-to-end check with processes is
test_slow_class.py."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from bucketrl.generator.adapters import VersionBook, VersionSlot
from bucketrl.generator.metrics import GeneratorMetrics
from bucketrl.generator.staleness_guard import StaleCall, StalenessGuard
from bucketrl.rollout.engine import SampledCompletion
from bucketrl.wire import RunSpec, SamplingSpec
from tests.generator.helpers import run_spec


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class SteppingEngine:
    """A call of ``steps`` steps of ``step_s``; ``each_step`` runs before the hook (a version publishes)."""

    def __init__(self, clock: Clock, steps: int, step_s: float, each_step: Callable[[int], None]) -> None:
        self.clock, self.steps, self.step_s, self.each_step = clock, steps, step_s, each_step
        self.ran = 0

    def generate(
        self,
        prompts: list[list[int]],
        *,
        adapter: str,
        n: int,
        sampling: SamplingSpec,
        while_running: Callable[[], None],
    ) -> list[list[SampledCompletion]]:
        for i in range(self.steps):
            self.clock.t += self.step_s
            self.ran = i + 1
            self.each_step(i)
            while_running()
        return [[SampledCompletion([1], [-0.1], "stop")] * n for _ in prompts]


def setup(tmp_path: Path, enabled: bool = True) -> tuple[Clock, VersionBook, StalenessGuard, GeneratorMetrics, RunSpec]:
    clock, book, metrics = Clock(), VersionBook("r"), GeneratorMetrics()
    spec = run_spec(tmp_path, max_staleness=2)
    return clock, book, StalenessGuard(book, lambda: spec, metrics, enabled=enabled, clock=clock), metrics, spec


def publish(book: VersionBook, guard: StalenessGuard, clock: Clock, every_s: float, n: int) -> None:
    for _ in range(n):
        clock.t += every_s
        book.newest_known += 1
        guard.observe()


def test_a_call_is_abandoned_the_step_its_version_leaves_the_window(tmp_path: Path) -> None:
    clock, book, guard, metrics, spec = setup(tmp_path)
    book.newest_known = 5
    guard.observe()
    slot = VersionSlot(5, "r-v5", "lease", tmp_path, 0.0, loaded=True)

    def every_other_step(i: int) -> None:  # a version every 2 s, 1 s steps: v8 (out of v5's window) at step 6
        if i % 2 == 1:
            book.newest_known += 1

    engine = SteppingEngine(clock, steps=20, step_s=1.0, each_step=every_other_step)
    with pytest.raises(StaleCall, match="v5 left the staleness window"):
        guard.generate(engine, slot, [[1], [2]], spec, hook=lambda: None)  # type: ignore[arg-type]
    assert engine.ran == 6  # abandoned at once, not at the call's 20th step
    snap = metrics.snapshot()
    assert snap["rollout/stale_abandoned_total"] == 2
    assert snap["rollout/stale_held_prompt_s_total"] == 0  # seen and abandoned within the same step
    assert guard.call_s == 12.0  # the time so far (a lower bound of the call's), counted twice


def test_a_worker_whose_calls_outlast_the_window_leases_nothing_until_versions_slow(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock, book, guard, metrics, spec = setup(tmp_path)
    assert guard.admits()  # nothing measured yet: sample, and learn
    publish(book, guard, clock, every_s=1.0, n=4)
    slot = VersionSlot(book.newest_known, "r-v", "lease", tmp_path, 0.0, loaded=True)
    guard.generate(SteppingEngine(clock, 5, 0.1, lambda i: None), slot, [[1]], spec, lambda: None)  # type: ignore[arg-type]
    assert guard.call_s == pytest.approx(0.5)
    assert guard.admits()  # a 0.5 s call spans half a version: fine
    guard.call_s = 3.5  # a slow class: 3.5 versions per call, the window holds 2
    with caplog.at_level(logging.WARNING, logger="bucketrl.generator.staleness_guard"):
        assert not guard.admits() and not guard.admits()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned  # once per spell, naming the numbers and the settings to change
    assert "3.5s" in warned[0] and "max_staleness=2" in warned[0] and "BUCKETRL_STALENESS_GUARD" in warned[0]
    assert metrics.snapshot()["rollout/stale_guard_declining"] == 1.0
    stop = threading.Event()
    stop.set()  # hold_back's wait returns at once
    assert guard.hold_back(stop)
    clock.t += 2.0  # the trainer waits for groups: 3 s since the last version, the call spans ~1.2
    assert guard.admits() and not guard.hold_back(stop)
    assert metrics.snapshot()["rollout/stale_guard_declining"] == 0.0


def test_disabled_the_guard_only_measures(tmp_path: Path) -> None:
    clock, book, guard, metrics, spec = setup(tmp_path, enabled=False)
    book.newest_known = 5
    guard.observe()
    slot = VersionSlot(5, "r-v5", "lease", tmp_path, 0.0, loaded=True)

    def each_step(i: int) -> None:
        book.newest_known += 1
        guard.observe()

    out = guard.generate(SteppingEngine(clock, 10, 1.0, each_step), slot, [[1]], spec, lambda: None)  # type: ignore[arg-type]
    assert len(out) == 1  # not abandoned
    guard.call_s = 10.0  # 10 versions per call
    assert guard.admits()
    snap = metrics.snapshot()
    assert "rollout/stale_abandoned_total" not in snap
    assert snap["rollout/stale_held_prompt_s_total"] == 7.0  # v8 (step 3) to the call's end (step 10)


def test_on_policy_calls_that_span_under_a_version_and_announced_versions(tmp_path: Path) -> None:
    clock, book, metrics, spec = Clock(), VersionBook("r"), GeneratorMetrics(), run_spec(tmp_path, max_staleness=0)
    guard = StalenessGuard(book, lambda: spec, metrics, clock=clock)
    publish(book, guard, clock, every_s=1.0, n=3)
    guard.call_s = 0.8  # strictly on-policy: the trainer waits for these groups, so a call spans < 1 version
    assert guard.admits()
    slot = VersionSlot(book.newest_known, "r-v", "lease", tmp_path, 0.0, loaded=True)

    def announced(i: int) -> None:  # heard of by the long-poll, its download still running
        book.announced = book.newest_known + 1

    with pytest.raises(StaleCall):
        guard.generate(SteppingEngine(clock, 5, 0.1, announced), slot, [[1]], spec, lambda: None)  # type: ignore[arg-type]
