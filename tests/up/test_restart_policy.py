"""`bucketrl up` gives up on a service only when it keeps dying quickly (issue 10, item 5): N deaths within M
seconds, not a number of restarts over the run's whole life (the 6th trainer kill of a long run ended it)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bucketrl.up.config import UpConfig
from bucketrl.up.processes import RestartPolicy, Service


def test_deaths_spread_over_a_long_run_never_end_it_a_crash_loop_does() -> None:
    policy = RestartPolicy(max_deaths=5, window_s=60.0)
    spread = [i * 61.0 for i in range(40)]  # 40 kills, one a minute: a long run under chaos
    assert not any(policy.crash_looping(spread[: i + 1], now=t) for i, t in enumerate(spread))
    burst = [1000.0 + i for i in range(5)]  # five deaths in five seconds
    assert [policy.crash_looping(burst[: i + 1], now=t) for i, t in enumerate(burst)] == [False] * 4 + [True]
    assert UpConfig(restart_max_deaths=3, restart_window_s=10).restart_policy == RestartPolicy(3, 10.0)


def test_a_real_service_is_judged_by_its_recent_deaths(tmp_path: Path) -> None:
    svc = Service("crasher", [sys.executable, "-c", "raise SystemExit(1)"], tmp_path / "crasher.log")
    slow = RestartPolicy(max_deaths=3, window_s=0.3)
    for _ in range(6):  # six deaths, each outside the window of the one two before it: restarted every time
        svc.start().wait(30)
        assert svc.returncode == 1
        assert not svc.record_death(slow)
        time.sleep(0.35)
    svc = Service("looper", svc.argv, tmp_path / "looper.log")
    fast = RestartPolicy(max_deaths=3, window_s=60.0)
    looping = []
    for _ in range(3):
        svc.start().wait(30)
        looping.append(svc.record_death(fast))
    assert looping == [False, False, True] and svc.starts == 3
