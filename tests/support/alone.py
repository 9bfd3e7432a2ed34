"""Tests marked ``alone`` run with no other test beside them, even when the suite runs on several xdist workers.

Most of the suite waits (on sockets, subprocesses, long-polls), so two workers share the machine's two cores well.
A few tests need the whole machine: they measure time, or train for a fixed wall-clock budget. Those take an
exclusive lock across the workers; every other test holds the same lock shared. A turnstile in front of it gives the
exclusive side priority, so an ``alone`` test waits for the test running beside it to finish, not for a gap that may
never come. The wait happens outside the test's phases, so its reported duration is its own.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def _lock_dir(config: pytest.Config) -> Path | None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return None  # one process: nothing runs beside anything
    path = Path(tempfile.gettempdir()) / f"bucketrl-alone-{workerinput['testrunuid']}"
    path.mkdir(exist_ok=True)
    return path


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    folder = _lock_dir(item.config)
    if folder is None:
        yield
        return
    turnstile, shared = _open(folder / "turnstile"), _open(folder / "machine")
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if item.get_closest_marker("alone") is not None:
            fcntl.flock(shared, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(shared, fcntl.LOCK_UN)
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            fcntl.flock(shared, fcntl.LOCK_SH)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(shared, fcntl.LOCK_UN)
    finally:
        os.close(turnstile)
        os.close(shared)
