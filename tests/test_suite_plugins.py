"""The suite's own plugins, run on a small suite of their own: ``alone`` tests never overlap another test across xdist
workers, the longest modules are handed out first, and every run writes each test's time and outcome to its times
file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

RECORD = """
import os, time

def record(name):
    start = time.monotonic()
    time.sleep(0.3)
    with open(os.environ["SPANS"], "a") as f:
        f.write(f"{name} {start} {time.monotonic()} {os.environ['PYTEST_XDIST_WORKER']}\\n")
"""
# Three modules, so that under --dist loadfile both workers have shared tests to run beside each other.
MODULES = {
    "test_a.py": """
import pytest
from spans import record

@pytest.mark.parametrize("i", range(3))
def test_shared(i):
    record(f"shared-a{i}")

@pytest.mark.alone
@pytest.mark.parametrize("i", range(3))
def test_alone(i):
    record(f"alone{i}")

def test_fails():
    assert False
""",
    "test_b.py": """
import pytest
from spans import record

@pytest.mark.parametrize("i", range(3))
def test_shared(i):
    record(f"shared-b{i}")
""",
    "test_c.py": """
import pytest
from spans import record

@pytest.mark.parametrize("i", range(3))
def test_shared(i):
    record(f"shared-c{i}")
""",
}
# test_c is known to be the longest of the shared modules: it must be handed out before test_b, which comes before it
# in collection order and in pytest-xdist's own order (by number of tests, a tie here).
CONFTEST = """
from tests.support import alone, schedule
pytest_plugins = ["tests.support.timings", "tests.support.alone"]

def pytest_collection_modifyitems(items):
    schedule.longest_first(items, known={"test_a.py": 1.0, "test_b.py": 1.0, "test_c.py": 100.0})
    alone.order(items)
"""


Run = tuple[subprocess.CompletedProcess[str], list[tuple[str, float, float, str]], Path]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One run of the small suite on two workers, read by both tests."""
    tmp_path = tmp_path_factory.mktemp("mini")
    (tmp_path / "spans.py").write_text(RECORD)
    for name, text in MODULES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: whole machine\n")
    spans = tmp_path / "spans.txt"
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}:{tmp_path}",
        "SPANS": str(spans),
        "BUCKETRL_TEST_TIMES": str(tmp_path / "t.json"),
    }
    args = ["-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line.split() for line in spans.read_text().splitlines()]
    return proc, [(name, float(a), float(b), worker) for name, a, b, worker in lines], tmp_path / "t.json"


def test_alone_tests_overlap_no_other_test_across_workers(run: Run) -> None:
    proc, spans, _ = run
    assert proc.returncode == 1, proc.stdout[-2000:]  # test_fails failed, the rest ran
    assert len(spans) == 12
    # The shared tests do overlap each other (two workers), so the check below is not empty-handed.
    shared = [s for s in spans if s[0].startswith("shared")]
    assert any(a[1] < b[2] and b[1] < a[2] for a in shared for b in shared if a is not b)
    for name, start, end, _ in spans:
        if name.startswith("alone"):
            beside = [o for o in spans if o[0] != name and o[1] < end and start < o[2]]
            assert not beside, (name, beside)
    # One worker ran them back to back: the machine was handed over once, not once per alone test.
    alone = sorted(s for s in spans if s[0].startswith("alone"))
    assert len({s[3] for s in alone}) == 1
    first, last = min(s[1] for s in alone), max(s[2] for s in alone)
    assert not [s for s in shared if s[1] < last and first < s[2]], "a shared test ran between the alone ones"


def test_every_test_has_its_time_and_outcome(run: Run) -> None:
    times = json.loads(run[2].read_text())
    by_name = {t["name"]: t for t in times["tests"]}
    assert len(by_name) == 13 and times["workers"] == 2
    assert by_name["test_a.py::test_fails"]["outcome"] == "failed"
    assert all(0.3 <= t["seconds"] < 30 for n, t in by_name.items() if not n.endswith("test_fails"))
    assert {t["worker"] for t in times["tests"]} == {"gw0", "gw1"}


def test_the_longest_module_is_handed_out_first(run: Run) -> None:
    _, spans, _ = run
    first = {m: min(s[1] for s in spans if s[0].startswith(f"shared-{m}")) for m in "bc"}
    assert first["c"] < first["b"], first


class _Item:
    """What the schedule reads of a pytest item: its node id and its marks."""

    def __init__(self, nodeid: str, *marks: str) -> None:
        self.nodeid, self._marks = nodeid, marks

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self._marks else None


def test_modules_are_sorted_longest_first_and_unknown_ones_estimated_from_their_marks() -> None:
    from tests.support import schedule

    items = [
        _Item("tests/a.py::t1"),
        _Item("tests/a.py::t2"),
        _Item("tests/new_fast.py::t"),
        _Item("tests/new_e2e.py::t", "slow"),
        _Item("tests/b.py::t1"),
        _Item("tests/b.py::t2"),
    ]
    schedule.longest_first(items, known={"tests/a.py": 5.0, "tests/b.py": 30.0})  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "tests/new_e2e.py::t",  # unknown, but end-to-end: 61 s estimated
        "tests/b.py::t1",
        "tests/b.py::t2",  # a module's tests keep their order
        "tests/a.py::t1",
        "tests/a.py::t2",
        "tests/new_fast.py::t",  # unknown, one plain test: 1 s
    ]


def test_the_durations_file_is_read_and_a_broken_one_is_no_knowledge(tmp_path: Path) -> None:
    from tests.support import schedule

    good = tmp_path / "d.json"
    good.write_text(json.dumps({"modules": {"tests/x.py": 12.5, "tests/y.py": "bad"}}))
    assert schedule.load(good) == {"tests/x.py": 12.5}
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert schedule.load(broken) == {} and schedule.load(tmp_path / "absent.json") == {}
    # The committed file is readable and covers most of the suite's modules.
    assert len(schedule.load()) > 100


def test_make_durations_sums_each_module_and_says_what_is_missing(tmp_path: Path) -> None:
    times = tmp_path / "times.json"
    times.write_text(
        json.dumps(
            {
                "wall_seconds": 10,
                "load_1m": 1.0,
                "tests": [
                    {"name": "tests/x.py::a", "seconds": 1.25},
                    {"name": "tests/x.py::b[1]", "seconds": 2.0},
                    {"name": "tests/y.py::C::d", "seconds": 7.0},
                ],
            }
        )
    )
    out = tmp_path / "durations.json"
    script = [sys.executable, str(ROOT / "scripts" / "test_durations.py")]
    done = subprocess.run([*script, "--times", str(times), "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["modules"] == {"tests/y.py": 7.0, "tests/x.py": 3.2}
    missing = subprocess.run(
        [*script, "--times", str(tmp_path / "none.json"), "--out", str(out)], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "run make test first" in missing.stderr
    assert json.loads(out.read_text())["modules"]["tests/x.py"] == 3.2  # the old file is left as it was
