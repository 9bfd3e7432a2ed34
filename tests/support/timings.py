"""Where the suite's time goes: every run writes each test's seconds and outcome to ``build/test-times.json``.

The slowest tests are also printed at the end of every ``make test`` (pytest's ``--durations``, set in the Makefile);
this file is for reading a run back, or comparing two (``docs/testing.md``). Under pytest-xdist the controller
receives every worker's reports, so the file is written once, by it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

_times: dict[str, dict[str, object]] = {}
_started = time.monotonic()


def _path(config: pytest.Config) -> Path:
    return Path(os.environ.get("BUCKETRL_TEST_TIMES") or config.rootpath / "build" / "test-times.json")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _times.setdefault(report.nodeid, {"name": report.nodeid, "seconds": 0.0, "outcome": "passed"})
    entry["seconds"] = float(entry["seconds"]) + report.duration  # type: ignore[arg-type]
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
    # On the xdist controller a report carries the worker it came from.
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)
    if isinstance(worker, str):
        entry["worker"] = worker


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput") or not _times:
        return
    tests = sorted(_times.values(), key=lambda t: -float(t["seconds"]))  # type: ignore[arg-type]
    for t in tests:
        t["seconds"] = round(float(t["seconds"]), 3)  # type: ignore[arg-type]
    out = _path(session.config)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "wall_seconds": round(time.monotonic() - _started, 1),
        "test_seconds": round(sum(float(t["seconds"]) for t in tests), 1),  # type: ignore[arg-type]
        "workers": getattr(session.config.option, "numprocesses", None) or 0,
        "load_1m": round(os.getloadavg()[0], 2),
        "tests": tests,
    }
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.replace(out)
