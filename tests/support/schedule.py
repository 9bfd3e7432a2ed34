"""The order in which ``make test`` hands modules to its workers: longest first.

Under ``--dist loadfile`` a module is a unit of work, and an idle worker takes the next unit in collection order
(``--no-loadscope-reorder``: pytest-xdist's default order is by number of tests, which puts fifty one-millisecond
tests before one three-minute run). With two workers, a three-minute module handed out last leaves the other worker
idle for up to three minutes at the end of the run. Handing out the longest modules first (the classic
longest-processing-time rule) keeps the two busy until a run's last minutes, which only short modules fill.

How long a module takes comes from ``tests/durations.json``: each module's seconds, summed from a run's
``build/test-times.json`` by ``scripts/test_durations.py`` (``make durations``). A module it does not know yet (new
since the file was written) is estimated from its tests and their marks, so a new end-to-end module is not handed
out last.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parent.parent / "durations.json"

# Estimates for a module the durations file does not know: per test, and once for a module with an end-to-end mark.
UNKNOWN_TEST_S = 1.0
UNKNOWN_SLOW_MODULE_S = 60.0
SLOW_MARKS = ("slow", "vllm", "containers", "browser")


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load(path: Path = DURATIONS) -> dict[str, float]:
    """The durations file's seconds per module; an absent or unreadable file is no knowledge, not an error."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    modules = data.get("modules") if isinstance(data, dict) else None
    if not isinstance(modules, dict):
        return {}
    return {str(k): float(v) for k, v in modules.items() if isinstance(v, int | float)}


def estimates(items: list[pytest.Item], known: dict[str, float]) -> dict[str, float]:
    """Seconds per module of ``items``: from ``known`` where it has the module, else from its tests and marks."""
    counts: dict[str, int] = {}
    slow: set[str] = set()
    for item in items:
        module = module_of(item.nodeid)
        counts[module] = counts.get(module, 0) + 1
        if any(item.get_closest_marker(m) is not None for m in SLOW_MARKS):
            slow.add(module)
    return {
        module: known[module]
        if module in known
        else n * UNKNOWN_TEST_S + (UNKNOWN_SLOW_MODULE_S if module in slow else 0.0)
        for module, n in counts.items()
    }


def longest_first(items: list[pytest.Item], known: dict[str, float] | None = None) -> None:
    """Sort ``items`` so that modules come longest first; a module's own tests keep their order (the sort is stable).

    Run before :func:`tests.support.alone.order`, which then puts the ``alone`` tests ahead of everything.
    """
    seconds = estimates(items, load() if known is None else known)
    items.sort(key=lambda item: -seconds[module_of(item.nodeid)])
