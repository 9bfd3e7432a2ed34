"""Tests marked ``alone`` run with no other test beside them, even when the suite runs on several xdist workers.

Most of the suite waits (on sockets, subprocesses, long-polls), so two workers share the machine's two cores well.
A few tests need the whole machine: they measure time, or bound what a slow machine would waste. Those take an
exclusive lock across the workers; every other test holds the same lock shared. A turnstile in front of it gives the
exclusive side priority, so an ``alone`` test waits for the tests running beside it to finish, not for a gap that may
never come. The wait happens outside the test's phases, so its reported duration is its own.

Waiting for the tests beside it costs the other workers that long, once per exclusive stretch. So the ``alone`` tests
are collected first (:func:`order`; under ``--dist loadfile`` their modules are then handed out first), and a worker
keeps the machine while the next test it runs is ``alone`` too: the stretches come together at the start of a run,
while the other workers have nothing long under way.
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


def order(items: list[pytest.Item]) -> None:
    """Put the ``alone`` tests first (in their order), so their modules are handed out first."""
    items.sort(key=lambda item: not _is_alone(item))


_exclusive: list[int] = []  # the turnstile and machine descriptors while this worker holds the machine


def _is_alone(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    folder = _lock_dir(item.config)
    if folder is None:
        yield
        return
    if _is_alone(item):
        if not _exclusive:
            turnstile, machine = _open(folder / "turnstile"), _open(folder / "machine")
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            fcntl.flock(machine, fcntl.LOCK_EX)
            _exclusive.extend((turnstile, machine))
        try:
            yield
        finally:
            if not _is_alone(nextitem):  # the last of a stretch: hand the machine back
                for fd in reversed(_exclusive):
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
                _exclusive.clear()
        return
    turnstile, machine = _open(folder / "turnstile"), _open(folder / "machine")
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(machine, fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
    finally:
        os.close(turnstile)
        os.close(machine)
